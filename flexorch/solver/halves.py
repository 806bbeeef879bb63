"""The tallest sequences laid out as they will run, so that the search is never behind FlexSP's solver.

FlexSP's solver (arXiv 2412.01523, §4.1.1) chooses every group's degree per micro-batch, so it may run the tallest
micro-batch's sequences on two groups of N/2 devices side by side rather than one after another on one group of all
N devices. Two splits decide the tallest micro-batch's layout before any packer sees it, both from memory alone:

* the rounds-seeded splits (``solver.round_bounds.best_round_split``) place the slowest sequences into micro-batches
  as chains on the least degree that holds them, timed as if on their fastest group;
* the tiered splits (``solver.microbatching.tiered_split``) put slow sequences side by side by that least degree,
  and top the micro-batch up with other sequences on the devices it seems to leave free.

A sequence that runs fastest on all N devices then shares its micro-batch with work that either waits (it is put
on the same group) or slows it down (it is moved to the least degree). Here each chain of the slowest sequences
takes a degree that holds it, with the time it takes there (the per-degree fronts of
``solver.round_bounds.round_fronts``): one group of N running all of them one after another, two of N/2 each running
a share, or any other mix; each round (micro-batch of slow sequences) takes the point of its front that costs the
step least, its length less the work of the other sequences that the devices it leaves free can take in its time and
in their memory (:func:`effective_ms`), and a tier gives each of the slowest the devices of its best point alone
(:func:`tier_devices`). These splits are offered beside the others (the screening and the solves choose), as are
splits whose tiered micro-batch takes the shortest sequences onto its group where the rest would need one micro-batch
more (``solver.microbatching.tiered_split``'s ``squeeze``). After the packers, the local search may split a packed
micro-batch's slowest group in two half-size groups where that is faster (:func:`split_halves`): a memory-tight
micro-batch of long sequences may run faster on two groups of N/2 side by side than on one of N, whose all-to-all is
slower per device (docs/benchmarks.md has the figures).
"""

from __future__ import annotations

import time

import numpy as np

from flexorch.solver.packing import Draft
from flexorch.solver.round_bounds import best_rounds, optimal_rounds

__all__ = ["effective_ms", "light_fill", "plan_rounds", "tier_devices", "split_halves"]


def light_fill(table: np.ndarray, degrees, lengths, few, num_devices: int, tokens_per_device: int) -> np.ndarray:
    """``g[f]`` for f = 0..N: the most device-time of the sequences outside ``few`` that f devices' memory holds
    (f * tokens_per_device tokens, the most device-time per token first, the last one in part), each at its least
    device-time."""
    degrees = np.asarray(degrees, dtype=np.float64)
    lengths = np.asarray(lengths, dtype=np.float64)
    pure = np.where(np.isfinite(table), table * degrees[None, :], np.inf).min(axis=1)
    light = np.ones(lengths.size, dtype=bool)
    light[np.asarray(few, dtype=np.int64)] = False
    order = np.flatnonzero(light)
    order = order[np.argsort(-pure[order] / np.maximum(lengths[order], 1.0), kind="stable")]
    cum_toks = np.concatenate([[0.0], np.cumsum(lengths[order])])
    cum_area = np.concatenate([[0.0], np.cumsum(pure[order])])
    return np.interp(np.arange(num_devices + 1, dtype=np.float64) * tokens_per_device, cum_toks, cum_area)


def effective_ms(used: float, x: float, g: np.ndarray, num_devices: int) -> float:
    """What a round of length ``x`` whose chains take ``used`` devices costs the step: its length, less the other
    sequences' work its free devices can take in that time and in their memory (``g``: :func:`light_fill`), which
    the other micro-batches then need not run, spread over all N devices."""
    free = num_devices - int(used)
    return float(x) - min(free * float(x), float(g[free])) / num_devices


def plan_rounds(few, fronts, g: np.ndarray, num_devices: int) -> list[list[tuple[list[int], float, float]]]:
    """For j = 1..len(few): the j slowest sequences' micro-batches (rounds) as the planner seeds its splits with
    them (``solver.microbatching.tiered_split``'s ``seeds``), each (members, devices their chains take, longest
    chain), an empty list where none exists. Each round takes the point of its per-degree front (``fronts``,
    ``solver.round_bounds.round_fronts`` with the time table) of least :func:`effective_ms`, and the partition into
    rounds is the one of least summed effective length (``solver.round_bounds.best_rounds``)."""
    k = len(few)
    if k == 0:
        return []
    cost = np.full(len(fronts), np.inf)
    pick: list[tuple[float, float] | None] = [None] * len(fronts)
    for mask in range(1, len(fronts)):
        for used, x in fronts[mask]:
            c = effective_ms(used, x, g, num_devices)
            if c < cost[mask]:
                cost[mask], pick[mask] = c, (used, x)
    return optimal_rounds(few, cost, best_rounds(cost), pick.__getitem__, 1e-9)


def tier_devices(need: np.ndarray, few, fronts, g: np.ndarray, num_devices: int) -> np.ndarray:
    """``need`` (each sequence's least degree that holds it: the devices a tier gives it) with each of the slowest
    ``few`` given the degree its front's point of least :func:`effective_ms` takes alone (its fastest group where
    that pays: a sequence one group of all N devices runs fastest takes them all)."""
    out = np.asarray(need, dtype=np.int64).copy()
    for i, s in enumerate(np.asarray(few, dtype=np.int64).tolist()):
        points = fronts[1 << i]
        if points:
            used, _ = min(points, key=lambda p: effective_ms(p[0], p[1], g, num_devices))
            out[s] = max(int(out[s]), int(used))
    return out


def split_halves(
    drafts: list[Draft],
    types,
    table: np.ndarray,
    lengths: np.ndarray,
    caps_by_type,
    overheads,
    most: int = 8,
    deadline: float | None = None,
) -> int:
    """Split slow groups of packed micro-batches in two half-size groups where that is faster (changed in place):
    while a micro-batch's slowest group (degree d >= 2, two sequences or more) can be replaced by two groups of
    degree d/2, either kind, its sequences shared between them (longest first into the one that finishes first,
    within memory, then single moves and swaps while the later one finishes sooner) so that both finish before it
    did, it is; at most ``most`` splits per micro-batch, none begun past ``deadline`` (``time.monotonic()``). Returns
    how many groups were split. FlexSP's solver
    (arXiv 2412.01523) chooses such layouts; a search without this keeps one group of N where two of N/2 are faster."""
    deg = np.array([t.degree for t in types], dtype=np.int64)
    fixed = np.asarray(overheads, dtype=np.float64)
    caps = np.asarray(caps_by_type, dtype=np.int64)
    halves_of = {int(d): np.flatnonzero(deg == d // 2) for d in np.unique(deg) if d >= 2}
    done = 0
    for draft in drafts:
        for _ in range(most):
            if deadline is not None and time.monotonic() >= deadline:
                return done
            live = [g for g, m in enumerate(draft.members) if m]
            if not live:
                break
            g = max(live, key=lambda h: draft.loads[h])
            members = draft.members[g]
            halves = halves_of.get(int(deg[draft.group_type[g]]), np.array([], dtype=np.int64))
            if len(members) < 2 or halves.size == 0:
                break
            got = _best_halves(members, halves, table, lengths, caps, fixed)
            if got is None or got[0] >= draft.loads[g] * (1 - 1e-9):
                break
            _, (ta, a, la), (tb, b, lb) = got
            draft.group_type[g], draft.members[g] = int(ta), a
            draft.group_type.append(int(tb))
            draft.members.append(b)
            draft.loads = np.append(draft.loads, lb)
            draft.loads[g] = la
            draft.tokens = np.append(draft.tokens, int(lengths[b].sum()))
            draft.tokens[g] = int(lengths[a].sum())
            done += 1
    return done


def _best_halves(members, halves, table, lengths, caps, fixed):
    """(the later finish, (type, members, load) of each half) of the best split of ``members`` into two groups of
    the half types ``halves`` found (:func:`split_halves`), or None when none holds them."""
    best = None
    for u in halves.tolist():
        t = table[members, u]
        if not np.isfinite(t).all():
            continue
        part = _two_bins(members, t, lengths, int(caps[u]), by_time=True)
        if part is None:  # memory first: the most tokens first into the fuller half that has room
            part = _two_bins(members, t, lengths, int(caps[u]), by_time=False)
        if part is None or not part[0] or not part[1]:
            continue
        got = _balance(part, table, lengths, caps, fixed, halves)
        if got is not None and (best is None or got[0] < best[0]):
            best = got
    return best


def _two_bins(members, t, lengths, cap: int, by_time: bool):
    """``members`` in two halves of ``cap`` tokens each: the longest first into the half that finishes first
    (``by_time``), or the most tokens first into the fullest half with room (best fit); None when one does not fit."""
    toks_of = lengths[members]
    order = np.argsort(-(t if by_time else toks_of), kind="stable").tolist()
    load, toks, part = [0.0, 0.0], [0, 0], [[], []]
    for j in order:
        fits = [h for h in (0, 1) if toks[h] + int(toks_of[j]) <= cap]
        if not fits:
            return None
        h = min(fits, key=lambda h: load[h]) if by_time else max(fits, key=lambda h: toks[h])
        load[h] += float(t[j])
        toks[h] += int(toks_of[j])
        part[h].append(members[j])
    return part


def _balance(part, table, lengths, caps, fixed, halves, rounds: int = 64, swaps: int = 4096):
    """Single moves and swaps between the two halves while the later one finishes sooner (swaps only while the
    halves have at most ``swaps`` pairs); each half then on its fastest half type that holds it. (later finish,
    (type, members, load), (type, members, load)) or None."""
    cap, base = caps[halves].astype(np.float64), fixed[halves]

    def finish(load, toks):  # the fastest half type that holds the tokens: (finish, type index), vectorised
        # nan: inf - inf, a member some type cannot run left a half of that type (taken as still unable: no move)
        loads = np.where((toks[..., None] <= cap) & ~np.isnan(load), load, np.inf)
        return loads.min(axis=-1), loads.argmin(axis=-1)

    a, b = list(part[0]), list(part[1])
    with np.errstate(invalid="ignore"):
        a, b = _moves(a, b, table, lengths, halves, base, finish, rounds, swaps)
    out = []
    for m in (a, b):
        f, u = finish(fixed[halves] + table[m][:, halves].sum(axis=0), np.array(float(lengths[m].sum())))
        out.append((float(f), int(halves[int(u)]), m))
    if not np.isfinite(max(out[0][0], out[1][0])):
        return None
    (la, ua, a), (lb, ub, b) = out
    return max(la, lb), (ua, a, la), (ub, b, lb)


def _moves(a, b, table, lengths, halves, base, finish, rounds: int, swaps: int):
    """:func:`_balance`'s moves and swaps: the two halves' members after them."""
    for _ in range(rounds):
        ta, tb = table[a][:, halves], table[b][:, halves]
        la, lb = base + ta.sum(axis=0), base + tb.sum(axis=0)
        ka, kb = float(lengths[a].sum()), float(lengths[b].sum())
        fa, fb = finish(la, np.array(ka))[0], finish(lb, np.array(kb))[0]
        if fa < fb:
            a, b = b, a
            continue
        sa, sb = lengths[a].astype(np.float64), lengths[b].astype(np.float64)
        # moves: a[i] to b
        ma = finish(la[None, :] - ta, ka - sa)[0]
        mb = finish(lb[None, :] + ta, kb + sa)[0]
        later = np.maximum(ma, mb)
        if len(a) < 2:
            later[:] = np.inf
        i = int(np.argmin(later))
        best = (float(later[i]), i, None)
        if len(a) * len(b) <= swaps:  # swaps: a[i] for b[j]
            d = tb[None, :, :] - ta[:, None, :]  # (i, j, type): a's change
            ds = sb[None, :] - sa[:, None]
            sw = np.maximum(finish(la + d, ka + ds)[0], finish(lb - d, kb - ds)[0])
            i2, j2 = np.unravel_index(int(np.argmin(sw)), sw.shape)
            if sw[i2, j2] < best[0]:
                best = (float(sw[i2, j2]), int(i2), int(j2))
        if not best[0] < fa - 1e-9:
            break
        _, i, j = best
        if j is None:
            b.append(a.pop(i))
        else:
            a[i], b[j] = b[j], a[i]
    return a, b
