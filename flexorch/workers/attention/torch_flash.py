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

A sliding window of ``w`` keys: ``window_size_left = w - 1``, ``window_size_right = 0`` (keyword arguments of both ops
in torch 2.13's schemas; :func:`torch_flash_window_available` reads them from this torch) with ``is_causal=False``,
the call ``torch.nn.attention.varlen.varlen_attn(window_size=(w - 1, 0))`` makes; FlashAttention-2 aligns it
bottom-right, and ``kernels`` sends only blocks aligned that way.
"""

from __future__ import annotations

import torch

from flexorch.workers.attention.seqlens import kernel_boundaries

__all__ = ["torch_flash_available", "torch_flash_backward", "torch_flash_forward", "torch_flash_window_available"]


def _aten():
    """``torch.ops.aten`` (a seam: tests stand a CPU fake in for the CUDA-only ops)."""
    return torch.ops.aten


def torch_flash_available() -> bool:
    """True when this torch build has CUDA and the fused flash-attention ops (sm80+ is checked by the kernel)."""
    return torch.cuda.is_available() and hasattr(torch.ops.aten, "_flash_attention_forward")


def torch_flash_window_available() -> bool:
    """True when this torch's flash ops take ``window_size_left``/``_right`` (forward and backward)."""
    ops = (getattr(torch.ops.aten, n, None) for n in ("_flash_attention_forward", "_flash_attention_backward"))
    return all(op is not None and "window_size_left" in str(op.default._schema) for op in ops)


def _window(causal: bool, window: int | None) -> tuple[bool, dict]:
    """``(is_causal, window keywords)`` of a call: a window is (w - 1, 0) with is_causal False, as torch's varlen_attn
    passes it (FlashAttention-2 treats a (left, 0) window as causal)."""
    if window is None:
        return causal, {}
    return False, {"window_size_left": window - 1, "window_size_right": 0}


def torch_flash_forward(q, k, v, cu_q, cu_k, causal, scale, window=None):
    is_causal, kw = _window(causal, window)  # the block comes bottom-right aligned (kernels._bottom_right)
    out, lse, _rng, _unused, _mask = _aten()._flash_attention_forward(
        q,
        k,
        v,
        *kernel_boundaries(cu_q, cu_k, q.device),
        0.0,  # dropout_p
        is_causal,
        False,  # return_debug_mask
        scale=scale,
        **kw,
    )
    return out, lse  # lse: (h, t_q) float32 on the varlen path


def torch_flash_backward(dout, q, k, v, out, lse, cu_q, cu_k, causal, scale, window=None):
    is_causal, kw = _window(causal, window)
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
        is_causal,
        rng_state,
        unused,
        scale=scale,
        **kw,
    )
    return dq, dk, dv
