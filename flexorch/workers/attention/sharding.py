"""Per-rank layouts of a packed batch for sequence parallelism (pure functions, no process group).

A packed batch is ``tokens`` of shape ``(T, ...)`` plus ``cu_seqlens`` (``(n_docs + 1,)``, starting at 0,
strictly increasing, ending at ``T``), as in flash-attn's varlen API. Three layouts:

* **contiguous** (Ulysses): the batch, padded at the end to a multiple of ``world_size`` by one extra padding
  document, is cut into ``world_size`` equal contiguous pieces; rank ``r`` holds piece ``r``.
* **zigzag** (ring attention): every document is padded at its end to a multiple of ``2 * world_size`` and cut
  into ``2 * world_size`` equal chunks; rank ``r`` holds chunks ``r`` and ``2 * world_size - 1 - r`` of every
  document, which balances causal work across the ring (zhuzilin/ring-flash-attention, "zigzag"
  layout).
* **hybrid** (Ulysses x zigzag ring, ``hybrid``): ``world_size = u * r``; the zigzag layout over ``r`` ring
  positions, each position's tokens then cut into ``u`` contiguous pieces; group rank ``j * u + i`` holds piece
  ``i`` of position ``j``. A padding document of a multiple of ``2r`` tokens at the end makes every position's
  tokens divisible by ``u``.

Padding sits after the real tokens of its document, so causal attention never lets a real token see it; its
outputs are garbage and must be masked out of the loss with ``Layout.loss_mask``. Each layout function is
pure: call it for every rank in one process to check a plan.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "Layout",
    "check_cu_seqlens",
    "contiguous_layout",
    "hybrid_layout",
    "zigzag_layout",
    "shard",
    "unshard",
    "shard_contiguous",
    "shard_zigzag",
    "unshard_contiguous",
    "unshard_zigzag",
]


@dataclass(frozen=True)
class Layout:
    """Where each local token of one rank comes from, and what the attention functions need to know."""

    index: torch.Tensor
    """(t_local,) int64: index of the token in the original (unpadded) packed batch, -1 for padding."""
    position_ids: torch.Tensor
    """(t_local,) int64: position of the token inside its document in the global sequence (for RoPE)."""
    cu_seqlens: torch.Tensor
    """(n + 1,) int32: boundaries of the padded global batch; what the ``*_varlen_func`` functions take."""
    local_cu_seqlens: torch.Tensor
    """(m + 1,) int32: boundaries of the document pieces inside this rank's shard."""
    max_seqlen: int
    """Longest document of the padded global batch."""

    @property
    def loss_mask(self) -> torch.Tensor:
        """(t_local,) bool: True for real tokens, False for padding (mask it out of the loss)."""
        return self.index >= 0


def check_cu_seqlens(cu_seqlens: torch.Tensor | Sequence[int], total_tokens: int | None = None) -> list[int]:
    """Validate document boundaries and return them as a host list; raises ValueError with the numbers."""
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() != 1 or cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype == torch.bool:
            raise ValueError(
                f"cu_seqlens must be a 1-D integer tensor, got {tuple(cu_seqlens.shape)} {cu_seqlens.dtype}"
            )
        offsets = [int(x) for x in cu_seqlens.tolist()]
    else:
        offsets = [int(x) for x in cu_seqlens]
    if len(offsets) < 2 or offsets[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0 and hold at least one document, got {offsets[:8]}")
    for i in range(len(offsets) - 1):
        if offsets[i + 1] <= offsets[i]:
            raise ValueError(
                f"cu_seqlens must be strictly increasing: cu_seqlens[{i}]={offsets[i]} >= "
                f"cu_seqlens[{i + 1}]={offsets[i + 1]}"
            )
    if total_tokens is not None and offsets[-1] != total_tokens:
        raise ValueError(f"cu_seqlens ends at {offsets[-1]} but the packed batch holds {total_tokens} tokens")
    return offsets


def _check_rank(rank: int, world_size: int) -> None:
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank} world_size={world_size}")


def _i32(values: Sequence[int]) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int32)


def contiguous_layout(cu_seqlens: torch.Tensor | Sequence[int], rank: int, world_size: int) -> Layout:
    """Layout of ``rank`` for Ulysses: piece ``rank`` of the batch padded to a multiple of world_size."""
    _check_rank(rank, world_size)
    offsets = check_cu_seqlens(cu_seqlens)
    total = offsets[-1]
    pad = -total % world_size
    padded = offsets + [total + pad] if pad else offsets
    piece = (total + pad) // world_size
    lo, hi = rank * piece, (rank + 1) * piece
    pos = torch.arange(lo, hi, dtype=torch.int64)
    bounds = torch.tensor(padded, dtype=torch.int64)
    doc = torch.searchsorted(bounds, pos, right=True) - 1  # document of each padded global position
    index = torch.where(pos < total, pos, torch.full_like(pos, -1))
    inner = sorted({0, piece} | {b - lo for b in padded if lo < b < hi})
    return Layout(
        index=index,
        position_ids=pos - bounds[doc],
        cu_seqlens=_i32(padded),
        local_cu_seqlens=_i32(inner),
        max_seqlen=max(b - a for a, b in zip(padded[:-1], padded[1:], strict=True)),
    )


def zigzag_layout(cu_seqlens: torch.Tensor | Sequence[int], rank: int, world_size: int) -> Layout:
    """Layout of ``rank`` for zigzag ring attention: chunks r and 2d-1-r of every document padded to 2d."""
    _check_rank(rank, world_size)
    offsets = check_cu_seqlens(cu_seqlens)
    two_d = 2 * world_size
    lengths = torch.tensor([b - a for a, b in zip(offsets[:-1], offsets[1:], strict=True)], dtype=torch.int64)
    padded_lengths = (lengths + two_d - 1) // two_d * two_d
    chunk = padded_lengths // two_d  # (n_docs,) chunk length of each document
    starts = torch.tensor(offsets[:-1], dtype=torch.int64)
    # Local tokens of document i: chunk[i] tokens of chunk `rank`, then chunk[i] tokens of chunk `2d-1-rank`.
    doc = torch.repeat_interleave(torch.arange(len(lengths)), 2 * chunk)
    local_starts = torch.cumsum(2 * chunk, 0) - 2 * chunk
    u = torch.arange(int(doc.numel())) - local_starts[doc]  # offset inside the document's local part
    c = chunk[doc]
    in_doc = torch.where(u < c, rank * c + u, (two_d - 1 - rank) * c + (u - c))  # offset inside the padded doc
    index = torch.where(in_doc < lengths[doc], starts[doc] + in_doc, torch.full_like(in_doc, -1))
    padded_cu = [0] + torch.cumsum(padded_lengths, 0).tolist()
    return Layout(
        index=index,
        position_ids=in_doc,
        cu_seqlens=_i32(padded_cu),
        local_cu_seqlens=_i32([x // world_size for x in padded_cu]),
        max_seqlen=int(padded_lengths.max()),
    )


def hybrid_layout(cu_seqlens: torch.Tensor | Sequence[int], rank: int, world_size: int, ulysses_degree: int) -> Layout:
    """Layout of group ``rank`` for hybrid attention on ``world_size = u * r`` ranks (``u = ulysses_degree``): piece
    ``rank % u`` (contiguous) of ring position ``rank // u``'s zigzag shard of a ring of ``r``."""
    _check_rank(rank, world_size)
    u = ulysses_degree
    if u < 1 or world_size % u:
        raise ValueError(f"hybrid_layout: ulysses_degree {u} does not divide the group's {world_size} ranks")
    r = world_size // u
    offsets = check_cu_seqlens(cu_seqlens)
    total = offsets[-1]
    two_r = 2 * r
    zig_total = sum(-(-(b - a) // two_r) * two_r for a, b in zip(offsets[:-1], offsets[1:], strict=True))
    extra = -zig_total % math.lcm(two_r, r * u)  # a multiple of 2r: a zigzag document of its own
    ring = zigzag_layout(offsets + [total + extra] if extra else offsets, rank // u, r)
    piece = ring.index.numel() // u  # the position's (zig_total + extra) / r tokens, cut into u pieces
    lo, hi = (rank % u) * piece, (rank % u + 1) * piece
    index = ring.index[lo:hi]
    inner = sorted({0, piece} | {int(b) - lo for b in ring.local_cu_seqlens.tolist() if lo < b < hi})
    return Layout(
        index=torch.where(index < total, index, torch.full_like(index, -1)),  # the extra document is padding
        position_ids=ring.position_ids[lo:hi],
        cu_seqlens=ring.cu_seqlens,
        local_cu_seqlens=_i32(inner),
        max_seqlen=ring.max_seqlen,
    )


def shard(tokens: torch.Tensor, layout: Layout) -> torch.Tensor:
    """Local tokens ``(t_local, ...)`` of one rank; padding positions are zero."""
    local = tokens[layout.index.clamp(min=0).to(tokens.device)]
    mask = layout.loss_mask.to(tokens.device).view(-1, *([1] * (tokens.dim() - 1)))
    return torch.where(mask, local, torch.zeros((), dtype=tokens.dtype, device=tokens.device))


def unshard(local_tokens: Sequence[torch.Tensor], layouts: Sequence[Layout], total_tokens: int) -> torch.Tensor:
    """Inverse of :func:`shard`: put every rank's real tokens back into a ``(total_tokens, ...)`` tensor."""
    if len(local_tokens) != len(layouts):
        raise ValueError(f"got {len(local_tokens)} shards for {len(layouts)} layouts")
    first = local_tokens[0]
    out = first.new_zeros((total_tokens, *first.shape[1:]))
    seen = 0
    for local, layout in zip(local_tokens, layouts, strict=True):
        if local.shape[0] != layout.index.numel():
            raise ValueError(f"shard has {local.shape[0]} tokens, its layout {layout.index.numel()}")
        keep = layout.loss_mask.to(local.device)
        out[layout.index.to(local.device)[keep]] = local[keep]
        seen += int(keep.sum())
    if seen != total_tokens:
        raise ValueError(f"shards hold {seen} real tokens, expected {total_tokens}")
    return out


def shard_contiguous(
    tokens: torch.Tensor, cu_seqlens: torch.Tensor | Sequence[int], rank: int, world_size: int
) -> tuple[torch.Tensor, Layout]:
    """Global packed ``tokens`` -> (local tokens, layout) of ``rank`` in the contiguous (Ulysses) layout."""
    check_cu_seqlens(cu_seqlens, tokens.shape[0])
    layout = contiguous_layout(cu_seqlens, rank, world_size)
    return shard(tokens, layout), layout


def shard_zigzag(
    tokens: torch.Tensor, cu_seqlens: torch.Tensor | Sequence[int], rank: int, world_size: int
) -> tuple[torch.Tensor, Layout]:
    """Global packed ``tokens`` -> (local tokens, layout) of ``rank`` in the zigzag (ring) layout."""
    check_cu_seqlens(cu_seqlens, tokens.shape[0])
    layout = zigzag_layout(cu_seqlens, rank, world_size)
    return shard(tokens, layout), layout


def unshard_contiguous(local_tokens: Sequence[torch.Tensor], cu_seqlens: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """Inverse of :func:`shard_contiguous` given the shards of all ranks in rank order."""
    offsets = check_cu_seqlens(cu_seqlens)
    d = len(local_tokens)
    return unshard(local_tokens, [contiguous_layout(offsets, r, d) for r in range(d)], offsets[-1])


def unshard_zigzag(local_tokens: Sequence[torch.Tensor], cu_seqlens: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """Inverse of :func:`shard_zigzag` given the shards of all ranks in rank order."""
    offsets = check_cu_seqlens(cu_seqlens)
    d = len(local_tokens)
    return unshard(local_tokens, [zigzag_layout(offsets, r, d) for r in range(d)], offsets[-1])
