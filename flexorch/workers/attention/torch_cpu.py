"""The attention backends that run without CUDA kernels of their own (``flexorch.workers.attention.kernels`` chooses
among all of them):

* ``torch_cpu``: ``aten._scaled_dot_product_flash_attention_for_cpu`` and its ``_backward`` (both return / take the
  logsumexp) called per document; runs of short documents go into one call with a block-diagonal mask.
* ``math``: explicit matmul + logsumexp per document with a hand-written backward; any device, every float dtype.

Both follow the kernels' varlen convention: ``q`` ``(t_q, h, hd)``, ``k``/``v`` ``(t_k, h_kv, hd)``, ``lse``
``(h, t_q)`` in :func:`acc_dtype`; both take a sliding ``window`` and per-document ``shift`` (``kernels``' module
doc: query row ``a`` and key row ``b`` are ``a + shift - b`` positions apart; causal keeps ``>= 0``, the window
``< window``). With either, ``torch_cpu`` passes an explicit mask and cuts a long document's queries into tiles of
:data:`_WINDOW_TILE` rows, each against only the keys its window reaches (memory ``tile x (tile + window)``, not
``L x L``). A query row that sees no key gets ``out = 0``, ``lse = -inf`` and no gradient (torch's CPU kernel
returns lse 0 for such a row: it is set to -inf here).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from flexorch.workers.attention.seqlens import Seqlens

__all__ = ["acc_dtype", "cpu_backward", "cpu_forward", "math_backward", "math_forward"]

# Documents shorter than this are batched into one masked CPU call (fewer Python-level kernel launches).
_CPU_BUCKET_TOKENS = 128
# Query rows per CPU call of a long document under a window or shift.
_WINDOW_TILE = 256


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


def _visible(dist: torch.Tensor, causal: bool, window: int | None) -> torch.Tensor:
    """Which query-key pairs ``dist`` positions apart (query minus key) attend: causal ``>= 0``, window ``< window``."""
    ok = dist >= 0 if causal else torch.ones_like(dist, dtype=torch.bool)
    return ok & (dist < window) if window is not None else ok


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    zero = torch.zeros((), dtype=dtype)
    return torch.where(allowed, zero, torch.full((), float("-inf"), dtype=dtype))


def _block_mask(
    cu_q: Seqlens, cu_k: Seqlens, i: int, j: int, causal: bool, window: int | None, shift: tuple[int, ...] | None
) -> torch.Tensor:
    """(lq, lk) bool of documents [i, j): True within a document where the pair attends (causal, window, shift)."""
    q0, k0 = cu_q.offsets[i], cu_k.offsets[i]
    lq = torch.tensor([cu_q.offsets[x + 1] - cu_q.offsets[x] for x in range(i, j)])
    lk = torch.tensor([cu_k.offsets[x + 1] - cu_k.offsets[x] for x in range(i, j)])
    doc_q, doc_k = (
        torch.repeat_interleave(torch.arange(j - i), lq),
        torch.repeat_interleave(torch.arange(j - i), lk),
    )
    allowed = doc_q[:, None] == doc_k[None, :]
    if causal or window is not None:
        pos_q = torch.arange(int(lq.sum())) - (torch.tensor(cu_q.offsets[i:j]) - q0).repeat_interleave(lq)
        pos_k = torch.arange(int(lk.sum())) - (torch.tensor(cu_k.offsets[i:j]) - k0).repeat_interleave(lk)
        if shift is not None:
            pos_q = pos_q + torch.tensor(shift[i:j]).repeat_interleave(lq)
        allowed &= _visible(pos_q[:, None] - pos_k[None, :], causal, window)
    return allowed


class _Call(NamedTuple):
    """One CPU kernel call: query rows [qs, qe) against key rows [ks, ke) (empty: no key; out 0, lse -inf)."""

    qs: int
    qe: int
    ks: int
    ke: int
    mask: torch.Tensor | None
    """Additive (qe - qs, ke - ks) mask; None: ``is_causal`` below."""
    is_causal: bool
    empty: torch.Tensor | None
    """Local query rows that see no key of the call (lse set to -inf), or None."""


def _masked(qs, qe, ks, ke, allowed, dtype) -> _Call:
    empty = ~allowed.any(-1)
    return _Call(qs, qe, ks, ke, _additive(allowed, dtype), False, empty.nonzero()[:, 0] if empty.any() else None)


def _calls(cu_q: Seqlens, cu_k: Seqlens, causal: bool, window, shift, dtype) -> list[_Call]:
    """The CPU kernel calls of one varlen attention call."""
    calls = []
    for i, j in _segments(cu_q, cu_k):
        qs, qe, ks, ke = cu_q.offsets[i], cu_q.offsets[j], cu_k.offsets[i], cu_k.offsets[j]
        if window is None and shift is None:  # the plain path: one document with is_causal, or a masked run
            mask = _additive(_block_mask(cu_q, cu_k, i, j, causal, None, None), dtype) if j - i > 1 else None
            calls.append(_Call(qs, qe, ks, ke, mask, causal and mask is None, None))
        elif j - i > 1:
            calls.append(_masked(qs, qe, ks, ke, _block_mask(cu_q, cu_k, i, j, causal, window, shift), dtype))
        else:  # one document: tiles of queries, each against the keys its window reaches
            s, lk = (shift[i] if shift is not None else 0), ke - ks
            for a0 in range(0, qe - qs, _WINDOW_TILE):
                a1 = min(a0 + _WINDOW_TILE, qe - qs)
                lo = max(0, a0 + s - window + 1) if window is not None else 0
                hi = min(lk, a1 + s) if causal else lk  # causal: key b <= a + s
                if hi <= lo:
                    calls.append(_Call(qs + a0, qs + a1, ks, ks, None, False, None))
                    continue
                dist = (torch.arange(a0, a1) + s)[:, None] - torch.arange(lo, hi)[None, :]
                calls.append(_masked(qs + a0, qs + a1, ks + lo, ks + hi, _visible(dist, causal, window), dtype))
    return calls


def _bhsd(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(0, 1).unsqueeze(0)  # (s, h, hd) -> (1, h, s, hd), a view


def cpu_forward(q, k, v, cu_q, cu_k, causal, scale, window=None, shift=None):
    out = torch.empty_like(q)
    lse = torch.empty((q.shape[1], q.shape[0]), dtype=acc_dtype(q.dtype), device=q.device)
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    for c in _calls(cu_q, cu_k, causal, window, shift, q.dtype):
        if c.ke == c.ks:  # no key in reach
            out[c.qs : c.qe] = 0
            lse[:, c.qs : c.qe] = float("-inf")
            continue
        o, l = op(
            _bhsd(q[c.qs : c.qe]),
            _bhsd(k[c.ks : c.ke]),
            _bhsd(v[c.ks : c.ke]),
            0.0,
            c.is_causal,
            attn_mask=c.mask,
            scale=scale,
        )
        out[c.qs : c.qe] = o[0].transpose(0, 1)  # (1, h, s, hd) -> (s, h, hd)
        lse[:, c.qs : c.qe] = l[0]
        if c.empty is not None:
            lse[:, c.qs + c.empty] = float("-inf")  # the kernel says 0 for a row without keys
    return out, lse


def cpu_backward(dout, q, k, v, out, lse, cu_q, cu_k, causal, scale, window=None, shift=None):
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    plain = window is None and shift is None
    dq = torch.empty_like(q) if plain else torch.zeros_like(q)
    if plain:  # the runs cover every key once
        dk, dv = torch.empty_like(k), torch.empty_like(v)
    else:  # tiles of a document share keys: sum in the accumulation dtype
        dk, dv = (torch.zeros(x.shape, dtype=acc_dtype(x.dtype), device=x.device) for x in (k, v))
    lse = _finite(lse.to(acc_dtype(q.dtype)))
    for c in _calls(cu_q, cu_k, causal, window, shift, q.dtype):
        if c.ke == c.ks:
            continue
        g = op(
            _bhsd(dout[c.qs : c.qe]),
            _bhsd(q[c.qs : c.qe]),
            _bhsd(k[c.ks : c.ke]),
            _bhsd(v[c.ks : c.ke]),
            _bhsd(out[c.qs : c.qe]),
            lse[None, :, c.qs : c.qe].contiguous(),
            0.0,
            c.is_causal,
            attn_mask=c.mask,
            scale=scale,
        )
        dq[c.qs : c.qe] = g[0][0].transpose(0, 1)  # (1, h, s, hd) -> (s, h, hd)
        if plain:
            dk[c.ks : c.ke] = g[1][0].transpose(0, 1)
            dv[c.ks : c.ke] = g[2][0].transpose(0, 1)
        else:
            dk[c.ks : c.ke] += g[1][0].transpose(0, 1)
            dv[c.ks : c.ke] += g[2][0].transpose(0, 1)
    return dq, dk.to(k.dtype), dv.to(v.dtype)


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with -inf (a row that saw no key) as 0: its probabilities exp(-inf - 0) are 0, never NaN."""
    return lse.masked_fill(lse == float("-inf"), 0.0)


def _math_scores(q, k, causal, scale, window=None, shift=0):
    """(lq, h, hd) x (lk, h, hd) -> scores (h, lq, lk) in the accumulation dtype; pairs that do not attend (causal,
    window, ``shift``: the query block's first position minus the key block's) masked to -inf."""
    acc = acc_dtype(q.dtype)
    s = torch.einsum("qhd,khd->hqk", q.to(acc), k.to(acc)) * scale
    if causal or window is not None:
        lq, lk = s.shape[1:]
        dist = (torch.arange(lq, device=s.device) + shift)[:, None] - torch.arange(lk, device=s.device)[None, :]
        s = s.masked_fill(~_visible(dist, causal, window), float("-inf"))
    return s


def math_forward(q, k, v, cu_q, cu_k, causal, scale, window=None, shift=None):
    g, acc = q.shape[1] // k.shape[1], acc_dtype(q.dtype)
    out = torch.empty_like(q)
    lse = torch.empty((q.shape[1], q.shape[0]), dtype=acc, device=q.device)
    for i in range(len(cu_q.offsets) - 1):
        qs, qe, ks, ke = cu_q.offsets[i], cu_q.offsets[i + 1], cu_k.offsets[i], cu_k.offsets[i + 1]
        kk, vv = (x[ks:ke].repeat_interleave(g, dim=1) for x in (k, v))  # (lk, h_kv, hd) -> (lk, h, hd)
        s = _math_scores(q[qs:qe], kk, causal, scale, window, shift[i] if shift is not None else 0)
        lse[:, qs:qe] = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - _finite(lse[:, qs:qe])[..., None])
        out[qs:qe] = torch.einsum("hqk,khd->qhd", p, vv.to(acc)).to(q.dtype)
    return out, lse


def math_backward(dout, q, k, v, out, lse, cu_q, cu_k, causal, scale, window=None, shift=None):
    # Softmax backward with the saved row statistics (FlashAttention-2, arXiv 2307.08691, Alg. 2):
    # P = exp(S - lse), dV = P^T dO, dP = dO V^T, D = rowsum(dO * O), dS = P * (dP - D).
    g, acc = q.shape[1] // k.shape[1], acc_dtype(q.dtype)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    lse = _finite(lse.to(acc))
    for i in range(len(cu_q.offsets) - 1):
        qs, qe, ks, ke = cu_q.offsets[i], cu_q.offsets[i + 1], cu_k.offsets[i], cu_k.offsets[i + 1]
        kk, vv = (x[ks:ke].repeat_interleave(g, dim=1).to(acc) for x in (k, v))
        qq, do, o = q[qs:qe].to(acc), dout[qs:qe].to(acc), out[qs:qe].to(acc)
        s = _math_scores(qq, kk, causal, scale, window, shift[i] if shift is not None else 0)
        p = torch.exp(s - lse[:, qs:qe, None])
        dp = torch.einsum("qhd,khd->hqk", do, vv)
        ds = p * (dp - (do * o).sum(-1).T[:, :, None])
        dq[qs:qe] = (torch.einsum("hqk,khd->qhd", ds, kk) * scale).to(q.dtype)
        dkk = torch.einsum("hqk,qhd->khd", ds, qq) * scale
        dvv = torch.einsum("hqk,qhd->khd", p, do)
        # (lk, h, hd) -> (lk, h_kv, g, hd) -sum-> (lk, h_kv, hd): GQA heads share one KV head
        dk[ks:ke] = dkk.unflatten(1, (k.shape[1], g)).sum(2).to(k.dtype)
        dv[ks:ke] = dvv.unflatten(1, (k.shape[1], g)).sum(2).to(v.dtype)
    return dq, dk, dv
