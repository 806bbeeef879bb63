"""Varlen attention kernels behind one small interface: forward returns the log-sum-exp, backward takes it.

``attn_forward(q, k, v, cu_q, cu_k, ...) -> (out, lse)`` and ``attn_backward(dout, q, k, v, out, lse, ...)``
follow flash-attn's varlen convention: ``q`` is ``(t_q, h, hd)``, ``k``/``v`` are ``(t_k, h_kv, hd)`` with
``h % h_kv == 0`` (GQA: query head ``j`` reads KV head ``j // (h // h_kv)``), ``lse`` is ``(h, t_q)`` float32,
and document ``i`` of q attends only to document ``i`` of k (causal: top-left aligned, used only with equal
lengths). The backward takes ``out``/``lse`` of the *whole* attention, not of this block, so that ring
attention can sum block gradients (flash-attn backward; FlashAttention-2, arXiv 2307.08691, Alg. 2).

Backends:

* ``"flash_attn"``: flash-attn's CUDA varlen kernels (optional dependency, imported lazily).
* ``"torch_cpu"``: ``aten._scaled_dot_product_flash_attention_for_cpu`` and its ``_backward`` (both return /
  take the logsumexp) called per document; runs of short documents go into one call with a block-diagonal
  mask.
* ``"math"``: explicit float32 matmul + logsumexp per document with a hand-written backward; any device (the
  CUDA fallback when flash-attn is missing), slow but simple.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from flexorch.workers.attention.flash import flash_attn_module, flash_backward, flash_forward
from flexorch.workers.attention.sharding import check_cu_seqlens

__all__ = [
    "Seqlens",
    "attn_backward",
    "attn_forward",
    "check_qkv",
    "check_varlen_args",
    "default_backend",
    "varlen_attn",
]

BACKENDS = ("flash_attn", "torch_cpu", "math")
# Documents shorter than this are batched into one masked CPU call (fewer Python-level kernel launches).
_CPU_BUCKET_TOKENS = 128


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


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, where: str) -> None:
    """Raise ValueError unless q is (t, h, hd) and k, v are (t, h_kv, hd) with h % h_kv == 0."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"{where}: q, k, v must be (tokens, heads, head_dim), got {_shapes(q, k, v)}")
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"{where}: mismatched shapes {_shapes(q, k, v)}")
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"{where}: {q.shape[1]} query heads are not a multiple of {k.shape[1]} KV heads")
    if not (q.dtype == k.dtype == v.dtype) or not (q.device == k.device == v.device):
        raise ValueError(f"{where}: q, k, v must share dtype and device, got {q.dtype}/{k.dtype}/{v.dtype}")


def check_varlen_args(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int | None,
    degree: int,
    *,
    where: str,
) -> Seqlens:
    """Validate the arguments of a ``*_varlen_func`` whose local shard is 1/degree of the batch.

    Depends only on shapes and ``cu_seqlens``, so consistent inputs fail identically on every rank, before any
    collective runs.
    """
    check_qkv(q, k, v, where=where)
    try:
        offsets = check_cu_seqlens(cu_seqlens, q.shape[0] * degree)
    except ValueError as e:
        raise ValueError(f"{where}: {e} (local shard of {q.shape[0]} tokens x degree {degree})") from None
    seqlens = Seqlens(tuple(offsets))
    if max_seqlen is not None and max_seqlen < seqlens.max_seqlen:
        raise ValueError(f"{where}: max_seqlen={max_seqlen} < longest document {seqlens.max_seqlen}")
    return seqlens


def _shapes(*ts: torch.Tensor) -> str:
    return ", ".join(str(tuple(t.shape)) for t in ts)


def default_backend(device: torch.device) -> str:
    """flash_attn on CUDA when installed, math on CUDA otherwise, torch_cpu on CPU."""
    if device.type == "cuda":
        return "flash_attn" if flash_attn_module() is not None else "math"
    return "torch_cpu" if device.type == "cpu" else "math"


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


def _cpu_forward(q, k, v, cu_q, cu_k, causal, scale):
    out = torch.empty_like(q)
    lse = torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32, device=q.device)
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


def _cpu_backward(dout, q, k, v, out, lse, cu_q, cu_k, causal, scale):
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
            lse[None, :, qs:qe].contiguous(),
            0.0,
            causal and mask is None,
            attn_mask=mask,
            scale=scale,
        )
        for dst, src, (a, b) in ((dq, g[0], (qs, qe)), (dk, g[1], (ks, ke)), (dv, g[2], (ks, ke))):
            dst[a:b] = src[0].transpose(0, 1)  # (1, h, s, hd) -> (s, h, hd)
    return dq, dk, dv


def _math_scores(q, k, causal, scale):
    """(lq, h, hd) x (lk, h, hd) -> scores (h, lq, lk) in float32, causal positions masked to -inf."""
    s = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[1:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


def _math_forward(q, k, v, cu_q, cu_k, causal, scale):
    g = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    lse = torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32, device=q.device)
    for i in range(len(cu_q.offsets) - 1):
        qs, qe, ks, ke = cu_q.offsets[i], cu_q.offsets[i + 1], cu_k.offsets[i], cu_k.offsets[i + 1]
        kk, vv = (x[ks:ke].repeat_interleave(g, dim=1) for x in (k, v))  # (lk, h_kv, hd) -> (lk, h, hd)
        s = _math_scores(q[qs:qe], kk, causal, scale)
        lse[:, qs:qe] = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - lse[:, qs:qe, None])
        out[qs:qe] = torch.einsum("hqk,khd->qhd", p, vv.float()).to(q.dtype)
    return out, lse


def _math_backward(dout, q, k, v, out, lse, cu_q, cu_k, causal, scale):
    # Softmax backward with the saved row statistics (FlashAttention-2, arXiv 2307.08691, Alg. 2):
    # P = exp(S - lse), dV = P^T dO, dP = dO V^T, D = rowsum(dO * O), dS = P * (dP - D).
    g = q.shape[1] // k.shape[1]
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    for i in range(len(cu_q.offsets) - 1):
        qs, qe, ks, ke = cu_q.offsets[i], cu_q.offsets[i + 1], cu_k.offsets[i], cu_k.offsets[i + 1]
        kk, vv = (x[ks:ke].repeat_interleave(g, dim=1).float() for x in (k, v))
        qq, do, o = q[qs:qe].float(), dout[qs:qe].float(), out[qs:qe].float()
        p = torch.exp(_math_scores(qq, kk, causal, scale) - lse[:, qs:qe, None])
        dp = torch.einsum("qhd,khd->hqk", do, vv)
        ds = p * (dp - (do * o).sum(-1).T[:, :, None])
        dq[qs:qe] = (torch.einsum("hqk,khd->qhd", ds, kk) * scale).to(q.dtype)
        dkk = torch.einsum("hqk,qhd->khd", ds, qq) * scale
        dvv = torch.einsum("hqk,qhd->khd", p, do)
        # (lk, h, hd) -> (lk, h_kv, g, hd) -sum-> (lk, h_kv, hd): GQA heads share one KV head
        dk[ks:ke] = dkk.unflatten(1, (k.shape[1], g)).sum(2).to(k.dtype)
        dv[ks:ke] = dvv.unflatten(1, (k.shape[1], g)).sum(2).to(v.dtype)
    return dq, dk, dv


_FORWARD = {"torch_cpu": _cpu_forward, "math": _math_forward, "flash_attn": flash_forward}
_BACKWARD = {"torch_cpu": _cpu_backward, "math": _math_backward, "flash_attn": flash_backward}


def _pick(backend: str | None, q: torch.Tensor) -> str:
    name = backend or default_backend(q.device)
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {BACKENDS}")
    if name == "flash_attn" and (q.device.type != "cuda" or flash_attn_module() is None):
        raise ValueError("backend 'flash_attn' needs CUDA tensors and the flash-attn package")
    if name == "torch_cpu" and q.device.type != "cpu":
        raise ValueError(f"backend 'torch_cpu' needs CPU tensors, got {q.device}")
    return name


def attn_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: Seqlens,
    cu_k: Seqlens,
    *,
    causal: bool,
    softmax_scale: float,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(t_q, h, hd), (t_k, h_kv, hd) x2 -> out (t_q, h, hd), lse (h, t_q) float32."""
    return _FORWARD[_pick(backend, q)](q, k, v, cu_q, cu_k, causal, softmax_scale)


def attn_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_q: Seqlens,
    cu_k: Seqlens,
    *,
    causal: bool,
    softmax_scale: float,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of q, k, v for one block given the full attention's ``out`` and ``lse``."""
    return _BACKWARD[_pick(backend, q)](dout, q, k, v, out, lse, cu_q, cu_k, causal, softmax_scale)


class _VarlenAttn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, seqlens, causal, scale, backend):
        out, lse = attn_forward(q, k, v, seqlens, seqlens, causal=causal, softmax_scale=scale, backend=backend)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (seqlens, causal, scale, backend)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        seqlens, causal, scale, backend = ctx.args
        grads = attn_backward(
            dout, q, k, v, out, lse, seqlens, seqlens, causal=causal, softmax_scale=scale, backend=backend
        )
        return (*grads, None, None, None, None)


def varlen_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seqlens: Seqlens,
    *,
    causal: bool,
    softmax_scale: float,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable single-device varlen attention (same documents for q and k): returns (out, lse)."""
    return _VarlenAttn.apply(q, k, v, seqlens, causal, softmax_scale, backend)
