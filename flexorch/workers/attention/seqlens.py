"""Document boundaries of a varlen attention call (``cu_seqlens``), apart from the kernels so that every backend
module can import them."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

__all__ = ["Seqlens", "kernel_boundaries"]


@dataclass(frozen=True)
class Seqlens:
    """Document boundaries of one side (queries or keys) of a varlen attention call."""

    offsets: tuple[int, ...]
    """Host copy of cu_seqlens: 0, end of doc 0, ..., total tokens."""

    @functools.cached_property
    def max_seqlen(self) -> int:
        """Longest document."""
        return max(b - a for a, b in zip(self.offsets[:-1], self.offsets[1:], strict=True))

    @property
    def total(self) -> int:
        """Number of tokens."""
        return self.offsets[-1]

    def tensor(self, device: torch.device) -> torch.Tensor:
        """cu_seqlens as an int32 tensor on ``device`` (what flash-attn takes)."""
        return torch.tensor(self.offsets, dtype=torch.int32, device=device)


def kernel_boundaries(
    cu_q: Seqlens, cu_k: Seqlens, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """``(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)``, the four boundary arguments, in this order, of
    every FlashAttention-2 varlen kernel (flash-attn's and ATen's, forward and backward)."""
    return cu_q.tensor(device), cu_k.tensor(device), cu_q.max_seqlen, cu_k.max_seqlen
