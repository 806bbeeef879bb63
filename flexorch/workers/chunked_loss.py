"""The LM head and the cross-entropy fused over chunks of tokens: no ``(tokens, vocab)`` float32 logits for the
whole micro-batch, in the forward or the backward.

A micro-batch of 49K tokens over a 32K vocabulary makes 6 GiB of float32 logits (and as much again for their
gradient) when the head's output is materialised whole. Here each chunk of ``chunk`` tokens computes its logits,
its summed loss, and is checkpointed (``torch.utils.checkpoint``, non-reentrant): its logits are freed at once and
recomputed, one chunk at a time, in the backward. The price is the head's matmul run twice (2 x tokens x dim x
vocab FLOPs more: about 2 % of a 1B model's step). The technique of Liger-Kernel's fused linear cross-entropy and
Apple's Cut Cross-Entropy (arXiv 2411.09009), here in plain PyTorch so that FSDP2, recompute and the CPU path take it
unchanged. Exact: every token's loss is the plain loss's (the same matmul and log-softmax per row), only the sum's
order differs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["IGNORE_INDEX", "LMHead", "head_loss_sum"]

IGNORE_INDEX = -100  # the label of a position that predicts nothing (the last token of a document)


def _chunk_loss(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``h (c, dim)`` -> logits ``(c, vocab)`` float32 -> cross-entropy summed over labelled rows (a float32 scalar)."""
    logits = F.linear(h, weight).float()  # (c, dim) x (vocab, dim)^T -> (c, vocab)
    return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")


def head_loss_sum(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int) -> torch.Tensor:
    """Cross-entropy of ``F.linear(h, weight)`` against ``labels``, summed over the positions whose label is not
    ``IGNORE_INDEX``; float32 scalar. ``h (t, dim)``, ``weight (vocab, dim)``, ``labels (t,)`` int64. ``chunk``:
    tokens per chunk (0: the whole logits at once, as ``loss_sum(logits, labels)``). A micro-batch of one chunk or
    less is checkpointed too, so the bytes held for the backward are the same per token at every length (the
    calibrated ``act_bytes_per_token`` the planner budgets with holds for short micro-batches as for long ones)."""
    t = h.shape[0]
    if labels.shape != (t,):
        raise ValueError(f"labels must be ({t},) for hidden states {tuple(h.shape)}, got {tuple(labels.shape)}")
    if chunk < 0:
        raise ValueError(f"chunk must be >= 0 tokens, got {chunk}")
    if chunk == 0 or t == 0:  # whole logits; or an idle rank's empty micro-batch (nothing to hold)
        return _chunk_loss(h, weight, labels)
    total = None
    for i in range(0, t, chunk):
        part = checkpoint(_chunk_loss, h[i : i + chunk], weight, labels[i : i + chunk], use_reentrant=False)
        total = part if total is None else total + part
    return total


class LMHead(nn.Linear):
    """The LM head: an ``nn.Linear`` without bias (its parameter is ``weight``, as checkpoints name it), with the
    fused chunked loss as a second entry point, :meth:`loss_sum`. A pipeline's last stage shards the head as its own
    FSDP2 unit; FSDP2 gathers a unit's parameters only around a registered forward method, so the stage registers
    this one (``torch.distributed.fsdp.register_fsdp_forward_method``) and calls it instead of materialising the
    logits."""

    def __init__(self, dim: int, vocab_size: int) -> None:
        super().__init__(dim, vocab_size, bias=False)

    def loss_sum(self, h: torch.Tensor, labels: torch.Tensor, chunk: int) -> torch.Tensor:
        """:func:`head_loss_sum` of ``h (t, dim)`` against ``labels (t,)`` with this head's weight."""
        return head_loss_sum(h, self.weight, labels, chunk)
