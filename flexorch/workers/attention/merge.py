"""Exact merge of two partial softmax-attention results by their log-sum-exps.

Two blocks of keys attended separately give ``(out_a, lse_a)`` and ``(out_b, lse_b)``; the attention over both
blocks is their log-sum-exp weighted average (the online-softmax rescaling of FlashAttention, Dao et al., arXiv
2205.14135, Alg. 1; the same update as ``_update_out_and_lse`` in zhuzilin/ring-flash-attention):

    lse = lse_a + log1p(exp(lse_b - lse_a)) = lse_a - logsigmoid(lse_a - lse_b)
    out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse) = out_a - sigmoid(lse_b - lse_a) * (out_a - out_b)

The sigmoid form never exponentiates a large positive number. Used by zigzag ring attention (a K/V block per ring
step, :mod:`~.ring`) and by segment attention (a piece's own block and its K/V prefix, :mod:`~.segment`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["merge_attn_outputs"]


def merge_attn_outputs(
    out: torch.Tensor, lse: torch.Tensor, blk_out: torch.Tensor, blk_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge ``blk_out``/``blk_lse`` into the running ``out`` (``(t, h, hd)``) and ``lse`` (``(h, t)``), both in the
    accumulation dtype (``kernels.acc_dtype``: float32, or float64 for fp64 inputs).

    Returns the new ``(out, lse)``; ``blk_out`` may be in a lower precision (it is promoted to ``out``'s dtype)."""
    blk_lse = blk_lse.to(lse.dtype)
    w = torch.sigmoid(blk_lse - lse).t().unsqueeze(-1)  # (h, t) -> (t, h, 1)
    return out - w * (out - blk_out.to(out.dtype)), lse - F.logsigmoid(lse - blk_lse)
