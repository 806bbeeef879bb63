"""The adapter to PyTorch's own fused varlen flash-attention kernels (CUDA, fp16/bf16), used by the ``torch_flash``
backend of :mod:`~.kernels` when flash-attn is not installed.

PyTorch ships FlashAttention-2 (Dao, arXiv 2307.08691) in ATen: ``aten::_flash_attention_forward`` takes packed
``(t, h, hd)`` tensors with cumulative sequence lengths (the varlen path) and returns the log-sum-exp as
``(h, t_q)`` float32, the layout :mod:`~.merge` merges; ``aten::_flash_attention_backward`` takes it back. Both
ops are what ``torch.nn.attention.varlen.varlen_attn`` (torch >= 2.9) calls; we call them directly because the
ring needs the raw backward with the *whole* attention's ``out``/``lse`` (a block's gradients, not a full
autograd node). GQA is native (``k``/``v`` may have fewer heads). Causal masking is bottom-right aligned, which is
top-left for the equal-length blocks :mod:`~.kernels` uses it with.

No dropout: the ``rng_state`` and ``unused`` arguments of the backward are placeholders, as in torch's varlen op.
"""

from __future__ import annotations

import torch

from flexorch.workers.attention.seqlens import kernel_boundaries

__all__ = ["torch_flash_available", "torch_flash_backward", "torch_flash_forward"]


def _aten():
    """``torch.ops.aten`` (a seam: tests stand a CPU fake in for the CUDA-only ops)."""
    return torch.ops.aten


def torch_flash_available() -> bool:
    """True when this torch build has CUDA and the fused flash-attention ops (sm80+ is checked by the kernel)."""
    return torch.cuda.is_available() and hasattr(torch.ops.aten, "_flash_attention_forward")


def torch_flash_forward(q, k, v, cu_q, cu_k, causal, scale):
    out, lse, _rng, _unused, _mask = _aten()._flash_attention_forward(
        q,
        k,
        v,
        *kernel_boundaries(cu_q, cu_k, q.device),
        0.0,  # dropout_p
        causal,
        False,  # return_debug_mask
        scale=scale,
    )
    return out, lse  # lse: (h, t_q) float32 on the varlen path


def torch_flash_backward(dout, q, k, v, out, lse, cu_q, cu_k, causal, scale):
    rng_state = torch.zeros((2,), dtype=torch.uint64, device=q.device)  # unused without dropout
    unused = torch.empty(0, device=q.device)
    dq, dk, dv = _aten()._flash_attention_backward(
        dout.contiguous(),
        q,
        k,
        v,
        out,
        lse,
        *kernel_boundaries(cu_q, cu_k, q.device),
        0.0,  # dropout_p
        causal,
        rng_state,
        unused,
        scale=scale,
    )
    return dq, dk, dv
