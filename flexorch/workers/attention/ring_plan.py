"""Which local queries meet which rows of the travelling K/V block at each step of zigzag ring attention, and with
what mask: the kernel calls of one rank, as plain data (no process group; loop over the ranks to check a ring).

Zigzag layout (zhuzilin/ring-flash-attention, ``zigzag_ring_flash_attn_varlen.py``; ``sharding.zigzag_layout``): a
document of ``L = 2d * c`` tokens (padded) is cut into ``2d`` chunks of ``c``; rank ``r`` holds chunks ``r`` (front)
and ``2d-1-r`` (back), and at ring step ``i`` it holds the K/V of rank ``src = r - i (mod d)``: chunks ``src`` and
``2d-1-src``. A (query chunk ``x``, key chunk ``y``) pair of one document is a *block*; its keys lie ``D = x - y``
chunks behind its queries. Without a window (:func:`causal_plan`, one call per step, as in ring-flash-attention):

* step 0: local queries vs local keys, causal (``D = 0`` twice, ``D = 2d-1-2r`` once: the chunks are in order);
* ``src < r``: all local queries vs the front chunk of src's keys (its back chunk lies in our future, ``D < 0``);
* ``src > r``: our back chunk's queries vs all of src's keys.

With a sliding window of ``w`` keys (a query at position ``i`` sees ``i - w < j <= i``, :func:`window_plan`), a block
at distance ``D >= 1`` spans query-key distances ``(D-1)c + 1 .. (D+1)c - 1``, so per document it is

* *skipped* when ``(D-1)c + 1 >= w``: no key of it is in any of its queries' windows (no kernel call, no merge;
  the row's log-sum-exp from the other blocks is already the whole one, and the backward adds nothing);
* *full* when ``(D+1)c <= w``: every key in every window, one unmasked call for all such documents;
* on the window's *edge* otherwise: a causal call with the window and the block's offset (``shift``, the kernels'
  per-document "queries start this many positions after the keys", ``kernels`` module doc), cut to the rows and
  keys that meet (``m = Dc - w + 1 > 0``: query rows ``[0, c - m)``, keys ``[m, c)``), so no row is empty.

The diagonal blocks (``D = 0``, step 0) are one causal call with the window over the local chunks. Documents differ
in ``c``, so each call holds the documents of its kind; a block pair with none makes no call.

Work saved: of a document's ``d(2d+1)`` causal blocks, those with ``D > ceil((w - 1) / c)`` are skipped, so about
``2d (D_max + 1) - D_max (D_max + 1) / 2`` run, ``D_max = ceil((w - 1) / c)``. E.g. ``L = 128k``, ``d = 8``
(``c = 8k``) and ``w = 4k``: 31 of 136 blocks run (23 %), and the 15 at ``D = 1`` are edges cut to ``(w-1)^2 / 2``
of work each. The saving is compute: K/V (and dK/dV) blocks still travel the whole ring, also at steps where this
rank skips everything (cutting the ring short is not done). :class:`RingPlan` counts the blocks run and skipped, and
its calls are exactly the kernel calls the ring makes, forward and backward.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from flexorch.workers.attention.seqlens import Seqlens

__all__ = ["ALL", "BlockCall", "RingPlan", "ZigzagBlocks", "causal_plan", "ring_plan", "window_plan", "zigzag_blocks"]

ALL = slice(None)
"""Every row."""


@dataclass(frozen=True)
class ZigzagBlocks:
    """Local document boundaries and chunk indices of one rank's zigzag shard."""

    full: Seqlens
    """Local documents (two chunks each): global cu_seqlens // d."""
    half: Seqlens
    """One chunk per document: global cu_seqlens // (2d)."""
    front: torch.Tensor | slice
    """Local token indices of every document's first chunk (chunk r)."""
    back: torch.Tensor | slice
    """Local token indices of every document's second chunk (chunk 2d-1-r)."""


def zigzag_blocks(
    seqlens: Seqlens,
    degree: int,
    device: torch.device | None = None,
    *,
    where: str = "zigzag_ring_attn_varlen_func",
    layout: str = "shard_zigzag",
) -> ZigzagBlocks:
    """Pure: local block structure from the global padded boundaries; ValueError unless 2d-aligned (``where`` and
    ``layout``, the ``sharding`` function that pads, name the caller in the message)."""
    two_d = 2 * degree
    for i, (a, b) in enumerate(zip(seqlens.offsets[:-1], seqlens.offsets[1:], strict=True)):
        if (b - a) % two_d:
            raise ValueError(
                f"{where}: document {i} has {b - a} tokens, not a multiple of 2 * degree"
                f" = {two_d}; pad documents with flexorch.workers.attention.sharding.{layout}"
            )
    full = Seqlens(tuple(x // degree for x in seqlens.offsets))
    half = Seqlens(tuple(x // two_d for x in seqlens.offsets))
    if len(full.offsets) == 2:  # one document: plain slices, no gather
        return ZigzagBlocks(full, half, slice(0, half.total), slice(half.total, full.total))
    chunk = torch.tensor(half.offsets[1:]) - torch.tensor(half.offsets[:-1])  # (n_docs,)
    # Token j of chunk i sits at local position full.offsets[i] + j (front) or + chunk[i] + j (back).
    inner = torch.arange(half.total) - torch.repeat_interleave(torch.tensor(half.offsets[:-1]), chunk)
    front = torch.repeat_interleave(torch.tensor(full.offsets[:-1]), chunk) + inner
    back = front + torch.repeat_interleave(chunk, chunk)
    return ZigzagBlocks(full, half, front.to(device), back.to(device))


@dataclass(frozen=True)
class BlockCall:
    """One kernel call of a ring step: local queries ``q[q_rows]`` against the step's ``k[k_rows]``, ``v[k_rows]``."""

    q_rows: torch.Tensor | slice
    """Local query rows (:data:`ALL`, a slice, or an index tensor; no row twice)."""
    k_rows: torch.Tensor | slice
    """Rows of the step's K/V block (no row twice)."""
    cu_q: Seqlens
    cu_k: Seqlens
    causal: bool
    window: int | None = None
    shift: tuple[int, ...] | None = None
    """Per document of the call: position of its first query row minus that of its first key row."""


@dataclass(frozen=True)
class RingPlan:
    """The kernel calls of one rank at every ring step, and how many (query chunk, key chunk, document) blocks they
    compute and skip."""

    steps: tuple[tuple[BlockCall, ...], ...]
    """``steps[i]``: the calls against the K/V of rank ``r - i``; the first call of step 0 covers every row."""
    blocks_run: int
    """Causally visible blocks computed (fully or at the window's edge)."""
    blocks_skipped: int
    """Causally visible blocks outside every window: no kernel call."""

    @property
    def calls(self) -> int:
        """Kernel calls of a forward (the backward makes as many)."""
        return sum(len(s) for s in self.steps)


def causal_plan(blocks: ZigzagBlocks, rank: int, degree: int) -> RingPlan:
    """The plan without a window: one call per step (the module doc), every causally visible block computed."""
    full, half, front, back = blocks.full, blocks.half, blocks.front, blocks.back
    steps = [(BlockCall(ALL, ALL, full, full, True),)]
    for step in range(1, degree):
        src = (rank - step) % degree
        steps.append(
            (BlockCall(ALL, front, full, half, False),) if src < rank else (BlockCall(back, ALL, half, full, False),)
        )
    n = len(full.offsets) - 1
    return RingPlan(tuple(steps), n * (2 * degree + 1), 0)


def ring_plan(
    blocks: ZigzagBlocks, rank: int, degree: int, window: int | None, device: torch.device | None = None
) -> RingPlan:
    """:func:`window_plan` where a window reaches short of some document's length, else :func:`causal_plan`
    (``device``: where the window plan's row indices go, the tensors' device)."""
    if window is None or window >= 2 * degree * blocks.half.max_seqlen:  # every key in every window: causal
        return causal_plan(blocks, rank, degree)
    return window_plan(blocks.full.offsets, blocks.half.offsets, rank, degree, window, device)


def _seqlens(lengths: list[int]) -> Seqlens:
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    return Seqlens(tuple(offsets))


def _rows(spans: list[tuple[int, int, int]], device) -> torch.Tensor:
    """Local rows ``[base + lo, base + hi)`` of each span ``(base, lo, hi)``, concatenated."""
    return torch.cat([torch.arange(base + lo, base + hi) for base, lo, hi in spans]).to(device)


@functools.lru_cache(maxsize=64)
def window_plan(
    full_offsets: tuple[int, ...],
    half_offsets: tuple[int, ...],
    rank: int,
    degree: int,
    window: int,
    device: torch.device | None = None,
) -> RingPlan:
    """The plan with a sliding window of ``window`` keys (the module doc); ``full_offsets``/``half_offsets``: the
    local documents and chunks (:class:`ZigzagBlocks`). Cached: every layer of a micro-batch asks the same."""
    d, r, w = degree, rank, window
    n = len(half_offsets) - 1
    chunk = [half_offsets[i + 1] - half_offsets[i] for i in range(n)]
    start = full_offsets[:-1]
    local = _seqlens([x for c in chunk for x in (c, c)])  # every local chunk a document of its own
    steps, run, skipped = [], 2 * n, 0
    for step in range(d):
        src = (r - step) % d
        calls = [BlockCall(ALL, ALL, local, local, True, w)] if step == 0 else []  # the diagonal blocks
        for q_side, x in ((0, r), (1, 2 * d - 1 - r)):  # (offset in chunks inside the local document, chunk index)
            for k_side, y in ((0, src), (1, 2 * d - 1 - src)):
                dist = x - y
                if dist < 1:  # 0: the diagonal (step 0, above); < 0: the keys lie in the queries' future
                    continue
                whole, edge = [], []
                for i, c in enumerate(chunk):
                    qb, kb = start[i] + q_side * c, start[i] + k_side * c
                    if (dist - 1) * c + 1 >= w:
                        skipped += 1
                    elif (dist + 1) * c <= w:
                        whole.append(((qb, 0, c), (kb, 0, c), 0))
                    else:
                        m = max(0, dist * c - w + 1)  # query row a meets key b >= a + (dist * c - w + 1)
                        edge.append(((qb, 0, c - m), (kb, m, c), dist * c - m))
                run += len(whole) + len(edge)
                for spans, causal in ((whole, False), (edge, True)):
                    if spans:
                        q_rows, k_rows = _rows([s[0] for s in spans], device), _rows([s[1] for s in spans], device)
                        cu_q = _seqlens([hi - lo for _, lo, hi in (s[0] for s in spans)])
                        cu_k = _seqlens([hi - lo for _, lo, hi in (s[1] for s in spans)])
                        shift = tuple(s[2] for s in spans) if causal else None
                        calls.append(BlockCall(q_rows, k_rows, cu_q, cu_k, causal, w if causal else None, shift))
        steps.append(tuple(calls))
    return RingPlan(tuple(steps), run, skipped)
