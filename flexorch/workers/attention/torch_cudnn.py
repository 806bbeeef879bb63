"""cuDNN's fused attention for the long documents of a varlen batch (CUDA, fp16/bf16): the ``torch_cudnn`` backend.

On Hopper, cuDNN's flash attention (the kernel behind torch SDPA's ``CUDNN_ATTENTION``) is faster than the
FlashAttention-2 kernels torch ships (``torch_flash``), forward and backward, at head dims 64 and 128, with the same
error against the fp32 reference (``benchmarks/gpu/gpu_profile.py``; its H200 numbers are in
``benchmarks/results/gpu/gpu_profile_h200.md``). torch's own varlen entry to it (``aten::_cudnn_attention_forward``
with cumulative lengths) is switched off in torch (``torch.nn.attention.varlen._should_use_cudnn`` returns False)
and hits an illegal memory access, so this adapter calls the dense ops
``aten::_scaled_dot_product_cudnn_attention`` and its ``_backward`` once per document, ``(1, h, L, hd)`` each, and
keeps the rest of the batch on ``torch_flash`` in one varlen call:

* a document goes to cuDNN when the call is causal, its query and key lengths are equal and at least
  :data:`MIN_TOKENS` (attention grows with L^2, so the long documents are where the time is; short ones would pay
  a launch each);
* its length is padded up to a multiple of :data:`PAD_TOKENS` with zero rows, so a run sees a bounded set of
  shapes and cuDNN builds an execution plan for each shape once. Padding is exact under the causal mask: real
  queries never see the padded keys after them; padded query rows are dropped from the output, get a zero
  ``dout`` and a log-sum-exp of :data:`_PAD_LSE` in the backward (probability exp(0 - 10^4) = 0), so they add
  nothing to ``dk``/``dv``;
* GQA: ``k``/``v`` are repeated to every query head (``(L, h_kv, hd) -> (L, h, hd)``) and ``dk``/``dv`` summed back
  over each group (the measured rate is the same as cuDNN's own GQA through SDPA);
* no dropout: the philox seed and offset the backward takes are zeros, as torch makes them for dropout 0.

The log-sum-exp comes back ``(h, t_q)`` float32 like the other backends', so ring attention can merge blocks and
pass the whole attention's ``out``/``lse`` to the backward.
"""

from __future__ import annotations

import functools

import torch

from flexorch.workers.attention.seqlens import Seqlens
from flexorch.workers.attention.torch_flash import torch_flash_backward, torch_flash_forward

__all__ = ["MIN_TOKENS", "PAD_TOKENS", "torch_cudnn_available", "torch_cudnn_backward", "torch_cudnn_forward"]

MIN_TOKENS = 4096
"""Shortest document (query and key tokens) run on cuDNN; shorter ones stay on torch's flash kernels."""
PAD_TOKENS = 1024
"""A cuDNN document's length is padded up to a multiple of this (a bounded number of execution plans)."""
_PAD_LSE = 1.0e4
"""The log-sum-exp the backward gets for a padded query row: its scores are 0 (zero q), exp(0 - 1e4) = 0."""


def _aten():
    """``torch.ops.aten`` (a seam: tests stand a CPU fake in for the CUDA-only ops)."""
    return torch.ops.aten


def torch_cudnn_available() -> bool:
    """True when this torch has CUDA, cuDNN and the fused cuDNN attention ops (Ampere or newer is the kernel's)."""
    return (
        torch.cuda.is_available()
        and torch.backends.cudnn.is_available()
        and hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention")
    )


@functools.lru_cache(maxsize=256)
def split(q_offsets: tuple[int, ...], k_offsets: tuple[int, ...], causal: bool) -> tuple[tuple[int, ...], tuple]:
    """Documents run on cuDNN, and the rows of the others as ``((start, end), ...)`` runs of q and k."""
    long, rest_q, rest_k = [], [], []
    for i in range(len(q_offsets) - 1):
        lq, lk = q_offsets[i + 1] - q_offsets[i], k_offsets[i + 1] - k_offsets[i]
        if causal and lq == lk and lq >= MIN_TOKENS:
            long.append(i)
        else:
            rest_q.append((q_offsets[i], q_offsets[i + 1]))
            rest_k.append((k_offsets[i], k_offsets[i + 1]))
    return tuple(long), (tuple(rest_q), tuple(rest_k))


def _padded(x: torch.Tensor, n: int) -> torch.Tensor:
    """``(L, heads, hd)`` -> ``(1, heads, n, hd)`` with ``n - L`` zero rows after the real ones (a strided view of
    the padded copy, hd contiguous, as cuDNN takes it)."""
    if n > x.shape[0]:
        x = torch.cat([x, x.new_zeros(n - x.shape[0], *x.shape[1:])])
    return x.transpose(0, 1).unsqueeze(0)  # (n, heads, hd) -> (1, heads, n, hd)


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32  # kernels.acc_dtype (fp64 only in tests)


def _pad_len(n: int) -> int:
    return -(-n // PAD_TOKENS) * PAD_TOKENS


def _rest(q_offsets, k_offsets, runs_q, runs_k):
    """The Seqlens of the documents kept on torch_flash, as one packed batch of their own."""

    def offsets(runs):
        out = [0]
        for a, b in runs:
            out.append(out[-1] + b - a)
        return Seqlens(tuple(out))

    return offsets(runs_q), offsets(runs_k)


def _gather(x: torch.Tensor, runs) -> torch.Tensor:
    return torch.cat([x[a:b] for a, b in runs]) if len(runs) != 1 else x[runs[0][0] : runs[0][1]]


def torch_cudnn_forward(q, k, v, cu_q, cu_k, causal, scale):
    long, (runs_q, runs_k) = split(cu_q.offsets, cu_k.offsets, causal)
    if not long:
        return torch_flash_forward(q, k, v, cu_q, cu_k, causal, scale)
    h, rep = q.shape[1], q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    lse = torch.empty(h, q.shape[0], dtype=_acc(q.dtype), device=q.device)
    for i in long:
        a, b = cu_q.offsets[i], cu_q.offsets[i + 1]
        ka, kb = cu_k.offsets[i], cu_k.offsets[i + 1]
        n = _pad_len(b - a)
        kr, vr = (x[ka:kb].repeat_interleave(rep, dim=1) for x in (k, v))  # (L, h_kv, hd) -> (L, h, hd)
        res = _aten()._scaled_dot_product_cudnn_attention(
            _padded(q[a:b], n), _padded(kr, n), _padded(vr, n), None, True, 0.0, True, False, scale=scale
        )
        out[a:b] = res[0][0, :, : b - a].transpose(0, 1)  # (1, h, n, hd) -> (L, h, hd)
        lse[:, a:b] = res[1].reshape(h, n)[:, : b - a]  # (1, h, n[, 1]) -> (h, L)
    if runs_q:
        sq, sk = _rest(cu_q.offsets, cu_k.offsets, runs_q, runs_k)
        o_r, l_r = torch_flash_forward(
            _gather(q, runs_q), _gather(k, runs_k), _gather(v, runs_k), sq, sk, causal, scale
        )
        for j, (a, b) in enumerate(runs_q):
            out[a:b] = o_r[sq.offsets[j] : sq.offsets[j + 1]]
            lse[:, a:b] = l_r[:, sq.offsets[j] : sq.offsets[j + 1]]
    return out, lse


def torch_cudnn_backward(dout, q, k, v, out, lse, cu_q, cu_k, causal, scale):
    long, (runs_q, runs_k) = split(cu_q.offsets, cu_k.offsets, causal)
    if not long:
        return torch_flash_backward(dout, q, k, v, out, lse, cu_q, cu_k, causal, scale)
    h, h_kv, rep = q.shape[1], k.shape[1], q.shape[1] // k.shape[1]
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    zero = torch.zeros(1, dtype=torch.int64, device=q.device)  # philox seed / offset: no dropout
    for i in long:
        a, b = cu_q.offsets[i], cu_q.offsets[i + 1]
        ka, kb = cu_k.offsets[i], cu_k.offsets[i + 1]
        L, n = b - a, _pad_len(b - a)
        kr, vr = (x[ka:kb].repeat_interleave(rep, dim=1) for x in (k, v))  # (L, h_kv, hd) -> (L, h, hd)
        lse_i = torch.full((1, h, n, 1), _PAD_LSE, dtype=lse.dtype, device=q.device)
        lse_i[0, :, :L, 0] = lse[:, a:b]
        g = _aten()._scaled_dot_product_cudnn_attention_backward(
            _padded(dout[a:b], n).contiguous(),
            _padded(q[a:b], n),
            _padded(kr, n),
            _padded(vr, n),
            _padded(out[a:b], n).contiguous(),
            lse_i,
            zero,
            zero,
            None,  # attn_bias
            None,  # cum_seq_q
            None,  # cum_seq_k
            n,
            n,
            0.0,  # dropout_p
            True,  # causal
            scale=scale,
        )
        dq[a:b] = g[0][0, :, :L].transpose(0, 1)  # (1, h, n, hd) -> (L, h, hd)
        for dst, src in ((dk, g[1]), (dv, g[2])):
            # (1, h, n, hd) -> (L, h, hd) -> (L, h_kv, rep, hd) -> sum over each KV head's group -> (L, h_kv, hd)
            dst[ka:kb] = (
                src[0, :, :L].transpose(0, 1).reshape(L, h_kv, rep, -1).to(_acc(dst.dtype)).sum(2).to(dst.dtype)
            )
    if runs_q:
        sq, sk = _rest(cu_q.offsets, cu_k.offsets, runs_q, runs_k)
        g_r = torch_flash_backward(
            _gather(dout, runs_q),
            _gather(q, runs_q),
            _gather(k, runs_k),
            _gather(v, runs_k),
            _gather(out, runs_q),
            torch.cat([lse[:, a:b] for a, b in runs_q], dim=1),
            sq,
            sk,
            causal,
            scale,
        )
        for dst, src, runs, s in ((dq, g_r[0], runs_q, sq), (dk, g_r[1], runs_k, sk), (dv, g_r[2], runs_k, sk)):
            for j, (a, b) in enumerate(runs):
                dst[a:b] = src[s.offsets[j] : s.offsets[j + 1]]
    return dq, dk, dv
