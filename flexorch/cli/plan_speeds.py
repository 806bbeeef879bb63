"""`flexorch plan --speeds`: plan for a mixed or degraded cluster, and show what planning around its speeds buys.

``--speeds`` gives each worker a relative speed (1.0 = the others; 0.5 = half as fast: a throttled GPU, a busy host;
1.5 = a faster GPU kind beside slower ones), in one of three forms (:func:`parse_speeds`):

* per rank, in rank order: ``--speeds 1,1,0.5,1`` (one per worker);
* per rank index: ``--speeds 3=0.5`` (or ``3:0.5``; the ranks not named run at 1.0);
* per node, with ``--nodes`` / ``--gpus-per-node``: ``--speeds node1=0.7`` (every worker of that node; nodes are
  named ``node0``, ``node1``, ... in rank order). A rank index given beside it overrides its node's speed.

The plans are made and priced with ``Topology(..., speeds=...)`` (``solver.topology``: a group runs at its slowest
member's pace, ``solver.simulator``). :class:`SpeedComparison` plans each batch a second time without the speeds (the
speed-blind planner: what a planner that assumes one speed for every device does), prices that plan with the true
speeds (the same groups on the same ranks), and prints both step times, their ratio, and each rank's share of the
step's tokens (a group of degree d gives each of its ranks 1/d of its tokens), so the user sees the slow worker's
share shrink.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from flexorch.solver.plan import Plan
from flexorch.solver.profiles import Profile
from flexorch.solver.simulator import step_time_ms
from flexorch.solver.topology import Topology

__all__ = ["SpeedComparison", "parse_speeds", "token_shares"]

_FORMS = "one speed per worker (1,1,0.5,1), RANK=SPEED (3=0.5) or NODE=SPEED (node1=0.7)"


def _speed(text, where: str) -> float:
    """One speed: a finite number > 0, else a ValueError naming ``where``."""
    try:
        if isinstance(text, bool):
            raise ValueError
        value = float(text.strip() if isinstance(text, str) else text)
    except (TypeError, ValueError):
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise ValueError(
            f"--speeds: {where} must be a number > 0 (a relative speed: 1.0 = the others, 0.5 = half as fast), "
            f"got {text!r}"
        )
    return value


def _entries(value) -> list:
    """The entries of ``--speeds``: a string split at commas, a list as is, a table as (key, speed) pairs."""
    if isinstance(value, dict):
        return [(str(k), v) for k, v in value.items()]
    if isinstance(value, list | tuple):
        return list(value)
    if isinstance(value, str):
        if not value.strip():
            raise ValueError(f"--speeds is empty; give {_FORMS}")
        return [e.strip() for e in value.split(",")]
    raise ValueError(f"--speeds must be {_FORMS}; got {value!r}")


def _pair(entry) -> tuple[str, object] | None:
    """A keyed entry as (key, speed text), None for a plain speed."""
    if isinstance(entry, tuple):
        return entry
    if isinstance(entry, str):
        for sep in ("=", ":"):
            if sep in entry:
                key, _, text = entry.partition(sep)
                return key.strip(), text
    return None


def parse_speeds(value, workers: int, nodes: tuple[int, ...] | None = None) -> tuple[float, ...] | None:
    """``--speeds`` (a string from the command line; a list or a table from a config file) as one speed per rank
    (rank order), or None when not given. ``nodes``: live workers per node (``--nodes``), for the per-node form.
    Every mistake is a ValueError naming the flag and the entry, raised before anything is planned."""
    if value is None:
        return None
    n = int(workers)
    entries = _entries(value)
    pairs = [_pair(e) for e in entries]
    if all(p is None for p in pairs):
        if len(entries) != n:
            raise ValueError(
                f"--speeds gives {len(entries)} speed(s) for {n} workers; give one per worker in rank order, or "
                "RANK=SPEED / NODE=SPEED pairs (the others run at 1.0)"
            )
        return tuple(_speed(e, f"the speed of rank {r}") for r, e in enumerate(entries))
    if any(p is None for p in pairs):
        raise ValueError(f"--speeds mixes plain speeds and KEY=SPEED pairs ({value!r}); give {_FORMS}")
    return _keyed(pairs, n, nodes)


def _keyed(pairs: list[tuple[str, object]], n: int, nodes) -> tuple[float, ...]:
    """Per node first, then per rank index (a rank named beside its node takes its own speed)."""
    keys = [k for k, _ in pairs]
    twice = sorted({k for k in keys if keys.count(k) > 1})
    if twice:
        raise ValueError(f"--speeds names {twice[0]!r} twice")
    topo = Topology(tuple(nodes)) if nodes else None
    speeds = [1.0] * n
    by_rank = []
    for key, text in pairs:
        if key.lstrip("-").isdigit():
            rank = int(key)
            if not 0 <= rank < n:
                raise ValueError(f"--speeds: rank {rank} is outside the {n} workers (ranks 0-{n - 1})")
            by_rank.append((rank, _speed(text, f"the speed of rank {rank}")))
            continue
        if topo is None:
            raise ValueError(
                f"--speeds {key}={text} names a node, but the plan has none: give --nodes or --gpus-per-node "
                "(nodes are named node0, node1, ... in rank order), or name ranks (3=0.5)"
            )
        names = topo.names()
        if key not in names:
            raise ValueError(f"--speeds: unknown node {key!r}; the nodes are {', '.join(names)}")
        i = names.index(key)
        start, size = topo.node_starts[i], topo.node_sizes[i]
        speeds[start : start + size] = [_speed(text, f"the speed of node {key}")] * size
    for rank, speed in by_rank:
        speeds[rank] = speed
    return tuple(speeds)


def token_shares(plan: Plan) -> list[float]:
    """Each rank's share of the step's tokens: a group of degree d gives each of its ranks 1/d of its sequences'
    tokens (SP splits a sequence evenly over its group)."""
    held = [0.0] * plan.num_devices
    for mb in plan.micro_batches:
        for g in mb.groups:
            tokens = sum(plan.seq_lengths[i] for i in g.seq_ids) / g.degree
            for r in g.ranks:
                held[r] += tokens
    total = sum(held)
    return [h / total if total > 0 else 0.0 for h in held]


def _shares_text(shares, speeds, limit: int = 16) -> str:
    """'rank 0 (1.00x) 26.1%, ...': every rank up to ``limit`` ranks, else the ranks off 1.0 and the others' mean."""
    n = len(shares)
    if n <= limit:
        return ", ".join(f"rank {r} ({speeds[r]:.2f}x) {shares[r] * 100:.1f}%" for r in range(n))
    off = [r for r in range(n) if speeds[r] != 1.0]
    parts = [f"rank {r} ({speeds[r]:.2f}x) {shares[r] * 100:.2f}%" for r in off[:limit]]
    if len(off) > limit:
        parts.append(f"+{len(off) - limit} more off 1.0")
    rest = [shares[r] for r in range(n) if speeds[r] == 1.0]
    if rest:
        parts.append(f"the {len(rest)} at 1.00x {np.mean(rest) * 100:.2f}% each on average")
    return ", ".join(parts)


@dataclasses.dataclass
class SpeedComparison:
    """Each step's speed-aware plan beside the speed-blind one, both priced with ``speeds`` (one per rank)."""

    speeds: tuple[float, ...]
    aware_ms: list[float] = dataclasses.field(default_factory=list)
    blind_ms: list[float] = dataclasses.field(default_factory=list)
    aware_shares: list[list[float]] = dataclasses.field(default_factory=list)
    blind_shares: list[list[float]] = dataclasses.field(default_factory=list)

    def compare(self, planner, seqs, num_devices: int, blind_topology, priced: Topology, aware, profile: Profile):
        """Plan ``seqs`` without the speeds (on ``blind_topology``: the aware plan's nodes, or None for one node),
        price that plan on ``priced`` (the nodes with the speeds) and keep it beside ``aware`` (the PlannedStep
        planned with them); returns the line printed under the step's row."""
        blind = planner.plan(seqs, num_devices, with_baselines=False, topology=blind_topology)
        if blind.plan is None:  # the aware planner held the batch, so the blind one (more freedom) does too
            raise RuntimeError(f"the speed-blind planner could not plan a batch the aware one did: {blind.error}")
        blind_plan = dataclasses.replace(blind.plan, topology=priced)
        self.blind_ms.append(step_time_ms(blind_plan, profile))
        self.aware_ms.append(aware.predicted_ms)
        self.aware_shares.append(token_shares(aware.plan))
        self.blind_shares.append(token_shares(blind_plan))
        slow = [r for r, s in enumerate(self.speeds) if s < 1.0]
        shown = ", ".join(
            f"rank {r} ({self.speeds[r]:.2f}x) {self.aware_shares[-1][r] * 100:.1f}% (blind "
            f"{self.blind_shares[-1][r] * 100:.1f}%)"
            for r in slow[:4]
        )
        return (
            f"{'':>4} speeds: speed-blind plan {self.blind_ms[-1]:.0f} ms at these speeds, aware "
            f"{self.aware_ms[-1]:.0f} ms: {self.blind_ms[-1] / self.aware_ms[-1]:.2f}x"
            + (f"; tokens {shown}" if shown else "")
        )

    def summary(self, out) -> None:
        """The speeds, the aware/blind ratio over the steps (median, min, max) and each rank's mean token share."""
        ratios = np.array(self.blind_ms) / np.array(self.aware_ms)
        off = [(r, s) for r, s in enumerate(self.speeds) if s != 1.0]
        named = ", ".join(f"rank {r} {s:.2f}x" for r, s in off[:8])
        named += f" (+{len(off) - 8} more)" if len(off) > 8 else ""
        print(
            f"speeds (simulated, 1.0 = the others): {named or 'all 1.0'}; every plan above is priced with them",
            file=out,
        )
        print(
            "  speed-aware vs speed-blind plans (same batch, both priced with the speeds): median "
            f"{np.median(ratios):.2f}x (min {ratios.min():.2f}x, max {ratios.max():.2f}x); step median aware "
            f"{np.median(self.aware_ms):.0f} ms, blind {np.median(self.blind_ms):.0f} ms",
            file=out,
        )
        aware = np.mean(self.aware_shares, axis=0)
        blind = np.mean(self.blind_shares, axis=0)
        print(f"  share of the step's tokens per rank, speed-aware: {_shares_text(aware, self.speeds)}", file=out)
        print(f"  share of the step's tokens per rank, speed-blind: {_shares_text(blind, self.speeds)}", file=out)
