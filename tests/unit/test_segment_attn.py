"""Seq1F1B's segment attention with a K/V prefix cache equals full causal attention, gradients included.

The test runs a sequence the way a pipeline stage does: segments forward in order, each reading the cached K/V of the
earlier segments as detached leaves, then backwards in reverse order, each adding the prefix gradient it produced to
the earlier segments' K/V before they run their own backward (the K/V cache's gradient flows back).
"""

from __future__ import annotations

import pytest
import torch

from flexorch.solver.pipeline.segments import equal_flop_segments
from flexorch.workers.attention.api import varlen_attn_func
from flexorch.workers.attention.segment import segment_attn_func

TOL = {"rtol": 1e-5, "atol": 5e-6}  # the kernels compute in float32 (math) whatever the input dtype


def _qkv(t: int, h: int = 4, h_kv: int = 2, hd: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, h, hd, generator=g, dtype=torch.float64)
    k = torch.randn(t, h_kv, hd, generator=g, dtype=torch.float64)
    v = torch.randn(t, h_kv, hd, generator=g, dtype=torch.float64)
    return q, k, v


def _full(q, k, v, lengths, dout):
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    out = varlen_attn_func(
        q, k, v, torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()]), causal=True, backend="math"
    )
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("length,k", [(96, 4), (50, 3), (17, 1), (64, 8)])
def test_segments_with_prefix_cache_equal_full_causal_attention(length, k):
    q, kk, v = _qkv(length)
    dout = torch.randn(length, 4, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ref_out, ref_dq, ref_dk, ref_dv = _full(q, kk, v, [length], dout)

    bounds = [0]
    for n in equal_flop_segments(length, k, 1e-3, 1.0):
        bounds.append(bounds[-1] + n)
    segs = list(zip(bounds, bounds[1:], strict=False))
    # forward, segment by segment: each segment's own K/V are graph outputs; the cache holds detached leaves of them
    own, cache, outs = [], [], []
    for a, b in segs:
        qs, ks, vs = (x[a:b].clone().requires_grad_() for x in (q, kk, v))
        k_pre = [c[0] for c in cache]
        v_pre = [c[1] for c in cache]
        kp = torch.cat(k_pre) if k_pre else kk[:0]
        vp = torch.cat(v_pre) if v_pre else v[:0]
        out = segment_attn_func(qs, ks, vs, [b - a], [a], kp, vp, backend="math")
        outs.append(out)
        own.append((qs, ks, vs))
        cache.append((ks.detach().requires_grad_(), vs.detach().requires_grad_()))  # what later segments read
    torch.testing.assert_close(torch.cat([o.detach() for o in outs]), ref_out, **TOL)

    # backward in reverse: segment j's backward fills the cache leaves' .grad of segments < j
    grads = [None] * len(segs)
    for j in reversed(range(len(segs))):
        a, b = segs[j]
        qs, ks, vs = own[j]
        leaf_k, leaf_v = cache[j]
        extra_k = leaf_k.grad if leaf_k.grad is not None else torch.zeros_like(ks)
        extra_v = leaf_v.grad if leaf_v.grad is not None else torch.zeros_like(vs)
        torch.autograd.backward([outs[j], ks, vs], [dout[a:b], extra_k, extra_v])
        grads[j] = (qs.grad, ks.grad, vs.grad)
    dq = torch.cat([g[0] for g in grads])
    dk = torch.cat([g[1] for g in grads])
    dv = torch.cat([g[2] for g in grads])
    torch.testing.assert_close(dq, ref_dq, **TOL)
    torch.testing.assert_close(dk, ref_dk, **TOL)
    torch.testing.assert_close(dv, ref_dv, **TOL)


@pytest.mark.parametrize("backend", ["math", "torch_cpu"])
def test_packed_unit_of_segments_and_whole_sequences(backend):
    # a unit with three pieces: the 2nd segment of sequence A (prefix 40), a whole sequence B, the 3rd segment of C
    dtype = torch.float64 if backend == "math" else torch.float32
    lens = {"A": 70, "B": 25, "C": 90}
    pieces = [("A", 40, 70), ("B", 0, 25), ("C", 60, 90)]
    data = {name: [x.to(dtype) for x in _qkv(n, seed=i)] for i, (name, n) in enumerate(lens.items())}
    q = torch.cat([data[n][0][a:b] for n, a, b in pieces]).requires_grad_()
    k = torch.cat([data[n][1][a:b] for n, a, b in pieces]).requires_grad_()
    v = torch.cat([data[n][2][a:b] for n, a, b in pieces]).requires_grad_()
    kp = torch.cat([data[n][1][:a] for n, a, _ in pieces if a > 0]).requires_grad_()
    vp = torch.cat([data[n][2][:a] for n, a, _ in pieces if a > 0]).requires_grad_()
    out = segment_attn_func(q, k, v, [b - a for _, a, b in pieces], [a for _, a, _ in pieces], kp, vp, backend=backend)
    dout = torch.randn_like(out)
    out.backward(dout)
    tol = TOL if dtype == torch.float64 else {"rtol": 2e-4, "atol": 2e-5}
    row = 0
    pre = 0
    for name, a, b in pieces:
        fq, fk, fv = data[name]
        d_full = torch.zeros_like(fq)
        d_full[a:b] = dout[row : row + b - a]
        ref_out, ref_dq, ref_dk, ref_dv = _full(fq, fk, fv, [lens[name]], d_full)
        torch.testing.assert_close(out[row : row + b - a].detach(), ref_out[a:b], **tol)
        torch.testing.assert_close(q.grad[row : row + b - a], ref_dq[a:b], **tol)
        torch.testing.assert_close(k.grad[row : row + b - a], ref_dk[a:b], **tol)
        torch.testing.assert_close(v.grad[row : row + b - a], ref_dv[a:b], **tol)
        if a > 0:  # the prefix cache's gradient is the full attention's gradient of those earlier tokens
            torch.testing.assert_close(kp.grad[pre : pre + a], ref_dk[:a], **tol)
            torch.testing.assert_close(vp.grad[pre : pre + a], ref_dv[:a], **tol)
            pre += a
        row += b - a


def test_bad_arguments():
    q, k, v = _qkv(10)
    with pytest.raises(ValueError, match="2 pieces but 1 prefix"):
        segment_attn_func(q, k, v, [5, 5], [0], k[:0], v[:0])
    with pytest.raises(ValueError, match="prefixes hold 4 tokens"):
        segment_attn_func(q, k, v, [10], [4], k[:0], v[:0])
