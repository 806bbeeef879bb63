"""What a trained step's record says about the cost model: one sample per group it ran (its sequences, degree, kind,
where it lay and its measured time) and the step as the planner priced it, for the refit (``solver.refit``) and the
step level (``solver.step_level``).

A record's plan names the nodes it was placed on (``plan.topology``): a group whose ranks lie on more than one node
is a sample of the inter-node figures (``GroupSample.spans``), and the step is priced with each group where it lay
(``Plan.placement``). A hybrid group is no sample of its own: its price is made of the 1-D figures of its parts
(Ulysses inside a node, ring across), which the 1-D groups refit.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from flexorch.solver.calibration import ComputeSample, GroupSample
from flexorch.solver.cost_model import HYBRID
from flexorch.solver.profiles import Profile
from flexorch.solver.simulator import span_ms
from flexorch.solver.topology import Topology

__all__ = ["StepSample", "group_placement", "plan_topology", "samples_of_record", "step_of_record", "time_scales"]


def time_scales(record: dict, ratios: dict[str, float] | None) -> list[list[float]] | None:
    """Per micro-batch, each group's time factor against full recompute: ``ratios[mode]`` for the mode the record ran
    it in ('auto' recompute's ``recompute``; ``Profile.mode_time_ratios``); None without per-group modes."""
    modes = record.get("recompute")
    if not modes or not ratios:
        return None
    return [[ratios.get(m, 1.0) for m in row] for row in modes]


def samples_of_record(record: dict, ratios: dict[str, float] | None = None) -> list[ComputeSample | GroupSample]:
    """One sample per group of a trained SP step's record: its sequences, degree, kind and measured time (the slowest
    of its ranks' ``micro_batch_ms``). Empty for pipelined, skipped and plan-only records, and for groups a lost rank
    did not report. A group run without recompute or with selective recompute ('auto' recompute) counts as its time
    divided by its mode's ratio in ``ratios``: what it would have taken with full recompute, the mode the time terms
    describe. A group with a slow worker counts as its time times its slowest rank's ``speed`` (the driver's
    estimate in the record's rank entries, ``solver.worker_speeds``; absent: 1.0): what it would have taken at the
    others' pace, so a slow worker does not bend the fit."""
    if record.get("source") != "train" or record.get("pipeline") is not None or not record.get("plan"):
        return []
    ranks = record.get("ranks") or []
    scales = time_scales(record, ratios)
    topology = plan_topology(record)
    out: list[ComputeSample | GroupSample] = []
    for mi, mb in enumerate(record["plan"]["micro_batches"]):
        for gi, g in enumerate(mb):
            times = [ranks[r]["micro_batch_ms"][mi] if r < len(ranks) and ranks[r] else None for r in g["ranks"]]
            if any(t is None or not t > 0 for t in times) or g["kind"] == HYBRID:
                continue  # a hybrid group's price is made of the 1-D figures its parts use: those are refitted
            lengths = tuple(int(s) for s in g["seq_lengths"])
            ms = float(max(times)) * _rank_speed(ranks, g["ranks"]) / (1.0 if scales is None else scales[mi][gi])
            if g["degree"] == 1:
                out.append(ComputeSample(seq_lengths=lengths, ms=ms))
            else:
                spans = topology is not None and topology.spans(g["ranks"])
                out.append(GroupSample(seq_lengths=lengths, degree=g["degree"], kind=g["kind"], ms=ms, spans=spans))
    return out


def _rank_speed(ranks: list, group_ranks) -> float:
    """The pace a record's group ran at: its slowest rank's ``speed`` (1.0 where a rank entry has none)."""
    speeds = [ranks[r].get("speed") for r in group_ranks]
    return min((float(v) for v in speeds if isinstance(v, int | float) and v > 0), default=1.0)


def plan_topology(record: dict) -> Topology | None:
    """The nodes the record's plan was placed on (None: one node)."""
    raw = record["plan"].get("topology")
    return None if raw is None else Topology.from_dict(raw)


def group_placement(g: dict, topology: Topology | None) -> dict:
    """The cost model's placement keywords of a record's group (``Plan.placement``)."""
    if topology is not None:
        return topology.placement(tuple(g["ranks"]), g["kind"], g.get("ulysses_degree"))
    return {"ulysses_degree": g["ulysses_degree"]} if g["kind"] == HYBRID else {}


@dataclasses.dataclass(frozen=True)
class StepSample:
    """One trained SP step as the planner sees it: per micro-batch, its groups as ``(seq_lengths, degree, kind)``;
    ``ms`` the measured step (the record's ``measured_ms``: dispatch to the last outcome, what the console shows
    beside the prediction), ``compute_ms`` its micro-batches (slowest rank, start to end of its micro-batches)."""

    micro_batches: tuple[tuple[tuple[tuple[int, ...], int, str], ...], ...]
    ms: float
    compute_ms: float = 0.0
    scales: tuple[tuple[float, ...], ...] = ()
    """Per micro-batch, each group's time factor ('auto' recompute: its mode's time ratio); empty: 1 everywhere."""
    placements: tuple[tuple[dict, ...], ...] = ()
    """Per micro-batch, each group's placement keywords (``Plan.placement``: whether it spans nodes, a hybrid
    group's Ulysses degree); empty: every group inside one node."""

    def predict_ms(self, profile: Profile) -> float:
        """The planner's prediction: micro-batches one after another, each as long as its slowest group, each group
        in its recompute mode (``solver.simulator.span_ms``, the one price the planner and the records use), plus
        the step's fixed costs (``profile.step_ms``): ``solver.simulator.step_time_ms`` of the plan that ran."""
        total = 0.0
        for mi, mb in enumerate(self.micro_batches):
            lengths = np.fromiter((s for lens, _d, _k in mb for s in lens), dtype=np.int64)
            groups, start = [], 0
            for gi, (lens, d, kind) in enumerate(mb):
                place = self.placements[mi][gi] if self.placements else {}
                scale = self.scales[mi][gi] if self.scales else 1.0
                groups.append((range(start, start + len(lens)), d, kind, scale, place))
                start += len(lens)
            total += span_ms(groups, lengths, profile)
        return total + profile.step_ms


def step_of_record(record: dict, ratios: dict[str, float] | None = None) -> StepSample | None:
    """The step of a trained SP step's record, None for pipelined, skipped and plan-only records; a group run in a
    mode other than full recompute is priced at ``ratios[mode]`` of its time with full recompute, and a group on
    ranks the plan gave speeds (``plan.topology.speeds``) at its slowest rank's pace, as the plan was priced
    (``solver.simulator``)."""
    if record.get("source") != "train" or record.get("pipeline") is not None or not record.get("plan"):
        return None
    ms, compute = record.get("measured_ms"), record.get("compute_ms")
    if not all(isinstance(x, int | float) and x > 0 for x in (ms, compute)):
        return None
    mbs = tuple(
        tuple((tuple(int(s) for s in g["seq_lengths"]), int(g["degree"]), str(g["kind"])) for g in mb)
        for mb in record["plan"]["micro_batches"]
    )
    scales = time_scales(record, ratios)
    topology = plan_topology(record)
    raw = record["plan"]["micro_batches"]
    if topology is not None and not topology.uniform_speed:
        rows = scales or [[1.0] * len(mb) for mb in raw]
        scales = [
            [x / topology.speed_of(g["ranks"]) for g, x in zip(mb, row, strict=True)]
            for mb, row in zip(raw, rows, strict=True)
        ]
    placements = tuple(tuple(group_placement(g, topology) for g in mb) for mb in raw)
    return StepSample(
        micro_batches=mbs,
        ms=float(ms),
        compute_ms=float(compute),
        scales=tuple(map(tuple, scales or ())),
        placements=placements,
    )
