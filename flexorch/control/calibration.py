"""Calibrate the cost model on the real workers (``flexorch profile``, and ``plan.profile = "auto"`` at start).

Every probe runs on all workers at once, exactly like a training micro-batch (same sharding, SP attention and
kernels, all workers busy, so a shared machine is as loaded as during training):

1. compute probes: every worker alone (SP degree 1) on single long documents and on many short ones packed;
   fitted to ``b1 + a1 * sum s^2 + a2 * sum s`` (FlexSP §4.1.2);
2. group probes for every degree d <= N and kind: one micro-batch per group; what the compute fit does not
   explain (``group ms - b1 - compute / d``) is the communication, fitted to ``latency + bytes / bandwidth``
   per (kind, d) (flexorch's latency extension, docs/design.md §7). On several nodes (the worker group's
   ``rank_nodes``, ``control.membership.world_topology``; not with ``[plan] topology = "blind"``) each degree a
   node holds is probed with groups inside the nodes, and each degree that can span with groups across node
   boundaries (``flexorch.workers.calibrate.group_starts``): the first fill the profile's intra-node tables, the
   second its ``inter_*`` ones;
3. activation bytes per token from the tensors autograd saves (``flexorch.workers.activation_memory``).

The fit lives in ``solver.calibration`` (pure); the report says how well the fitted profile predicts every
probe.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import time
from pathlib import Path

import numpy as np

from flexorch.control.membership import world_topology
from flexorch.solver.calibration import (
    CommSample,
    ComputeSample,
    GroupSample,
    fit_group_comm,
    fit_profile,
    intra_from_inter,
    prediction_errors,
)
from flexorch.solver.errors import ProfileError
from flexorch.solver.profiles import Profile, get_profile
from flexorch.solver.step_planner import planner_profile
from flexorch.solver.topology import Topology
from flexorch.workers.calibrate import Probe, group_starts

__all__ = [
    "CalibrationTimeoutError",
    "calibration_probes",
    "calibration_topology",
    "calibrate",
    "calibrate_on_workers",
    "resolve_profile",
    "run_profile",
]


# fit_profile needs an all-to-all table entry; where nothing was measured (the compute-only fit, one worker, ring
# only) these stand in and are never used for a Ulysses group of the run
_A2A_PLACEHOLDER = [CommSample(kind="ulysses", degree=2, tokens_per_rank=t, ms=1.0) for t in (1, 2)]


def model_state_plan(cfg, world_size: int):
    """The model-state bytes a worker holds in a world of ``world_size`` under the run's sharding
    (``flexorch.solver.model_state``): whole replicas, 1/world (fsdp) or 1/shard_size (hsdp) of the resident state,
    plus what FSDP gathers in flight."""
    from flexorch.config.sharding import effective_shard_size
    from flexorch.solver.model_state import model_state_bytes

    mode = cfg.sharding_mode
    shards = effective_shard_size(mode, world_size, cfg.sharding.shard_size)
    if cfg.pipelined and mode != "replicate":  # a stage's parts over its workers; the stage model takes its share
        shards = max(1, world_size // cfg.pipeline.stages)
    param_bytes = 2 if cfg.precision == "bf16" else 4
    frozen = None if cfg.model.base_trainable else (lambda name: ".lora." not in name)  # the tasks' adapters train
    return model_state_bytes(
        cfg.model.param_shapes(), shards, sharded=mode != "replicate", param_bytes=param_bytes,
        gather=cfg.sharding.gather, frozen=frozen,
    )  # fmt: skip


def model_state_fields(cfg, world_size: int) -> dict:
    """The ``model_state`` of a step record: the sharding in force and the plan's bytes per worker (each rank's
    measured ``state_bytes`` is beside it in ``ranks``)."""
    from flexorch.config.sharding import effective_shard_size

    plan = model_state_plan(cfg, world_size)
    return {
        "mode": cfg.sharding_mode,
        "shards": effective_shard_size(cfg.sharding_mode, world_size, cfg.sharding.shard_size),
        "precision": cfg.precision,
        "activation_checkpointing": cfg.recompute,
        "plan_resident_bytes": plan.resident,
        "plan_in_flight_bytes": plan.in_flight,
    }


def calibration_probes(
    tokens_per_worker: int,
    workers: int,
    kinds,
    repeats: int = 5,
    max_context: int | None = None,
    topology: Topology | None = None,
) -> tuple[list, list]:
    """(compute probes, group probes) sized to the per-worker token budget, with no document longer than
    ``max_context`` (the run never sees one): a group probe's tokens are then several documents of at most
    ``max_context``, so its collectives move what a full micro-batch moves without the cost of a document the data
    cannot hold (a 16K-token probe document for a 512-token corpus outlasted the call's time limit on 2 cores).

    ``topology`` of several nodes: each degree's probes twice over where both fit, once with groups inside the
    nodes (``placement="intra"``) and once across node boundaries (``"inter"``); None or one node: aligned blocks."""
    if topology is not None and topology.num_devices != workers:
        raise ValueError(f"calibration_probes: a topology of {topology.num_devices} workers for {workers} workers")
    placements = ("intra", "inter") if topology is not None and topology.num_nodes > 1 else ("",)
    cap = tokens_per_worker
    longest = max_context or cap * workers

    def docs(total: int) -> tuple[int, ...]:  # total tokens as near-equal documents of at most `longest`
        n = -(-total // longest)
        return tuple(total // n + (i < total % n) for i in range(n))

    singles = sorted({max(16, min(longest, cap) // k) for k in (16, 8, 4, 2, 1)})  # a1's range: up to the longest
    packed = [(16,) * max(1, cap // 32), (32,) * max(1, cap // 64), (64,) * max(1, cap // 128)]
    compute = [Probe(1, "ulysses", (s,), repeats) for s in singles] + [Probe(1, "ulysses", p, repeats) for p in packed]
    groups = []
    d = 2
    while d <= workers:
        for placement in placements:
            starts = group_starts(d, topology.node_sizes, placement) if placement else None
            if starts == ():  # no group of d fits this way (inside a node too small, or across nodes that hold none)
                continue
            where = dict(starts=starts, placement=placement) if placement else {}
            for kind in kinds:
                for per_rank in sorted({max(16, cap // 8), max(16, cap // 2), cap}):
                    groups.append(Probe(d, kind, docs(per_rank * d), repeats, **where))
                groups.append(Probe(d, kind, (32,) * max(1, d * cap // 128), repeats, **where))
        d *= 2
    return compute, groups


def calibration_topology(group, cfg) -> Topology | None:
    """The nodes the worker group's ranks lie on (``group.rank_nodes()``, ``control.membership.world_topology``);
    None (probed as one node) on one node, where a rank's node is unknown, or with ``[plan] topology = "blind"``."""
    rank_nodes = getattr(group, "rank_nodes", None)  # a fake group of the tests may have none
    if rank_nodes is None or getattr(cfg.plan, "topology", "aware") == "blind":
        return None
    nodes = list(rank_nodes())
    if len(nodes) != group.size or any(n is None for n in nodes):
        return None
    return world_topology(range(len(nodes)), nodes, group.size)


def _probe_text(p: Probe) -> str:
    docs = f"{len(p.lengths)} documents" if len(p.lengths) > 1 else "1 document"
    where = "alone" if p.degree == 1 else f"in {p.kind} groups of {p.degree}"
    if p.placement:
        where += " inside nodes" if p.placement == "intra" else " across nodes"
    return f"{sum(p.lengths):,} tokens as {docs}, each worker {where}"


PROBES_S = 60.0
"""About how long the probes may take in all: each run of a probe gets its share, ``PROBES_S`` over all the runs
(at least ``MIN_RUN_S``), and a probe predicted longer (from the largest probe of its degree run so far) is cut to
fewer tokens. A device budget of ~870K tokens (an H200's free memory at full recompute's bytes for a 1.1B model)
made packed probes of 435K tokens, 17 s a run and 100 s a probe; on 4 CPU workers a 100K-token budget took 220 s
with 2 s a run. The fit needs the shapes, not the size (its terms are per token and per token squared)."""
MIN_RUN_S = 0.1
PROGRESS_EVERY_S = 10.0
"""While the probes run: a progress event at most this often, naming the probe."""


class CalibrationTimeoutError(RuntimeError):
    """A calibration probe outlasted the workers' call limit; the message names it and what to change."""


def _per_rank(p: Probe) -> int:
    return max(1, sum(p.lengths) // p.degree)


def _cut(p: Probe, per_rank: int) -> Probe:
    """``p`` with at most ``per_rank`` tokens per rank (at least 16): documents dropped from its end, or its one
    document shortened."""
    total = max(16, per_rank) * p.degree
    if sum(p.lengths) <= total:
        return p
    keep = list(itertools.takewhile(lambda n: n <= total, itertools.accumulate(p.lengths)))
    lengths = p.lengths[: len(keep)] if keep else (total,)
    return dataclasses.replace(p, lengths=tuple(lengths))


def probe_run_s(probes) -> float:
    """The seconds one run of a probe may take: ``PROBES_S`` shared by every run of every probe."""
    return max(MIN_RUN_S, PROBES_S / max(1, sum(p.repeats + 1 for p in probes)))


def run_calibration_probes(group, probes, publish, t0: float) -> tuple[list[Probe], list[list[float]]]:
    """Every probe on every rank, one call each (each call has the group's time limit, so a slow machine does not
    add the probes up against one limit), each cut to about :func:`probe_run_s` a run; (the probes as run,
    [rank][probe] median ms). Progress every ``PROGRESS_EVERY_S``. A probe that outlasts the limit is a clear error
    that says which probe and what to change."""
    per_rank, ran, said = [], [], time.perf_counter()
    run_ms = 1e3 * probe_run_s(probes)
    # (degree, placement) -> (tokens per rank, ms per token) of its largest probe so far
    rate: dict[tuple[int, str], tuple[int, float]] = {}
    for i, p in enumerate(probes):
        _, ms_per_token = rate.get((p.degree, p.placement)) or rate.get((1, "")) or (0, 0.0)
        if ms_per_token > 0 and _per_rank(p) * ms_per_token > run_ms:
            p = _cut(p, int(run_ms / ms_per_token))
        if time.perf_counter() - said >= PROGRESS_EVERY_S:
            said = time.perf_counter()
            msg = f"calibrating: probe {i + 1} of {len(probes)} ({_probe_text(p)}) after {said - t0:.0f} s"
            publish({"event": "progress", "message": msg})
        try:
            per_rank.append([ms for (ms,) in group.call("probe", [p])])  # [rank] median ms of this probe
        except Exception as e:
            # a RayWorkerGroup's MembershipFailure whose workers ran past the call's limit (not imported: this
            # module runs without Ray too, e.g. benchmarks/gpu/gpu_check.py on a machine that lacks it)
            if not getattr(getattr(e, "failure", None), "timed_out", None):
                raise
            raise CalibrationTimeoutError(
                f"calibration probe {i + 1} of {len(probes)} ({_probe_text(p)}, {p.repeats + 1} runs) did not "
                f"finish in time: {e}. Raise [elastic] collective_timeout_s, lower plan.tokens_per_worker or "
                f"data.max_context, or set plan.profile to a calibrated profile file (flexorch profile)"
            ) from e
        ran.append(p)
        if _per_rank(p) >= rate.get((p.degree, p.placement), (0, 0.0))[0]:
            rate[p.degree, p.placement] = (_per_rank(p), max(per_rank[-1]) / _per_rank(p))
    return ran, [list(ms) for ms in zip(*per_rank, strict=True)]


def calibrate(group, cfg, *, repeats: int = 5, publish=None) -> tuple[Profile, dict]:
    """Run the probes on a formed worker group and fit a profile; returns (profile, report). ``publish`` gets a
    progress event as each phase starts (a ``RayWorkerGroup`` built with one also reports while its calls run)."""
    t0 = time.perf_counter()
    publish = publish or (lambda event: None)
    model = cfg.model
    kinds = tuple(cfg.plan.kinds)
    topology = calibration_topology(group, cfg)
    compute, groups = calibration_probes(
        cfg.tokens_per_worker, group.size, kinds, repeats, cfg.data.max_context, topology
    )
    on = f" ({topology.describe()})" if topology is not None else ""
    msg = (
        f"calibrating the cost model on {group.size} worker{'s' * (group.size != 1)}{on}: {len(compute)} compute "
        f"and {len(groups)} group probes, {repeats} runs each"
    )
    publish({"event": "progress", "message": msg})
    ran, per_rank = run_calibration_probes(group, compute + groups, publish, t0)  # [rank][probe] median ms
    cut = sum(a != b for a, b in zip(ran, compute + groups, strict=True))
    compute, groups = ran[: len(compute)], ran[len(compute) :]
    msg = f"calibrating: probes done after {time.perf_counter() - t0:.0f} s; measuring activation memory"
    publish({"event": "progress", "message": msg})
    ms = np.max(np.array(per_rank), axis=0)  # a group is as slow as its slowest member
    comp_samples = [ComputeSample(seq_lengths=p.lengths, ms=float(m)) for p, m in zip(compute, ms, strict=False)]
    act = float(np.median(group.call("activation_bytes_per_token")))
    dims = _profile_dims(cfg, act)
    # the compute fit alone first: it says how much of a group's time is not compute
    base, _ = fit_profile(
        "compute-only",
        **dims,
        compute_samples=comp_samples,
        comm_samples=_A2A_PLACEHOLDER,
    )
    comm_samples, group_samples = _group_samples(base, groups, ms[len(compute) :])
    placeholder = not any(c.kind == "ulysses" for c in comm_samples)
    if placeholder:  # one worker or ring only: a2a table needs an entry
        comm_samples += _A2A_PLACEHOLDER
    name = f"calibrated-{model.num_layers}x{model.dim}-{group.size}w"
    profile, fit = fit_profile(name, **dims, compute_samples=comp_samples, comm_samples=comm_samples)
    notes = fit.notes
    if placeholder:  # what the fit says of the placeholder's Ulysses entry is about groups this run cannot form
        notes = tuple(n for n in notes if not n.startswith("ulysses-"))
    group_fit, inter_group_fit = {}, {}
    placed = {(p.kind, p.degree, p.placement == "inter") for p in groups}
    for kind, d, spans in sorted(placed):  # match the cost model's own group formula
        profile, err = fit_group_comm(profile, group_samples, kind, d, spans=spans)
        (inter_group_fit if spans else group_fit)[f"{kind}-{d}"] = dataclasses.asdict(err)
        if spans and (kind, d, False) not in placed:  # no node holds the degree: the intra figure is this one
            profile = intra_from_inter(profile, kind, d)
    errors = np.abs(prediction_errors(profile, comp_samples + group_samples))
    report = {
        "profile": name,
        "seconds": time.perf_counter() - t0,
        "fit": fit.to_dict(),
        "group_fit": group_fit,
        "probes": [s.to_dict() for s in comp_samples + group_samples],
        "median_rel_error": float(np.median(errors)),
        "max_rel_error": float(np.max(errors)),
        "act_bytes_per_token": act,
    }
    if topology is not None:  # which groups were measured inside a node and which across, and how each predicts
        report["topology"] = topology.to_dict()
        report["inter_group_fit"] = inter_group_fit
        report.update(_placement_errors(profile, group_samples))
    report["message"] = _report_message(profile, report, group.size, len(errors), (cut, ran), notes)
    return profile, report


def _profile_dims(cfg, act: float) -> dict:
    """The model's shape and memory terms of the fitted profile (``act``: activation bytes per token)."""
    model = cfg.model
    # what the executor holds per worker in the run's sharding mode, at the elastic floor (the largest share)
    state_bytes = model_state_plan(cfg, cfg.min_workers).total
    return dict(
        num_layers=model.num_layers,
        hidden=model.dim,
        num_heads=model.num_heads,
        num_kv_heads=model.num_kv_heads,
        bytes_per_element=2 if cfg.precision == "bf16" else 4,  # what SP collectives move per element
        act_bytes_per_token=act,
        memory_budget_bytes=state_bytes + (cfg.tokens_per_worker + 0.5) * act,
        model_state_bytes=state_bytes,
    )


def _placement_errors(profile: Profile, group_samples) -> dict:
    """The fitted profile's median and max relative error over the group probes inside nodes and across them."""
    out = {}
    for key, spans in (("intra", False), ("inter", True)):
        errors = np.abs(prediction_errors(profile, [s for s in group_samples if s.spans == spans]))
        if errors.size:
            out[f"{key}_median_rel_error"] = float(np.median(errors))
            out[f"{key}_max_rel_error"] = float(np.max(errors))
    return out


def _group_samples(base: Profile, groups, ms) -> tuple[list[CommSample], list[GroupSample]]:
    """Each group probe's time as a collective sample (its time less the compute ``base`` predicts) and as a group
    sample (its whole time); a probe across nodes gives samples that span nodes."""
    comm_samples, group_samples = [], []
    for p, m in zip(groups, ms, strict=True):
        s = np.asarray(p.lengths, dtype=np.float64)
        spans = p.placement == "inter"
        compute_ms = base.b1_ms + float((base.a1_ms * s * s + base.a2_ms * s).sum()) / p.degree
        tokens = int(s.sum()) // p.degree
        comm_samples.append(
            CommSample(kind=p.kind, degree=p.degree, tokens_per_rank=tokens, ms=max(0.01, m - compute_ms), spans=spans)
        )
        group_samples.append(GroupSample(seq_lengths=p.lengths, degree=p.degree, kind=p.kind, ms=float(m), spans=spans))
    return comm_samples, group_samples


def _report_message(profile: Profile, report: dict, workers: int, probes: int, cut_of, notes) -> str:
    """The calibration's console line: the fitted terms and the prediction error over the probes, how many probes
    were cut to fit the time (``cut_of``: (count, the probes as run)), then the fit's notes, one line each."""
    cut, ran = cut_of
    msg = (
        f"calibrated on {workers} worker{'s' * (workers != 1)} in {report['seconds']:.1f} s: "
        f"a1={profile.a1_ms:.3g} ms/tok^2 "
        f"a2={profile.a2_ms:.3g} ms/tok b1={profile.b1_ms:.3g} ms, latency a2a {_fmt(profile.a2a_latency_ms)} "
        f"p2p {_fmt(profile.p2p_latency_ms)}; {report['act_bytes_per_token']:,.0f} activation bytes/token; "
        f"prediction error over {probes} probes: median {100 * report['median_rel_error']:.1f} %, max "
        f"{100 * report['max_rel_error']:.1f} %"
    )
    if "topology" in report:
        msg += (
            f"; across nodes ({Topology.from_dict(report['topology']).describe()}): latency a2a "
            f"{_fmt(profile.inter_a2a_latency_ms)} p2p {_fmt(profile.inter_p2p_latency_ms)}, bandwidth a2a "
            f"{_fmt(profile.inter_a2a_gbps, 'GB/s')} p2p {_fmt(profile.inter_p2p_gbps, 'GB/s')} (inside a node: "
            f"a2a {_fmt(profile.a2a_gbps, 'GB/s')} p2p {_fmt(profile.p2p_gbps, 'GB/s')}); prediction error inside "
            f"nodes {_pct(report, 'intra')}, across nodes {_pct(report, 'inter')}"
        )
    if cut:
        msg += f"; {cut} of {len(ran)} probes cut to about {probe_run_s(ran):.2g} s a run ({PROBES_S:g} s in all)"
    # a bandwidth clamped because no byte cost showed is a fact about the probes, not a problem to act on
    return msg + "".join(f"\n{'note' if ' clamped to ' in n else 'warning'}: {n}" for n in notes)


def _fmt(table: dict, unit: str = "ms") -> str:
    """A degree table as '{2: 1.50 ms, 4: ...}' (latencies) or '{2: 10 GB/s, ...}' (bandwidths)."""
    cells = (f"{d}: {v:.2f} ms" if unit == "ms" else f"{d}: {v:.3g} {unit}" for d, v in sorted(table.items()))
    return "{" + ", ".join(cells) + "}"


def _pct(report: dict, where: str) -> str:
    """'median M %, max X %' of the group probes ``where`` ('intra'/'inter'), or 'not measured'."""
    if f"{where}_median_rel_error" not in report:
        return "not measured"
    median, top = report[f"{where}_median_rel_error"], report[f"{where}_max_rel_error"]
    return f"median {100 * median:.1f} %, max {100 * top:.1f} %"


def calibrate_on_workers(cfg) -> tuple[Profile, dict]:
    """Start the run's workers, calibrate, stop them (``flexorch profile``)."""
    from flexorch.control.worker_group import RayWorkerGroup

    group = RayWorkerGroup.from_config(cfg)
    try:
        group.form_world()
        return calibrate(group, cfg)
    finally:
        group.shutdown()


def resolve_profile(cfg, group, run_dir: Path, publish) -> Profile:
    """The run's base profile: calibrated now ('auto'; reused on resume), built-in, or from a JSON file."""
    spec = cfg.plan.profile
    path = Path(run_dir) / "profile.json"
    if spec != "auto":
        try:
            return get_profile(spec)
        except ProfileError as e:
            raise ProfileError(f"plan.profile: {e}") from None
    if cfg.resume and path.is_file():
        publish({"event": "calibrated", "message": f"profile: reusing {path} from the run being resumed"})
        return get_profile(str(path))
    profile, report = calibrate(group, cfg, publish=publish)
    path.write_text(profile.to_json())
    (Path(run_dir) / "calibration.json").write_text(json.dumps(report, indent=1))
    publish({"event": "calibrated", "message": f"profile: {report['message']} -> {path}"})
    return profile


def run_profile(cfg, group, run_dir: Path, publish, activation_budget_bytes: float | None = None) -> Profile:
    """The profile a run plans with: :func:`resolve_profile` fitted to the model's heads, layers and per-worker
    token budget, with the model-state bytes the executor holds in the run's sharding mode (SP runs); a pipelined
    run also measures what a stage holds on a worker's own model (a fraction of a second,
    ``flexorch.workers.calibrate.stage_activation_bytes``)."""
    base = resolve_profile(cfg, group, run_dir, publish)
    stage_bytes = tuple(group.call("stage_activation_bytes")[0]) if cfg.pipelined else None
    return fitted_profile(base, cfg, stage_bytes, activation_budget_bytes)


def fitted_profile(
    base: Profile,
    cfg,
    stage_bytes: tuple[float, float] | None = None,
    activation_budget_bytes: float | None = None,
) -> Profile:
    """``base`` fitted to the run (``flexorch.solver.step_planner.planner_profile``): the model's heads, layers and
    vocabulary, the per-worker token budget, and (SP runs) the model-state bytes the executor holds. No worker: the CLI
    also calls it before Ray starts, to refuse a fixed profile that does not fit the model."""
    return planner_profile(
        base,
        num_heads=cfg.model.num_heads,
        num_kv_heads=cfg.model.num_kv_heads,
        tokens_per_worker=cfg.tokens_per_worker,
        num_layers=cfg.model.num_layers,
        vocab_size=cfg.model.vocab_size,
        stage_bytes=stage_bytes,
        model_state_bytes=None if cfg.pipelined else model_state_plan(cfg, cfg.min_workers).total,
        activation_budget_bytes=activation_budget_bytes,
    )
