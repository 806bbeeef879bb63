"""Lower bounds that place the slowest sequences of a step exactly, for ``solver.bounds``.

Chains of slow sequences (rounds bound). The tall bound's S >= tau*k counts devices only; the K slowest
sequences (K <= 8) are also few enough to place exactly. In any plan, the micro-batches holding some of them last
at least the optimum of this relaxation: each such micro-batch ("round") splits its slow sequences into groups
("chains") that run one after another, a chain lasting at least the sum of its sequences' w(s), holding at most
d*tokens_per_device tokens (the largest cap of a degree-d group) on the least degree d that holds every one of them,
the chains' degrees adding up to at most N; a round lasts its longest chain. The least sum over rounds, S_K, is
found exactly (the best chains of each subset of the K, then the best partition into rounds, both by dynamic
programming over subsets, 3^K steps) and every threshold tau at or below the K-th slowest w takes S >= max(tau*k,
S_K) in the tall bound above: the rounds are tall micro-batches. It binds where the slow sequences cannot share a
group (their tokens exceed its memory) and more of them need a large group than N allows side by side (five
64-device sequences on 256 devices: two rounds, the first as long as the slowest of the five, where tau*k prices
each round at the threshold tau).

What the rounds leave idle (absorption bound). Take H, the j slowest of those K (at each change of the
least degree that holds them), and the rest "light", A = sum of the light sequences' least device-time a'(s) = min_t
d*t(s, t). A round (a micro-batch holding some of H) of length X whose chains take u devices can run light work
only on its N - u free devices, at most (N - u)*X of device-time and at most the light device-time G((N - u)*cap)
their memory holds (G(x): the most device-time of light sequences within x tokens, densest first, fractional), and
in the chains' groups' idle time, sum_c d_c*(X - chain_c) <= u*X - sum_H n(s) w(s), where a light sequence costs at
least 1/rho of its a'(s) (rho = max over light s of a'(s) / its least device-time on a group of H's least degree or
more). The most a round absorbs is taken over every u from the chains' least up to N, so any grouping is covered.
All the rounds hold at most rounds*N*cap - tokens(H) light tokens, so absorb at most G of that. The light work the
rounds do not absorb runs in other micro-batches, at least (A - absorbed)/N long, hence

    step >= M_min * O + min over partitions of H into rounds of
            max( sum_r X_r + (A - G(rounds*N*cap - tokens(H)))/N,  sum_r (X_r - absorbed_r/N) + A/N ),

found by dynamic programming over subsets with the Pareto front of (sum X, sum of X - absorbed/N) per number of
rounds. It binds where the slowest sequences leave devices idle that memory or slow groups keep the rest from using
(e.g. 64-device groups over slow links beside free devices whose memory holds little of the light work).
"""

from __future__ import annotations

import functools

import numpy as np

__all__ = [
    "ROUNDS_K",
    "absorb_bound_ms",
    "best_round_split",
    "optimal_rounds",
    "best_rounds",
    "round_fronts",
    "rounds_bound_ms",
    "slowest_fronts",
]

ROUNDS_K = 8
"""How many of the slowest sequences the rounds and absorption bounds place exactly (3^K/2 subset pairs)."""


def round_fronts(
    w, lengths, finite, degrees, num_devices: int, tokens_per_device: int, table: np.ndarray | None = None
) -> list:
    """For every subset (bit mask) of the given sequences (at most ``ROUNDS_K``): the Pareto front of (devices,
    longest chain) over its partitions into chains that fit side by side on ``num_devices`` (module docstring, rounds
    bound), ascending in devices; empty when none fits. ``w``: their least times, ``finite[s, t]``: whether type t
    holds sequence s, ``degrees[t]``: type degrees. A chain runs on one group of some degree d whose types hold each
    of its sequences and d*tokens_per_device tokens in all (a subset no degree holds is no chain); it lasts the sum of
    its sequences' least times ``w``, or with ``table`` (their rows of the time table, ms on each type) the sum of
    their least times on a group of degree d: a chain of the tallest sequences on one group of all N devices, or two
    chains of N/2 side by side, each with its real time (module docstring, chain degrees)."""
    k = np.asarray(w).size
    full = 1 << k
    levels, usable, ms_opt = _chain_table(w, lengths, finite, degrees, num_devices, tokens_per_device, table)
    if not usable.any():
        return [[(0.0, 0.0)]] + [[] for _ in range(full - 1)]
    # dense over devices in units of the least degree any chain takes: best[mask, u] = the least longest chain of
    # the subset's partitions into chains on at most u units, one vectorised step per subset size and degree
    unit = int(levels[usable.any(axis=0)].min())
    size = num_devices // unit + 1
    best = np.full((full, size), np.inf)
    best[0] = 0.0
    for masks, rs in _round_pairs(k):  # rs: the chain holding the mask's lowest member
        rest = best[masks ^ rs]
        got = np.full((masks.size, size), np.inf)
        for j, d in enumerate(levels.tolist()):
            du = int(d) // unit
            if du == 0 or du >= size or not usable[rs, j].any():
                continue
            np.minimum(got[:, du:], np.maximum(rest[:, : size - du], ms_opt[rs, j][:, None]), out=got[:, du:])
        starts = np.flatnonzero(np.concatenate([[True], masks[1:] != masks[:-1]]))
        best[masks[starts]] = np.minimum.accumulate(np.minimum.reduceat(got, starts, axis=0), axis=1)
    fronts: list[list[tuple[float, float]]] = [[(0.0, 0.0)]]
    steps = np.concatenate([np.full((full, 1), np.inf), best], axis=1)
    for mask in range(1, full):
        row = best[mask]
        at = np.flatnonzero(row < steps[mask, :-1])  # where the least longest chain drops: the Pareto points
        fronts.append([(float(u * unit), float(row[u])) for u in at.tolist()])
    return fronts


def _chain_table(w, lengths, finite, degrees, num_devices: int, tokens_per_device: int, table) -> tuple:
    """(the degrees, usable[mask, j], ms[mask, j]): whether each subset (bit mask) of the sequences can run as one
    chain on a group of the j-th degree, and how long it then takes (inf where it cannot)."""
    w = np.asarray(w, dtype=np.float64)
    k = w.size
    lengths = np.asarray(lengths, dtype=np.float64)
    degrees = np.asarray(degrees, dtype=np.float64)
    finite = np.asarray(finite, dtype=bool)
    levels = np.unique(degrees)
    if table is None:
        per_level = np.repeat(w[:, None], levels.size, axis=1)
    else:  # least time of each sequence on a group of each degree (either kind)
        tab = np.asarray(table, dtype=np.float64)
        per_level = np.stack([np.where(degrees == d, tab, np.inf).min(axis=1) for d in levels], axis=1)
    full = 1 << k
    masks = np.arange(full, dtype=np.int64)
    chain_ms, tokens = np.zeros((full, levels.size)), np.zeros(full)
    for i in range(k):  # sums over members, one bit at a time
        has = (masks >> i) & 1 == 1
        chain_ms[has] += per_level[i]
        tokens[has] += lengths[i]
    held = np.zeros((full, levels.size), dtype=bool)  # some type of that degree holds every member, and the tokens
    bit = 1 << np.arange(k, dtype=np.int64)
    for t in range(len(degrees)):
        holds = int(bit[finite[:, t]].sum())  # the members type t holds
        j = int(np.searchsorted(levels, degrees[t]))
        held[:, j] |= ((masks & ~holds) == 0) & (degrees[t] * tokens_per_device >= tokens)
    held[0] = False
    usable = held & np.isfinite(chain_ms) & (levels <= num_devices)[None, :]
    ms_opt = np.where(usable, chain_ms, np.inf)  # each subset's time as one chain on each degree (inf: it cannot)
    return levels, usable, ms_opt


@functools.cache
def _round_pairs(k: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per popcount layer p = 1..k: (mask, r) for every mask of p members and every subset r of it holding its
    lowest member (the round that member is in)."""
    layers: list[tuple[list[int], list[int]]] = [([], []) for _ in range(k + 1)]
    for mask in range(1, 1 << k):
        masks, rs = layers[bin(mask).count("1")]
        for r in _with_lowest(mask):
            masks.append(mask)
            rs.append(r)
    return [(np.array(m, dtype=np.int64), np.array(r, dtype=np.int64)) for m, r in layers[1:]]


def best_rounds(round_cost: np.ndarray) -> np.ndarray:
    """For every subset (bit mask): the least sum of ``round_cost`` over its partitions into rounds (3^K/2 pairs,
    one vectorised step per subset size)."""
    k = int(round_cost.size).bit_length() - 1
    best = np.full(round_cost.size, np.inf)
    best[0] = 0.0
    for masks, rs in _round_pairs(k):
        np.minimum.at(best, masks, round_cost[rs] + best[masks ^ rs])
    return best


def rounds_bound_ms(fronts: list, k: int) -> list[float]:
    """S_j for j = 1..k: the least sum over micro-batches of the longest chain, for the j slowest sequences (module
    docstring, rounds bound), from their :func:`round_fronts`."""
    if k == 0:
        return []
    _, best = _rounds_of(fronts)
    return [float(best[(1 << j) - 1]) for j in range(1, k + 1)]


def _rounds_of(fronts: list) -> tuple[np.ndarray, np.ndarray]:
    """(each subset's shortest round: its least longest chain; each subset's least sum of rounds)."""
    round_ms = np.array([f[-1][1] if f else np.inf for f in fronts])
    return round_ms, best_rounds(round_ms)


def best_round_split(few, fronts) -> list[list[tuple[list[int], float, float]]]:
    """For j = 1..len(few): the micro-batches of the rounds bound's optimum for the j slowest (``few``: sequence
    indices, slowest first, and their :func:`round_fronts`), as (members, devices their chains take, longest chain)
    each; an empty list where none exists. The planner starts tiered splits from them
    (``solver.microbatching.tiered_split``'s seeds, for as many of the slowest as are slow enough to be tiered)."""
    if len(few) == 0:
        return []
    round_ms, best = _rounds_of(fronts)
    return optimal_rounds(few, round_ms, best, lambda r: fronts[r][-1], 1e-12)


def optimal_rounds(
    few, cost: np.ndarray, best: np.ndarray, point, rel: float
) -> list[list[tuple[list[int], float, float]]]:
    """For j = 1..len(few): an optimal partition of the j slowest into rounds (``best``: :func:`best_rounds` of
    ``cost``), each round as (members, ``*point(round mask)``); an empty list where none exists. A round is taken
    when its cost plus the rest's best is within ``rel`` (relative) of the subset's best."""
    k = len(few)
    out = []
    for j in range(1, k + 1):
        mask, rounds = (1 << j) - 1, []
        if not np.isfinite(best[mask]):
            out.append([])
            continue
        while mask:  # the round of the lowest member that attains best[mask], then the rest's
            r = next(r for r in _with_lowest(mask) if cost[r] + best[mask ^ r] <= best[mask] + rel * abs(best[mask]))
            used, x = point(r)
            rounds.append(([int(few[i]) for i in range(k) if r >> i & 1], float(used), float(x)))
            mask ^= r
        out.append(rounds)
    return out


def slowest_fronts(
    table: np.ndarray, degrees, lengths, num_devices: int, tokens_per_device: int, per_degree: bool = True
):
    """(indices of the ``ROUNDS_K`` slowest sequences, slowest first; their :func:`round_fronts`, each chain with its
    time on the degree it runs on; ``per_degree=False``: every chain on its least degree with its members' least
    times: the looser fronts, which the planner's relaxed start uses)."""
    finite = np.isfinite(table)
    w = np.where(finite, table, np.inf).min(axis=1)
    few = np.argsort(-w, kind="stable")[: min(ROUNDS_K, int(np.isfinite(w).sum()))]
    lengths = np.asarray(lengths, dtype=np.float64)
    degrees = np.asarray(degrees, dtype=np.float64)
    rows = table[few] if per_degree else None
    return few, round_fronts(w[few], lengths[few], finite[few], degrees, num_devices, tokens_per_device, rows)


def absorb_bound_ms(
    table: np.ndarray, degrees, lengths, num_devices: int, tokens_per_device: int, slowest=None
) -> float:
    """The rounds bound with the rest of the work (module docstring, absorption bound), without M_min * O."""
    lengths = np.asarray(lengths, dtype=np.float64)
    degrees = np.asarray(degrees, dtype=np.float64)
    n, cap = num_devices, tokens_per_device
    finite = np.isfinite(table)
    w = np.where(finite, table, np.inf).min(axis=1)
    need = degrees[np.argmax(finite, axis=1)]
    dev_time = np.where(finite, table * degrees[None, :], np.inf)  # d * t(s, t)
    pure = dev_time.min(axis=1)  # a'(s): least device-time, no share of fixed costs
    few, fronts = slowest if slowest is not None else slowest_fronts(table, degrees, lengths, n, cap)
    if few.size == 0:
        return 0.0
    nw = np.maximum(need[few] * w[few], pure[few])  # device-time of its chain's group: >= n(s) w(s) and >= a'(s)
    full = 1 << few.size
    nw_sum = np.zeros(full)
    for m in range(1, full):
        low = m & -m
        nw_sum[m] = nw_sum[m ^ low] + nw[low.bit_length() - 1]
    levels = np.unique(degrees)  # least device-time of each sequence on a group of degree >= D, per degree D
    at_least = np.stack([np.where(degrees[None, :] >= d, dev_time, np.inf).min(axis=1) for d in levels])
    dense = np.argsort(-pure / np.maximum(lengths, 1.0), kind="stable")  # most device-time per token first
    spare = np.arange(n + 1, dtype=np.float64)  # devices outside the chains' groups
    best = 0.0
    # H = the j slowest, at each change of tier (the least degree that holds them) and all K
    cuts = [j for j in range(1, few.size) if need[few[j]] != need[few[j - 1]]] + [few.size]
    for j in cuts:
        light = np.ones(lengths.size, dtype=bool)
        light[few[:j]] = False
        area = float(pure[light].sum())
        d_h = float(need[few[:j]].min())  # every chain of H has at least this degree
        rho = float((pure[light] / at_least[np.searchsorted(levels, d_h), light]).max()) if light.any() else 0.0
        order = dense[light[dense]]  # G(x): the most light device-time within x tokens (fractional knapsack)
        cum_toks = np.concatenate([[0.0], np.cumsum(lengths[order])])
        cum_area = np.concatenate([[0.0], np.cumsum(pure[order])])
        g_free = np.interp(spare * cap, cum_toks, cum_area)  # G of the tokens the free devices hold

        cost = functools.partial(_round_cost, n=n, rho=rho, g_free=g_free, nw_sum=nw_sum)
        rounds = _pareto_rounds(fronts, cost, j)
        h_tokens = float(lengths[few[:j]].sum())
        got = np.inf
        for count, front in rounds.items():
            room = count * n * cap - h_tokens  # light tokens the rounds hold at most
            most = float(np.interp(room, cum_toks, cum_area))  # the most light device-time they absorb
            for x, c in front:  # T >= sum X + (A - min(absorbed by time, by memory)) / N
                got = min(got, max(c + area / n, x + (area - most) / n))
        best = max(best, got)
    return best


def _round_cost(mask: int, used: float, x: float, *, n: int, rho: float, g_free: np.ndarray, nw_sum) -> float:
    """A round's C = X - (the most it absorbs)/N: free devices at full rate within their memory (``g_free[f]``: the
    most light device-time f devices' memory holds), the chains' groups' idle time at rate ``rho``; the most over
    every number of devices the chains may take, from ``used`` (their least) up to N."""
    u = np.arange(int(used), n + 1, dtype=np.float64)
    free = np.minimum((n - u) * x, g_free[n - int(used) :: -1][: u.size])
    return x - float((free + rho * (u * x - nw_sum[mask])).max()) / n


def _pareto_rounds(fronts: list, cost, j: int) -> dict[int, list]:
    """For the subset of the first ``j`` sequences, per number of rounds: the Pareto front of (sum of round lengths
    X, sum of round costs C) over its partitions into rounds, ``cost(mask, devices, X)`` a round's C."""
    limit = 1 << j
    options = [
        _coarsen(_prune(sorted((x, cost(m, used, x)) for used, x in _coarsen(fronts[m])))) if m else []
        for m in range(limit)
    ]
    out: list[dict[int, list]] = [{0: [(0.0, 0.0)]}] + [{} for _ in range(limit - 1)]
    for mask in range(1, limit):
        cands: dict[int, list] = {}
        for r in _with_lowest(mask):
            if options[r]:
                for count, front in out[mask ^ r].items():
                    got = cands.setdefault(count + 1, [])
                    for x, c in options[r]:
                        got.extend((x + x2, c + c2) for x2, c2 in front)
        out[mask] = {count: _coarsen(_prune(sorted(pts))) for count, pts in cands.items()}
    return out[limit - 1]


COARSE_POINTS = 2
"""The absorption bound's Pareto fronts keep at most this many points each (``_coarsen``)."""


def _coarsen(points: list[tuple[float, float]], most: int = COARSE_POINTS) -> list[tuple[float, float]]:
    """At most ``most`` points, each the coordinate-wise least of a run of consecutive ``points`` (a Pareto front,
    ascending in the first coordinate): every point is at least one kept point in both coordinates, so a bound
    minimised over the kept points is at most the bound over all of them (still a lower bound, a little looser)."""
    if len(points) <= most:
        return points
    cuts = np.linspace(0, len(points), most + 1).round().astype(int).tolist()
    return [(points[a][0], points[b - 1][1]) for a, b in zip(cuts[:-1], cuts[1:], strict=True)]


def _with_lowest(mask: int):
    """Every subset of ``mask`` that holds its lowest member (the part that member is in), largest first."""
    low = mask & -mask
    rest = sub = mask ^ low
    while True:
        yield low | sub
        if sub == 0:
            return
        sub = (sub - 1) & rest


def _prune(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The points no other is at most in both coordinates (input sorted ascending)."""
    kept: list[tuple[float, float]] = []
    for x, c in points:
        if not kept or c < kept[-1][1]:
            kept.append((x, c))
    return kept
