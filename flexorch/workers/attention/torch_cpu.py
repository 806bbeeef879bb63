"""The attention backends that run without CUDA kernels of their own (``flexorch.workers.attention.kernels`` chooses
among all of them):

* ``torch_cpu``: ``aten._scaled_dot_product_flash_attention_for_cpu`` and its ``_backward`` (both return / take the
  logsumexp) called per document; runs of short documents go into one call with a block-diagonal mask.
* ``math``: explicit matmul + logsumexp per document with a hand-written backward; any device, every float dtype.

Both follow the kernels' varlen convention: ``q`` ``(t_q, h, hd)``, ``k``/``v`` ``(t_k, h_kv, hd)``, ``lse``
``(h, t_q)`` in :func:`acc_dtype`.
"""

from __future__ import annotations

import torch

from flexorch.workers.attention.seqlens import Seqlens

__all__ = ["acc_dtype", "cpu_backward", "cpu_forward", "math_backward", "math_forward"]

# Documents shorter than this are batched into one masked CPU call (fewer Python-level kernel launches).
_CPU_BUCKET_TOKENS = 128


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype attention accumulates in for inputs of ``dtype``: the LSE, merged outputs, ring gradients."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _segments(cu_q: Seqlens, cu_k: Seqlens) -> list[tuple[int, int]]:
    """Runs ``[i, j)`` of documents handled by one kernel call: long documents alone, short ones together."""
    runs, i, n = [], 0, len(cu_q.offsets) - 1
    while i < n:
        j = i + 1
        while (
            j < n
            and cu_q.offsets[j + 1] - cu_q.offsets[i] <= _CPU_BUCKET_TOKENS
            and cu_k.offsets[j + 1] - cu_k.offsets[i] <= _CPU_BUCKET_TOKENS
        ):
            j += 1
        runs.append((i, j))
        i = j
    return runs


def _block_mask(cu_q: Seqlens, cu_k: Seqlens, i: int, j: int, causal: bool, dtype: torch.dtype) -> torch.Tensor:
    """Additive (lq, lk) mask for documents [i, j): 0 within a document (causal: at or below the diagonal)."""
    q0, k0 = cu_q.offsets[i], cu_k.offsets[i]
    lq = torch.tensor([cu_q.offsets[x + 1] - cu_q.offsets[x] for x in range(i, j)])
    lk = torch.tensor([cu_k.offsets[x + 1] - cu_k.offsets[x] for x in range(i, j)])
    doc_q, doc_k = (
        torch.repeat_interleave(torch.arange(j - i), lq),
        torch.repeat_interleave(torch.arange(j - i), lk),
    )
    allowed = doc_q[:, None] == doc_k[None, :]
    if causal:
        pos_q = torch.arange(int(lq.sum())) - (torch.tensor(cu_q.offsets[i:j]) - q0).repeat_interleave(lq)
        pos_k = torch.arange(int(lk.sum())) - (torch.tensor(cu_k.offsets[i:j]) - k0).repeat_interleave(lk)
        allowed &= pos_k[None, :] <= pos_q[:, None]
    zero = torch.zeros((), dtype=dtype)
    return torch.where(allowed, zero, torch.full((), float("-inf"), dtype=dtype))


def _bhsd(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(0, 1).unsqueeze(0)  # (s, h, hd) -> (1, h, s, hd), a view


def cpu_forward(q, k, v, cu_q, cu_k, causal, scale):
    out = torch.empty_like(q)
    lse = torch.empty((q.shape[1], q.shape[0]), dtype=acc_dtype(q.dtype), device=q.device)
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    for i, j in _segments(cu_q, cu_k):
        qs, qe, ks, ke = cu_q.offsets[i], cu_q.offsets[j], cu_k.offsets[i], cu_k.offsets[j]
        mask = _block_mask(cu_q, cu_k, i, j, causal, q.dtype) if j - i > 1 else None
        o, l = op(
            _bhsd(q[qs:qe]),
            _bhsd(k[ks:ke]),
            _bhsd(v[ks:ke]),
            0.0,
            causal and mask is None,
            attn_mask=mask,
            scale=scale,
        )
        out[qs:qe] = o[0].transpose(0, 1)  # (1, h, s, hd) -> (s, h, hd)
        lse[:, qs:qe] = l[0]
    return out, lse


def cpu_backward(dout, q, k, v, out, lse, cu_q, cu_k, causal, scale):
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    for i, j in _segments(cu_q, cu_k):
        qs, qe, ks, ke = cu_q.offsets[i], cu_q.offsets[j], cu_k.offsets[i], cu_k.offsets[j]
        mask = _block_mask(cu_q, cu_k, i, j, causal, q.dtype) if j - i > 1 else None
        g = op(
            _bhsd(dout[qs:qe]),
            _bhsd(q[qs:qe]),
            _bhsd(k[ks:ke]),
            _bhsd(v[ks:ke]),
            _bhsd(out[qs:qe]),
            lse[None, :, qs:qe].to(acc_dtype(q.dtype)).contiguous(),
            0.0,
            causal and mask is None,
            attn_mask=mask,
            scale=scale,
        )
        for dst, src, (a, b) in ((dq, g[0], (qs, qe)), (dk, g[1], (ks, ke)), (dv, g[2], (ks, ke))):
            dst[a:b] = src[0].transpose(0, 1)  # (1, h, s, hd) -> (s, h, hd)
    return dq, dk, dv


def _math_scores(q, k, causal, scale):
    """(lq, h, hd) x (lk, h, hd) -> scores (h, lq, lk) in the accumulation dtype, causal positions masked to -inf."""
    acc = acc_dtype(q.dtype)
    s = torch.einsum("qhd,khd->hqk", q.to(acc), k.to(acc)) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[1:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


def math_forward(q, k, v, cu_q, cu_k, causal, scale):
    g, acc = q.shape[1] // k.shape[1], acc_dtype(q.dtype)
    out = torch.empty_like(q)
    lse = torch.empty((q.shape[1], q.shape[0]), dtype=acc, device=q.device)
    for i in range(len(cu_q.offsets) - 1):
        qs, qe, ks, ke = cu_q.offsets[i], cu_q.offsets[i + 1], cu_k.offsets[i], cu_k.offsets[i + 1]
        kk, vv = (x[ks:ke].repeat_interleave(g, dim=1) for x in (k, v))  # (lk, h_kv, hd) -> (lk, h, hd)
        s = _math_scores(q[qs:qe], kk, causal, scale)
        lse[:, qs:qe] = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - lse[:, qs:qe, None])
        out[qs:qe] = torch.einsum("hqk,khd->qhd", p, vv.to(acc)).to(q.dtype)
    return out, lse


def math_backward(dout, q, k, v, out, lse, cu_q, cu_k, causal, scale):
    # Softmax backward with the saved row statistics (FlashAttention-2, arXiv 2307.08691, Alg. 2):
    # P = exp(S - lse), dV = P^T dO, dP = dO V^T, D = rowsum(dO * O), dS = P * (dP - D).
    g, acc = q.shape[1] // k.shape[1], acc_dtype(q.dtype)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    for i in range(len(cu_q.offsets) - 1):
        qs, qe, ks, ke = cu_q.offsets[i], cu_q.offsets[i + 1], cu_k.offsets[i], cu_k.offsets[i + 1]
        kk, vv = (x[ks:ke].repeat_interleave(g, dim=1).to(acc) for x in (k, v))
        qq, do, o = q[qs:qe].to(acc), dout[qs:qe].to(acc), out[qs:qe].to(acc)
        p = torch.exp(_math_scores(qq, kk, causal, scale) - lse[:, qs:qe, None].to(acc))
        dp = torch.einsum("qhd,khd->hqk", do, vv)
        ds = p * (dp - (do * o).sum(-1).T[:, :, None])
        dq[qs:qe] = (torch.einsum("hqk,khd->qhd", ds, kk) * scale).to(q.dtype)
        dkk = torch.einsum("hqk,qhd->khd", ds, qq) * scale
        dvv = torch.einsum("hqk,qhd->khd", p, do)
        # (lk, h, hd) -> (lk, h_kv, g, hd) -sum-> (lk, h_kv, hd): GQA heads share one KV head
        dk[ks:ke] = dkk.unflatten(1, (k.shape[1], g)).sum(2).to(k.dtype)
        dv[ks:ke] = dvv.unflatten(1, (k.shape[1], g)).sum(2).to(v.dtype)
    return dq, dk, dv
