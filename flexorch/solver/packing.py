"""Packing sequences into a fixed set of SP groups, improving it by local moves, and laying groups out on ranks.

These are the heuristics every planner shares: the static baselines (one degree for all groups) and the MILP
planner (a mix of degrees chosen by the MILP) both call `lpt_pack` and `improve`, so their comparison measures the
choice of groups, not different packers.
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass

import numpy as np

from flexorch.solver.cost_model import HYBRID, KINDS, RING, ULYSSES, group_overhead_ms, kind_allowed, seq_times_ms
from flexorch.solver.plan import Group
from flexorch.solver.profiles import Profile
from flexorch.solver.topology import Topology

__all__ = [
    "GroupType",
    "group_types",
    "time_table",
    "type_caps",
    "type_overheads",
    "Draft",
    "lpt_pack",
    "pack",
    "improve",
    "improve_step",
    "drop_empty",
    "best_homogeneous_draft",
    "layout_groups",
    "hybrid_share",
]


@dataclass(frozen=True)
class GroupType:
    degree: int
    kind: str
    spans: bool = False
    """Priced as spanning nodes (the profile's inter-node tables): a type of degree > the largest node."""
    ulysses_degree: int | None = None
    """A hybrid type's Ulysses degree u (ring over degree / u positions)."""
    speed: float | None = None
    """The pace a group of this type is priced at on ranks of different speeds (``solver.speed_levels``): it lies on
    ranks at least this fast. None: priced at 1.0, on any ranks (the planner's types before speeds)."""

    @property
    def placement(self) -> dict:
        """The cost model's placement keywords for this type ({} for a type priced inside a node)."""
        out: dict = {"spans": True} if self.spans else {}
        if self.kind == HYBRID:
            out["ulysses_degree"] = self.ulysses_degree
        return out


def hybrid_share(topology: Topology) -> int:
    """u of the planner's hybrid groups: the largest power of two <= the nominal node size (a ring position per
    node of 8; 4 on nodes of 6)."""
    return 1 << (topology.nominal_node_size.bit_length() - 1)


def group_types(
    num_devices: int, profile: Profile, kinds=KINDS, topology: Topology | None = None, hybrid: bool = True
) -> list[GroupType]:
    """Every (degree, kind) a group can have on N devices: powers of two <= N; degree 1 needs no comm (ulysses).

    With a ``topology`` of several nodes, a type of degree above the largest node spans nodes (``spans``: priced
    with the inter-node tables) and, with ``hybrid``, gains a hybrid type of Ulysses degree u = ``hybrid_share``
    where u divides the heads (Ulysses inside each node, ring across them). Without one: every type inside one node."""
    out = []
    biggest = topology.max_node_size if topology is not None and topology.num_nodes > 1 else num_devices
    d = 1
    while d <= num_devices:
        spans = d > biggest
        for kind in kinds:
            if d == 1 and kind == RING:
                continue
            if d == 1 and ULYSSES not in kinds:
                out.append(GroupType(1, ULYSSES))
                continue
            if kind_allowed(kind, d, profile):
                out.append(GroupType(d, kind, spans))
        if spans and hybrid:
            u = hybrid_share(topology)
            if kind_allowed(HYBRID, d, profile, u):
                out.append(GroupType(d, HYBRID, True, u))
        d *= 2
    return out


def type_caps(types: list[GroupType], profile: Profile) -> np.ndarray:
    """C[t]: tokens a group of type t holds in one micro-batch (``Profile.group_token_cap``: a Ulysses group holds
    a little less per device than a ring group of the same degree)."""
    return np.array([_group_cap(t, profile) for t in types], dtype=np.int64)


def _group_cap(t: GroupType, profile: Profile) -> int:
    if t.kind == HYBRID:  # its Ulysses all-to-alls at degree u copy what a Ulysses group of u copies
        return t.degree * profile.local_token_cap(ULYSSES, t.ulysses_degree)
    return profile.group_token_cap(t.kind, t.degree)


def time_table(lengths: np.ndarray, types: list[GroupType], profile: Profile) -> np.ndarray:
    """T[i, t]: ms of sequence i alone on a group of type t; inf where the group cannot hold it."""
    lengths = np.asarray(lengths, dtype=np.int64)
    table = np.empty((lengths.size, len(types)))
    caps = type_caps(types, profile)
    for j, t in enumerate(types):
        col = seq_times_ms(lengths, t.degree, t.kind, profile, **t.placement)
        table[:, j] = np.where(lengths <= caps[j], col, np.inf)
    return table


def type_overheads(types: list[GroupType], profile: Profile) -> np.ndarray:
    """O[t]: fixed ms a group of type t pays once per micro-batch (b1 + its collective latency), like `table[:, t]`."""
    return np.array([group_overhead_ms(t.degree, t.kind, profile, **t.placement) for t in types], dtype=np.float64)


@dataclass
class Draft:
    """A mutable assignment of one micro-batch's sequences (local indices) to groups of given types."""

    group_type: list[int]
    members: list[list[int]]
    loads: np.ndarray
    tokens: np.ndarray

    def makespan(self) -> float:
        return float(self.loads.max()) if self.loads.size else 0.0


def lpt_pack(
    items,
    group_type: list[int],
    table: np.ndarray,
    lengths: np.ndarray,
    caps: np.ndarray,
    overheads: np.ndarray,
    best_fit: bool = False,
) -> Draft | None:
    """Longest-processing-time first: each item to the group where it would finish earliest, memory permitting.

    `caps[g]` is group g's token capacity; `overheads[t]` the fixed cost of a group of type t (`type_overheads`),
    paid by a group once it holds a sequence. With `best_fit`, memory comes first (best-fit decreasing by tokens,
    for batches that nearly fill the devices; `improve` then balances time). Returns None when an item fits no
    group.
    """
    ng = len(group_type)
    gt = np.asarray(group_type, dtype=np.int64)
    members: list[list[int]] = [[] for _ in range(ng)]
    items = list(items)
    if not items:
        return Draft(list(group_type), members, np.zeros(ng), np.zeros(ng, dtype=np.int64))
    if best_fit:  # memory first: longest first into the fullest group that still has room
        key = lengths[items].astype(np.float64)
    else:
        key = np.min(table[items][:, np.unique(gt)], axis=1)
    order = [items[j] for j in np.argsort(-key, kind="stable")]
    if best_fit:
        return _best_fit_pack(order, gt, table, lengths, caps, overheads, members)
    return _lpt_heaps(order, gt, table, lengths, caps, overheads, members)


def _lpt_heaps(order, gt, table, lengths, caps, overheads, members) -> Draft | None:
    """LPT with one heap per group type, keyed (finish time before the item, group index).

    Within a type every group adds the same time for an item, so the earliest-finishing group of that type that has
    memory room is the first heap entry with room; across types the least (finish, index) wins: the choice (ties to
    the lowest group index) of the plain scan `argmin(loads + time + fixed-if-empty)` over all groups, in
    O(types * log groups) per item instead of O(groups) - what keeps 4,096-group layouts fast.
    """
    ng = gt.size
    loads = [0.0] * ng
    tokens = [0] * ng
    caps_l = [int(c) for c in np.asarray(caps).tolist()]
    fixed = np.asarray(overheads, dtype=np.float64)
    kinds = sorted(set(gt.tolist()))
    heaps = {t: [] for t in kinds}
    for g, t in enumerate(gt.tolist()):
        heaps[t].append((float(fixed[t]), g))  # an empty group finishes at its fixed cost plus the item's time
    for t in kinds:
        heapq.heapify(heaps[t])
    rows = table[order][:, kinds].tolist()
    lens = lengths[order].tolist()
    for i, row, s in zip(order, rows, lens, strict=True):
        best = None  # (finish, group, type)
        stashed = []  # (type, heap entries without memory room for this item), put back after the choice
        for t, ti in zip(kinds, row, strict=True):
            if not ti < math.inf:
                continue
            h = heaps[t]
            while h and tokens[h[0][1]] + s > caps_l[h[0][1]]:
                stashed.append((t, heapq.heappop(h)))
            if h and (best is None or (h[0][0] + ti, h[0][1]) < best[:2]):
                best = (h[0][0] + ti, h[0][1], t)
        if best is None:
            return None
        finish, g, t = best
        heapq.heapreplace(heaps[t], (finish, g))  # g is its type's top entry: the no-room ones are still out
        for u, e in stashed:
            heapq.heappush(heaps[u], e)
        loads[g] = finish
        tokens[g] += s
        members[g].append(i)
    return Draft(gt.tolist(), members, np.array(loads, dtype=np.float64), np.array(tokens, dtype=np.int64))


def _best_fit_pack(order, gt, table, lengths, caps, overheads, members) -> Draft | None:
    ng = gt.size
    loads = np.zeros(ng)
    tokens = np.zeros(ng, dtype=np.int64)
    fixed = np.asarray(overheads, dtype=np.float64)[gt]
    for i in order:
        t = table[i, gt]
        finish = loads + t + np.where(tokens == 0, fixed, 0.0)
        fits = (tokens + lengths[i] <= caps) & np.isfinite(t)
        if not fits.any():
            return None
        room = (caps - tokens - lengths[i]).astype(np.float64)
        tie = np.where(fits, finish, 0.0) / (1.0 + finish[fits].max())  # in [0, 1): least load breaks ties
        score = np.where(fits, room + tie, np.inf)
        g = int(np.argmin(score))
        loads[g] = finish[g]
        tokens[g] += lengths[i]
        members[g].append(i)
    return Draft(gt.tolist(), members, loads, tokens)


def pack(items, group_type, table, lengths, caps, overheads) -> Draft | None:
    """LPT, or best-fit decreasing when LPT leaves some sequence without memory room."""
    draft = lpt_pack(items, group_type, table, lengths, caps, overheads)
    if draft is None:
        draft = lpt_pack(items, group_type, table, lengths, caps, overheads, best_fit=True)
    return draft


def improve(
    draft: Draft,
    table: np.ndarray,
    lengths: np.ndarray,
    caps: np.ndarray,
    overheads: np.ndarray,
    max_moves: int = 200,
) -> Draft:
    """Move sequences off the slowest group while that lowers the pair's maximum (a 1-move local search)."""
    improve_step([draft], [caps], table, lengths, overheads, max_moves)
    return draft


def improve_step(
    drafts: list[Draft],
    caps: list[np.ndarray],
    table: np.ndarray,
    lengths: np.ndarray,
    overheads: np.ndarray,
    max_moves: int = 400,
    deadline: float | None = None,
) -> list[Draft]:
    """Local search over a whole step: the objective is the sum of the micro-batches' makespans.

    A move takes one sequence off the slowest group of some micro-batch X and puts it in a group h (of X or of
    another micro-batch Y) with memory room, when that strictly lowers the critical group's time and does not
    raise any micro-batch's makespan (in X: h ends below X's old makespan; in Y: h ends within Y's makespan).
    Each move lowers the sum or the critical load, so the search ends; drafts are changed in place. A group's
    load includes its type's fixed cost `overheads[t]` while it holds a sequence. With `deadline` (a
    ``time.monotonic()`` value) the search stops there: every move keeps the drafts valid, so stopping is safe.
    A micro-batch the moves empty stays in the list with no members: drop it (:func:`drop_empty`).
    """
    mb_of = np.concatenate([np.full(len(d.group_type), m) for m, d in enumerate(drafts)])
    gtype = np.concatenate([np.asarray(d.group_type, dtype=np.int64) for d in drafts])
    loads = np.concatenate([d.loads for d in drafts])
    tokens = np.concatenate([d.tokens for d in drafts])
    cap = np.concatenate(caps)
    fixed = np.asarray(overheads, dtype=np.float64)[gtype]
    members = [m for d in drafts for m in d.members]
    nmb = len(drafts)
    stuck = np.zeros(nmb, dtype=bool)
    for _ in range(max_moves):
        if deadline is not None and time.monotonic() >= deadline:
            break
        span = np.array([loads[mb_of == m].max() for m in range(nmb)])
        cands = np.flatnonzero(~stuck)
        if cands.size == 0:
            break
        x = int(cands[np.argmax(span[cands])])
        in_x = np.flatnonzero(mb_of == x)
        g = int(in_x[np.argmax(loads[in_x])])
        best = _best_move(g, x, span, mb_of, gtype, loads, tokens, cap, fixed, members, table, lengths)
        if best is None:
            stuck[x] = True
            continue
        stuck[:] = False
        _, i, h, left, newh = best
        members[g].remove(i)
        members[h].append(i)
        loads[g] = left if members[g] else 0.0
        tokens[g] -= lengths[i]
        loads[h] = newh
        tokens[h] += lengths[i]
    start = 0
    for d in drafts:
        k = len(d.group_type)
        d.loads, d.tokens = loads[start : start + k].copy(), tokens[start : start + k].copy()
        d.members = members[start : start + k]
        start += k
    return drafts


def _best_move(g, x, span, mb_of, gtype, loads, tokens, cap, fixed, members, table, lengths):
    """(score, sequence, target group, g's load after, target's load after) of the best move off group `g` of
    micro-batch `x` (:func:`improve_step`'s rule), None when no move helps."""
    limit = span[mb_of]  # a target group may end at most at its micro-batch's makespan ...
    limit = np.where(mb_of == x, span[x] - 1e-9, limit + 1e-9)  # ... strictly below it in X
    best = None
    for i in members[g]:
        left = loads[g] - table[i, gtype[g]] - (fixed[g] if len(members[g]) == 1 else 0.0)
        new = loads + table[i, gtype] + np.where(tokens == 0, fixed, 0.0)
        ok = (tokens + lengths[i] <= cap) & (new <= limit)
        ok[g] = False
        # same micro-batch: the pair's max must drop below the old makespan
        score = np.where(mb_of == x, np.maximum(new, left), new - span[mb_of] + left)
        score = np.where(ok, score, np.inf)
        h = int(np.argmin(score))
        if np.isfinite(score[h]) and left < loads[g] - 1e-9 and (best is None or score[h] < best[0]):
            best = (score[h], i, h, left, new[h])
    return best


def drop_empty(drafts: list[Draft]) -> list[Draft]:
    """The drafts that still hold a sequence: `improve_step` can move every sequence out of a micro-batch (that
    saves the micro-batch), and an empty micro-batch is no micro-batch (``Plan`` refuses one without groups)."""
    return [d for d in drafts if any(d.members)]


def best_homogeneous_draft(
    items, types, table, lengths, num_devices: int, caps_by_type, overheads, deadline: float | None = None
) -> Draft | None:
    """Best homogeneous layout of one micro-batch: floor(N/d) groups of one type, LPT-packed, unpolished (the
    per-micro-batch 'BatchAda' choice, ``solver.milp.best_static_draft`` without its polish).

    Types are tried in the order of a lower bound on their makespan, O_t + max(longest sequence time, total time /
    groups), and a type whose bound cannot beat the best draft so far is not packed: the answer is that of trying
    them all (ties to the first type), at a fraction of the packs. Past `deadline` (``time.monotonic()``) no new
    type is tried once one draft is in hand. None when no type packs the micro-batch.
    """
    items = list(items)
    sub = table[items]
    ok = np.isfinite(sub).all(axis=0)
    deg = np.array([t.degree for t in types], dtype=np.int64)
    ng = num_devices // deg
    with np.errstate(invalid="ignore"):
        total = np.where(ok, sub, 0.0).sum(axis=0)
        longest = np.where(ok, sub, 0.0).max(axis=0) if items else np.zeros(len(types))
    lb = np.where(
        ok & (ng > 0), np.asarray(overheads, dtype=np.float64) + np.maximum(longest, total / np.maximum(ng, 1)), np.inf
    )
    best, best_t = None, -1
    for ti in np.argsort(lb, kind="stable").tolist():
        if not np.isfinite(lb[ti]):
            break
        if best is not None:
            if lb[ti] > best.makespan() or (lb[ti] == best.makespan() and ti > best_t):
                continue
            if deadline is not None and time.monotonic() >= deadline:
                break
        gtype = [ti] * int(ng[ti])
        caps = np.full(int(ng[ti]), caps_by_type[ti], dtype=np.int64)
        draft = pack(items, gtype, table, lengths, caps, overheads)
        if draft is None:
            continue
        ms = draft.makespan()
        if best is None or ms < best.makespan() or (ms == best.makespan() and ti < best_t):
            best, best_t = draft, ti
    return best


def layout_groups(draft: Draft, types: list[GroupType], seq_ids) -> list[Group]:
    """Aligned rank blocks: groups sorted by degree (largest first) take consecutive ranks from 0.

    With power-of-two sizes in descending order every block starts at a multiple of its own size.
    Empty groups are dropped (their devices idle this micro-batch).
    """
    seq_ids = list(seq_ids)
    live = [(types[t], m) for t, m in zip(draft.group_type, draft.members, strict=True) if m]
    live.sort(key=lambda x: -x[0].degree)
    out, rank = [], 0
    for t, m in live:
        ranks = tuple(range(rank, rank + t.degree))
        out.append(Group(t.degree, t.kind, ranks, tuple(seq_ids[i] for i in m), t.ulysses_degree))
        rank += t.degree
    return out
