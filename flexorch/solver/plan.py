"""The per-step plan: a frozen value that validates itself on construction and never touches a process group.

A `Plan` splits one step's global batch into micro-batches; each micro-batch splits the N devices into SP groups
(blocks of consecutive ranks, power-of-two sizes; ranks are contiguous per node, so a block can lie inside a node)
and assigns every sequence of the batch to exactly one group of one micro-batch. Workers and the driver only consume
plans.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np

from flexorch.solver.cost_model import GROUP_KINDS, HYBRID, ULYSSES, min_degree
from flexorch.solver.errors import InvalidPlanError
from flexorch.solver.profiles import Profile
from flexorch.solver.topology import Topology

__all__ = ["Group", "MicroBatch", "Plan", "shape_string"]


@dataclass(frozen=True)
class Group:
    """One SP group in one micro-batch."""

    degree: int
    """SP degree d: the number of devices that work on each of this group's sequences together."""
    kind: str
    """Attention method: 'ulysses' (all-to-all, heads sharded), 'ring' (zigzag ring attention) or 'hybrid'
    (Ulysses over ``ulysses_degree`` consecutive ranks, zigzag ring across those blocks)."""
    ranks: tuple[int, ...]
    """The devices (ranks in the current world): ``degree`` consecutive ranks."""
    seq_ids: tuple[int, ...]
    """Indices into the step's batch of the sequences this group runs, in execution order."""
    ulysses_degree: int | None = None
    """A hybrid group's Ulysses degree u (2 <= u, u divides degree, degree / u >= 2): ring position j runs on
    ``ranks[j*u:(j+1)*u]``. None for the other kinds."""

    def __post_init__(self) -> None:
        d = self.degree
        if not isinstance(d, int) or d < 1 or d & (d - 1):
            raise InvalidPlanError(f"group degree must be a power of two >= 1, got {d!r}")
        if self.kind not in GROUP_KINDS:
            raise InvalidPlanError(f"group kind must be one of {GROUP_KINDS}, got {self.kind!r}")
        u = self.ulysses_degree
        if self.kind == HYBRID:
            if not isinstance(u, int) or u < 2 or d % u or d // u < 2:
                raise InvalidPlanError(
                    f"a hybrid group of degree {d} needs ulysses_degree u with 2 <= u, u | {d} and {d} / u >= 2, "
                    f"got {u!r}"
                )
        elif u is not None:
            raise InvalidPlanError(f"only a hybrid group names a ulysses_degree; a {self.kind} group got {u!r}")
        r = self.ranks
        if len(r) != d or r[0] < 0 or any(r[i] != r[0] + i for i in range(d)):
            raise InvalidPlanError(f"group ranks {r} are not a block of {d} consecutive ranks")
        if not self.seq_ids:
            raise InvalidPlanError(f"group on ranks {r[0]}..{r[-1]} has no sequence (drop empty groups)")


@dataclass(frozen=True)
class MicroBatch:
    """The groups that run side by side in one micro-batch; each device is in at most one group."""

    groups: tuple[Group, ...]

    def __post_init__(self) -> None:
        if not self.groups:
            raise InvalidPlanError("a micro-batch needs at least one group")
        seen: set[int] = set()
        for g in self.groups:
            clash = seen.intersection(g.ranks)
            if clash:
                raise InvalidPlanError(f"ranks {sorted(clash)} are in two groups of one micro-batch")
            seen.update(g.ranks)


@dataclass(frozen=True)
class Plan:
    """One step: micro-batches run one after another, gradients accumulate across them."""

    num_devices: int
    """N: the devices (workers) alive for this step; ranks are 0..N-1."""
    seq_lengths: tuple[int, ...]
    """Token count of every sequence of the step's batch; `seq_ids` index this tuple."""
    micro_batches: tuple[MicroBatch, ...]
    """Executed in order."""
    tokens_per_device: int
    """Memory limit: a group of degree d holds at most d * tokens_per_device tokens in one micro-batch (a Ulysses
    group less: ``ulysses_tokens_per_device``)."""
    num_heads: int
    """Query heads of the model: a Ulysses group's degree must divide it."""
    ulysses_tokens_per_device: dict[int, int] = field(default_factory=dict, compare=False, hash=False)
    """Per-device limit of a Ulysses group by degree, where its all-to-all copies make it below
    ``tokens_per_device`` (``Profile.local_token_cap``); degrees not listed use ``tokens_per_device``."""
    meta: dict = field(default_factory=dict, compare=False, hash=False)
    """Free-form provenance (planner name, solver status); not validated, not compared."""
    topology: Topology | None = field(default=None, compare=False, hash=False)
    """The nodes the ranks lie on (``solver.topology``), when the plan was placed knowing them: the cost model
    prices each group by whether it spans nodes (``solver.simulator``). None: one node."""

    def __post_init__(self) -> None:
        n = self.num_devices
        if not isinstance(n, int) or n < 1:
            raise InvalidPlanError(f"num_devices must be a positive integer, got {n!r}")
        if self.topology is not None and self.topology.num_devices != n:
            raise InvalidPlanError(
                f"the plan's topology has {self.topology.num_devices} ranks ({self.topology.describe()}), "
                f"num_devices is {n}"
            )
        k = len(self.seq_lengths)
        if k == 0:
            raise InvalidPlanError("a plan needs at least one sequence")
        if not self._valid_fast():
            self._check_each()  # raises, naming the first broken rule with its numbers

    def _valid_fast(self) -> bool:
        """Every rule of :meth:`_check_each` at once over arrays (a 16,384-sequence plan checks in milliseconds);
        False when one is broken (then :meth:`_check_each` finds it and says which)."""
        n, k = self.num_devices, len(self.seq_lengths)
        groups = [g for mb in self.micro_batches for g in mb.groups]
        if not groups:
            return False
        deg = np.fromiter((g.degree for g in groups), dtype=np.int64, count=len(groups))
        last = np.fromiter((g.ranks[-1] for g in groups), dtype=np.int64, count=len(groups))
        uly = np.fromiter((g.kind == ULYSSES for g in groups), dtype=bool, count=len(groups))
        if any(g.kind == HYBRID and self.num_heads % g.ulysses_degree for g in groups):
            return False
        sizes = np.fromiter((len(g.seq_ids) for g in groups), dtype=np.int64, count=len(groups))
        sids = np.fromiter(itertools.chain.from_iterable(g.seq_ids for g in groups), dtype=np.int64)
        if (last >= n).any() or (uly & (self.num_heads % deg != 0)).any():
            return False
        if sids.size != k or sids.min() < 0 or sids.max() >= k or (np.bincount(sids, minlength=k) != 1).any():
            return False  # every sequence exactly once (k ids, none twice, all in range)
        s = np.asarray(self.seq_lengths, dtype=np.int64)[sids]
        gdeg = np.repeat(deg, sizes)
        if (gdeg < -(-s // self.tokens_per_device)).any():  # a power of two >= ceil(s / tpd) is >= min_degree
            return False
        tokens = np.add.reduceat(s, np.concatenate([[0], np.cumsum(sizes)[:-1]]))
        per = np.fromiter(
            (self.ulysses_tokens_per_device.get(int(d), self.tokens_per_device) if u else self.tokens_per_device
             for d, u in zip(deg, uly, strict=True)),
            dtype=np.int64,
            count=len(groups),
        )  # fmt: skip
        return not (tokens > deg * per).any()

    def _check_each(self) -> None:
        n, k = self.num_devices, len(self.seq_lengths)
        counts = [0] * k
        for mi, mb in enumerate(self.micro_batches):
            for g in mb.groups:
                if g.ranks[-1] >= n:
                    raise InvalidPlanError(f"micro-batch {mi}: group ranks {g.ranks} exceed N={n} devices")
                if g.kind == ULYSSES and self.num_heads % g.degree:
                    raise InvalidPlanError(
                        f"micro-batch {mi}: Ulysses group of degree {g.degree} does not divide "
                        f"num_heads={self.num_heads} (use ring attention or a smaller degree)"
                    )
                if g.kind == HYBRID and self.num_heads % g.ulysses_degree:
                    raise InvalidPlanError(
                        f"micro-batch {mi}: hybrid group's Ulysses degree {g.ulysses_degree} does not divide "
                        f"num_heads={self.num_heads}"
                    )
                tokens = 0
                for sid in g.seq_ids:
                    if not 0 <= sid < k:
                        raise InvalidPlanError(f"micro-batch {mi}: seq_id {sid} outside the batch of {k}")
                    counts[sid] += 1
                    s = self.seq_lengths[sid]
                    need = min_degree(s, self.tokens_per_device)
                    if g.degree < need:
                        raise InvalidPlanError(
                            f"micro-batch {mi}: sequence {sid} of {s} tokens needs degree >= {need} "
                            f"({self.tokens_per_device} tokens per device), got degree {g.degree}"
                        )
                    tokens += s
                per_device = self.tokens_per_device
                if g.kind == ULYSSES:
                    per_device = self.ulysses_tokens_per_device.get(g.degree, per_device)
                cap = g.degree * per_device
                if tokens > cap:
                    raise InvalidPlanError(
                        f"micro-batch {mi}: group on ranks {g.ranks[0]}..{g.ranks[-1]} holds {tokens} tokens, "
                        f"over its memory budget of {cap} ({g.degree} x {per_device})"
                    )
        missing = [i for i, c in enumerate(counts) if c == 0]
        twice = [i for i, c in enumerate(counts) if c > 1]
        if missing or twice:
            raise InvalidPlanError(
                f"every sequence must run exactly once: missing {missing[:10]}"
                f"{'...' if len(missing) > 10 else ''}, more than once {twice[:10]}"
            )

    def shape(self) -> str:
        """Compact shape such as '<32, 16, 8x2> | <1x64>' (group degrees per micro-batch)."""
        return " | ".join(shape_string([g.degree for g in mb.groups]) for mb in self.micro_batches)

    def placement(self, group: Group) -> dict:
        """The cost model's placement keywords for ``group`` (``Topology.placement``; {} without a topology, and
        for a hybrid group without one only its Ulysses degree)."""
        if self.topology is None:
            return {"ulysses_degree": group.ulysses_degree} if group.kind == HYBRID else {}
        return self.topology.placement(group.ranks, group.kind, group.ulysses_degree)

    def to_dict(self) -> dict:
        topo = {} if self.topology is None else {"topology": self.topology.to_dict()}
        return topo | {
            "num_devices": self.num_devices,
            "micro_batches": [
                [
                    {
                        "degree": g.degree,
                        "kind": g.kind,
                        "ranks": list(g.ranks),
                        "seq_lengths": [self.seq_lengths[i] for i in g.seq_ids],
                        "seq_ids": list(g.seq_ids),
                    }
                    | ({"ulysses_degree": g.ulysses_degree} if g.ulysses_degree is not None else {})
                    for g in mb.groups
                ]
                for mb in self.micro_batches
            ],
        }

    @classmethod
    def for_profile(
        cls, *, num_devices: int, seq_lengths, micro_batches, profile: Profile, meta=None, topology=None
    ) -> Plan:
        return cls(
            num_devices=num_devices,
            seq_lengths=tuple(int(s) for s in seq_lengths),
            micro_batches=tuple(micro_batches),
            tokens_per_device=profile.tokens_per_device,
            num_heads=profile.num_heads,
            ulysses_tokens_per_device={
                d: profile.local_token_cap(ULYSSES, d) for d in (2**i for i in range(1, num_devices.bit_length()))
            },
            meta=dict(meta or {}),
            topology=topology,
        )


def shape_string(degrees) -> str:
    """'<32, 16, 8x2>' for degrees [32, 16, 8, 8]: descending, repeats folded."""
    out: list[str] = []
    for d in sorted(set(degrees), reverse=True):
        c = list(degrees).count(d)
        out.append(f"{d}x{c}" if c > 1 else f"{d}")
    return "<" + ", ".join(out) + ">"
