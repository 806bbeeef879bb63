"""The adapter to flash-attn's varlen kernels (Dao, arXiv 2307.08691), used by the ``flash_attn`` backend of
:mod:`~.kernels`: forward returning the log-sum-exp, and the raw backward called with the argument names this
flash-attn build has (they changed across 2.x releases). Imports flash-attn lazily; absent, the module is None.

A sliding window of ``w`` keys is flash-attn's ``window_size=(w - 1, 0)`` with ``causal=True`` (flash-attn >= 2.3:
query ``i`` sees keys ``[i + lk - lq - window_size[0], i + lk - lq + window_size[1]]``, its docstring of
``flash_attn_varlen_func``); ``kernels`` sends only blocks aligned that way (``shift = lk - lq`` per document).
"""

from __future__ import annotations

import functools
import inspect

import torch

from flexorch.workers.attention.seqlens import kernel_boundaries

__all__ = ["flash_attn_module", "flash_backward", "flash_forward"]


@functools.cache
def flash_attn_module():
    """The installed ``flash_attn.flash_attn_interface``, or None."""
    try:
        import flash_attn.flash_attn_interface as fai
    except ImportError:
        return None
    return fai


def flash_forward(q, k, v, cu_q, cu_k, causal, scale, window=None):
    fai = flash_attn_module()
    # a window's block comes bottom-right aligned (kernels._bottom_right), the only alignment flash-attn has
    kw = {"window_size": (window - 1, 0)} if window is not None else {}
    out, lse, _ = fai.flash_attn_varlen_func(
        q,
        k,
        v,
        *kernel_boundaries(cu_q, cu_k, q.device),
        dropout_p=0.0,
        softmax_scale=scale,
        causal=causal,
        return_attn_probs=True,
        **kw,
    )
    return out, lse  # lse: (h, t_q) float32 in flash-attn >= 2.4's varlen API


def flash_backward(dout, q, k, v, out, lse, cu_q, cu_k, causal, scale, window=None):
    fai = flash_attn_module()
    fn = fai._flash_attn_varlen_backward
    # flash-attn >= 2.7 wraps it in torch.library.custom_op, whose own signature is (*args, **kwargs).
    params = inspect.signature(getattr(fn, "_init_fn", fn)).parameters
    # Keyword names after `causal` changed across flash-attn 2.x releases; pass only those this build has.
    extra = {"alibi_slopes": None, "deterministic": False, "rng_state": None, "softcap": 0.0}
    left, right = (window - 1, 0) if window is not None else (-1, -1)
    if "window_size_left" in params:
        extra |= {"window_size_left": left, "window_size_right": right}
    else:
        extra["window_size"] = (left, right)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    fn(
        dout.contiguous(),
        q,
        k,
        v,
        out,
        lse,
        dq,
        dk,
        dv,
        *kernel_boundaries(cu_q, cu_k, q.device),
        0.0,
        scale,
        causal,
        **{n: x for n, x in extra.items() if n in params},
    )
    return dq, dk, dv
