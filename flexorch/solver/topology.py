"""The cluster's shape as the planner sees it: live workers per node, in rank order.

Ranks are contiguous per node: node 0 holds ranks ``0 .. node_sizes[0] - 1``, node 1 the next ``node_sizes[1]``, and
so on. A group whose ranks lie on one node talks over the node's fast link (NVLink: ~100 GB/s per A100 in FlexSP's
table); a group that spans nodes crosses the slow one (InfiniBand: 5-10 GB/s), and the cost model prices it so
(``solver.cost_model``: ``spans``). A frozen value that validates itself; no Ray, no torch.

**Speeds.** Each rank may run at its own pace (``speeds``, one relative factor per rank: a throttled GPU, a busy host,
a faster GPU kind beside slower ones; 1.0 is "the others", estimated per step by ``solver.worker_speeds``). A group
runs at its slowest member's pace (its collectives wait for it), so the cost model's time of a group on ``ranks`` is
divided by :meth:`Topology.speed_of` (``solver.simulator``), and the planner prices each group type at the speeds
the ranks it may lie on have (``solver.packing.group_types``, ``solver.placement``).
"""

from __future__ import annotations

import bisect
import math
from collections import Counter
from dataclasses import dataclass
from functools import cached_property

__all__ = ["Topology", "TopologyError"]


class TopologyError(ValueError):
    """A topology that cannot be: an empty node, a name count that does not match, ranks outside it."""


@dataclass(frozen=True)
class Topology:
    """Live workers per node, in rank order (ranks contiguous per node)."""

    node_sizes: tuple[int, ...]
    """Workers alive on each node, in rank order; each >= 1."""
    node_names: tuple[str, ...] = ()
    """Optional node names (host or Ray node id), one per node; empty: ``node0``, ``node1``, ..."""
    speeds: tuple[float, ...] = ()
    """Each rank's relative speed, in rank order (a group runs at its slowest member's); empty: all 1.0."""

    def __post_init__(self) -> None:
        sizes = self.node_sizes
        if isinstance(sizes, list):
            object.__setattr__(self, "node_sizes", sizes := tuple(sizes))
        if isinstance(self.node_names, list):
            object.__setattr__(self, "node_names", tuple(self.node_names))
        if not isinstance(sizes, tuple) or not sizes:
            raise TopologyError(f"node_sizes must be a non-empty tuple of worker counts, got {sizes!r}")
        bad = [(i, s) for i, s in enumerate(sizes) if not isinstance(s, int) or isinstance(s, bool) or s < 1]
        if bad:
            raise TopologyError(f"every node needs >= 1 live worker (an int); node {bad[0][0]} has {bad[0][1]!r}")
        names = self.node_names
        if names and len(names) != len(sizes):
            raise TopologyError(f"{len(names)} node_names for {len(sizes)} nodes; give one per node or none")
        if names and len(set(names)) != len(names):
            raise TopologyError(f"node_names must be distinct, got {list(names)}")
        speeds = self.speeds
        if not isinstance(speeds, tuple):
            object.__setattr__(self, "speeds", speeds := tuple(speeds))
        if speeds:
            if len(speeds) != sum(sizes):
                raise TopologyError(f"{len(speeds)} speeds for {sum(sizes)} ranks; give one per rank or none")
            bad = [(r, v) for r, v in enumerate(speeds) if isinstance(v, bool) or not isinstance(v, int | float)
                   or not math.isfinite(v) or v <= 0]  # fmt: skip
            if bad:
                raise TopologyError(f"every speed must be a finite number > 0; rank {bad[0][0]} has {bad[0][1]!r}")
            if all(v == 1.0 for v in speeds):
                object.__setattr__(self, "speeds", ())  # all 1.0: the same topology as none given
            else:
                object.__setattr__(self, "speeds", tuple(float(v) for v in speeds))

    # ---- constructors

    @classmethod
    def single(cls, n: int) -> Topology:
        """One node of n workers: every group lies inside it (the planner's behaviour without a topology)."""
        return cls((int(n),))

    @classmethod
    def uniform(cls, num_nodes: int, per_node: int) -> Topology:
        """``num_nodes`` nodes of ``per_node`` workers each."""
        if not isinstance(num_nodes, int) or num_nodes < 1:
            raise TopologyError(f"num_nodes must be an int >= 1, got {num_nodes!r}")
        return cls((per_node,) * num_nodes)

    @classmethod
    def from_dict(cls, raw) -> Topology:
        """The object :meth:`to_dict` writes (``{"node_sizes": [...], "node_names": [...]}``)."""
        if not isinstance(raw, dict) or "node_sizes" not in raw:
            raise TopologyError(f"a topology is an object with 'node_sizes', got {raw!r}")
        unknown = sorted(set(raw) - {"node_sizes", "node_names", "speeds"})
        if unknown:
            raise TopologyError(f"unknown topology fields {unknown}; known: node_sizes, node_names, speeds")
        return cls(tuple(raw["node_sizes"]), tuple(raw.get("node_names") or ()), tuple(raw.get("speeds") or ()))

    def to_dict(self) -> dict:
        out: dict = {"node_sizes": list(self.node_sizes)}
        if self.node_names:
            out["node_names"] = list(self.node_names)
        if self.speeds:
            out["speeds"] = list(self.speeds)
        return out

    def with_speeds(self, speeds) -> Topology:
        """This topology with each rank's speed ``speeds`` (rank order; empty or all 1.0: none)."""
        return Topology(self.node_sizes, self.node_names, tuple(speeds))

    def without_speeds(self) -> Topology:
        """This topology with every rank at 1.0 (the speed-blind planner's view)."""
        return Topology(self.node_sizes, self.node_names)

    # ---- queries

    @property
    def uniform_speed(self) -> bool:
        """Every rank at 1.0."""
        return not self.speeds

    def rank_speeds(self) -> tuple[float, ...]:
        """Each rank's speed (1.0 for all without speeds)."""
        return self.speeds or (1.0,) * self.num_devices

    def speed_of(self, ranks) -> float:
        """The pace of a group on ``ranks``: its slowest member's speed (1.0 without speeds)."""
        if not self.speeds:
            return 1.0
        return min(self.speeds[r] for r in ranks)

    @property
    def num_devices(self) -> int:
        return sum(self.node_sizes)

    @property
    def num_nodes(self) -> int:
        return len(self.node_sizes)

    @property
    def max_node_size(self) -> int:
        return max(self.node_sizes)

    @property
    def nominal_node_size(self) -> int:
        """The most common node size (ties to the larger): the node a full machine has, before workers were lost."""
        counts = Counter(self.node_sizes)
        return max(counts, key=lambda s: (counts[s], s))

    @cached_property
    def node_starts(self) -> tuple[int, ...]:
        """First rank of each node."""
        out, r = [], 0
        for s in self.node_sizes:
            out.append(r)
            r += s
        return tuple(out)

    def names(self) -> tuple[str, ...]:
        return self.node_names or tuple(f"node{i}" for i in range(self.num_nodes))

    def node_of(self, rank: int) -> int:
        """The node that holds ``rank``."""
        if not isinstance(rank, int) or not 0 <= rank < self.num_devices:
            raise TopologyError(f"rank {rank!r} is outside the topology's {self.num_devices} ranks")
        return bisect.bisect_right(self.node_starts, rank) - 1

    def node_ranks(self) -> list[int]:
        """The node of every rank 0..N-1."""
        return [i for i, s in enumerate(self.node_sizes) for _ in range(s)]

    def spans(self, ranks) -> bool:
        """Do ``ranks`` lie on more than one node?"""
        ranks = list(ranks)
        if not ranks:
            return False
        first = self.node_of(min(ranks))
        return self.node_of(max(ranks)) != first or any(self.node_of(r) != first for r in ranks)

    def placement(self, ranks, kind: str = "ulysses", ulysses_degree: int | None = None) -> dict:
        """The cost model's placement keywords for a group on ``ranks`` (``solver.cost_model.seq_times_ms``):
        ``spans`` (the ranks lie on more than one node) and, for a hybrid group, ``ulysses_degree`` and
        ``ulysses_spans`` (some ring position of ``ulysses_degree`` consecutive ranks itself spans nodes)."""
        ranks = list(ranks)
        out: dict = {"spans": self.spans(ranks)}
        if kind == "hybrid":
            u = int(ulysses_degree)
            out["ulysses_degree"] = u
            out["ulysses_spans"] = any(self.spans(ranks[j : j + u]) for j in range(0, len(ranks), u))
        return out

    def intra_capacity(self, d: int) -> int:
        """Devices that groups of degree >= d (powers of two) can use without any of them crossing a node:
        ``d * sum over nodes of floor(size / d)`` (groups of divisible sizes pack into the nodes iff, for every d,
        the groups of degree >= d need no more; see ``solver.placement``)."""
        return d * sum(s // d for s in self.node_sizes)

    def describe(self) -> str:
        """'3 nodes: 8, 8, 7' (runs folded: '8 nodes: 8x7, 7')."""
        parts, prev, run = [], None, 0
        for s in [*self.node_sizes, None]:
            if s == prev:
                run += 1
                continue
            if prev is not None:
                parts.append(f"{prev}x{run}" if run > 1 else f"{prev}")
            prev, run = s, 1
        out = f"{self.num_nodes} node{'s' if self.num_nodes > 1 else ''}: {', '.join(parts)}"
        off = [(r, v) for r, v in enumerate(self.speeds) if v != 1.0]
        if off:
            shown = ", ".join(f"rank {r} {v:.2f}x" for r, v in off[:4])
            out += f"; speeds {shown}{f' (+{len(off) - 4} more)' if len(off) > 4 else ''}"
        return out
