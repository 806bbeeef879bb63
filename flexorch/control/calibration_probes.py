"""The calibration probes: which to run and running them (``flexorch.control.calibration`` fits what they measure).

The probes are sized to the per-worker token budget with no document longer than ``data.max_context``: compute
probes run every worker alone (SP degree 1), group probes one micro-batch per group of every degree d <= N and kind.
On several nodes (the worker group's ``rank_nodes``, ``control.membership.world_topology``; not with ``[plan]
topology = "blind"``) each degree a node holds is probed with groups inside the nodes, and each degree that can span
with groups across node boundaries (``flexorch.workers.calibrate.group_starts``).

Each probe is its own call on the workers, cut to its share of ``PROBES_S`` a run (predicted from the largest probe
of its degree so far), with progress while they run; a probe that outlasts the call's limit is a
:class:`CalibrationTimeoutError` that names it.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Protocol

from flexorch.control.failures import MembershipFailure
from flexorch.control.membership import world_topology
from flexorch.solver.topology import Topology
from flexorch.workers.calibrate import Probe, group_starts

__all__ = [
    "CalibrationTimeoutError",
    "MIN_RUN_S",
    "PROBES_S",
    "PROGRESS_EVERY_S",
    "calibration_probes",
    "calibration_topology",
    "cut_note",
    "probe_run_s",
    "run_calibration_probes",
]

PROBES_S = 60.0
"""About how long the probes may take in all: each run of a probe gets its share, ``PROBES_S`` over all the runs
(at least ``MIN_RUN_S``), and a probe predicted longer (from the largest probe of its degree run so far) is cut to
fewer tokens. A large device budget (a GPU's free memory at full recompute's bytes) would otherwise make probes of
hundreds of thousands of tokens, minutes each. The fit needs the shapes, not the size (its terms are per token and
per token squared)."""
MIN_RUN_S = 0.1
PROGRESS_EVERY_S = 10.0
"""While the probes run: a progress event at most this often, naming the probe."""


class CalibrationTimeoutError(RuntimeError):
    """A calibration probe outlasted the workers' call limit; the message names it and what to change."""


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


class ProbedGroup(Protocol):
    """What calibration needs of a worker group: its size, a call on every rank, and each rank's node. A
    ``control.group.WorkerGroup`` is one; so is a single worker driven in-process (``benchmarks/gpu``)."""

    size: int

    def call(self, method: str, *args) -> list: ...

    def rank_nodes(self) -> list[str | None]: ...


def calibration_topology(group: ProbedGroup, cfg) -> Topology | None:
    """The nodes the worker group's ranks lie on (``group.rank_nodes()``, ``control.membership.world_topology``);
    None (probed as one node) on one node, where a rank's node is unknown, or with ``[plan] topology = "blind"``."""
    if cfg.plan.topology == "blind":
        return None
    nodes = list(group.rank_nodes())
    if len(nodes) != group.size or any(n is None for n in nodes):
        return None
    return world_topology(range(len(nodes)), nodes, group.size)


def _probe_text(p: Probe) -> str:
    docs = f"{len(p.lengths)} documents" if len(p.lengths) > 1 else "1 document"
    where = "alone" if p.degree == 1 else f"in {p.kind} groups of {p.degree}"
    if p.placement:
        where += " inside nodes" if p.placement == "intra" else " across nodes"
    return f"{sum(p.lengths):,} tokens as {docs}, each worker {where}"


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


def cut_note(planned, ran) -> str:
    """'; N of M probes cut to about X s a run (Y s in all)' when :func:`run_calibration_probes` cut any of the
    ``planned`` probes (``ran``: as they ran), else ''."""
    cut = sum(a != b for a, b in zip(ran, planned, strict=True))
    if not cut:
        return ""
    return f"; {cut} of {len(ran)} probes cut to about {probe_run_s(ran):.2g} s a run ({PROBES_S:g} s in all)"


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
        except MembershipFailure as e:
            if not e.failure.timed_out:  # only workers that ran past the call's limit make this a probe's timeout
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
