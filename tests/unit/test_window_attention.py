"""Sliding-window attention (Transformers' ``sliding_window``: query i sees keys i - w < j <= i of its document): the
semantics against Transformers' own mask, the kernels with window and position offsets, the zigzag ring's plan (every
in-window pair computed exactly once, blocks outside every window skipped), segment attention with a window, the
refusals and the backend choice. Single process; the multi-process fp64 parity of Ulysses, the ring and hybrid with a
window runs on the pools of ``test_sp_attention``, ``test_hybrid_attention`` and ``test_attention_dtypes``.
"""

from __future__ import annotations

import collections
import types

import pytest
import torch
import torch.nn.functional as F

from flexorch.workers.attention import choice, flash, kernels, torch_cpu, torch_flash
from flexorch.workers.attention.api import varlen_attn_func
from flexorch.workers.attention.kernels import Seqlens, attn_backward, attn_forward
from flexorch.workers.attention.ring_plan import ring_plan, zigzag_blocks
from flexorch.workers.attention.segment import segment_attn_func
from flexorch.workers.attention.sharding import zigzag_layout
from tests.unit.test_sp_attention import expected, make_case, reference

TOL = {"rtol": 1e-10, "atol": 1e-10}


def _offsets(lengths):
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def test_window_is_transformers_sliding_window():
    # the oracle: Transformers' own mask function (masking_utils), per document, through torch's SDPA
    masking_utils = pytest.importorskip("transformers.masking_utils")
    lengths = [1, 9, 30]
    q, k, v, _, offsets = make_case(4, lengths, 4, 4)
    for w in (1, 4, 9, 50):
        mask_fn = masking_utils.sliding_window_causal_mask_function(w)
        out = varlen_attn_func(q, k, v, torch.tensor(offsets), window=w)
        ref, _ = reference(q, k, v, offsets, True, 16**-0.5, w)
        for a, b in zip(offsets[:-1], offsets[1:], strict=True):
            idx = torch.arange(b - a)
            allowed = mask_fn(0, 0, idx[:, None], idx[None, :])  # (L, L) bool: kv_idx <= q_idx, > q_idx - w
            want = F.scaled_dot_product_attention(*(x[a:b].transpose(0, 1) for x in (q, k, v)), attn_mask=allowed)
            torch.testing.assert_close(out[a:b], want.transpose(0, 1), **TOL)
            torch.testing.assert_close(ref[a:b], want.transpose(0, 1), **TOL)


@pytest.mark.parametrize("backend", ["torch_cpu", "math"])
def test_varlen_window_matches_the_reference(backend):
    # documents shorter than, equal to and many times a window; a 600-token one runs in query tiles on torch_cpu
    lengths = [3, 600, 1, 40, 7, 129]
    q, k, v, dout, offsets = make_case(5, lengths, 4, 2)
    for w in (1, 7, 40, 300):
        ref = expected(q, k, v, dout, offsets, True, w)
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out, lse = varlen_attn_func(*leaves, torch.tensor(offsets), return_lse=True, backend=backend, window=w)
        out.backward(dout)
        for what, got, want in zip(
            ["out", "lse", "dq", "dk", "dv"], [out, lse, *(x.grad for x in leaves)], ref, strict=True
        ):
            torch.testing.assert_close(got, want, **TOL, msg=lambda m, w=w, what=what: f"window {w} {what}: {m}")


def _block_reference(q, k, v, lq, lk, shift, window, scale):
    """Per document: dense scores masked by distance = a + shift - b in [0, window); autograd."""
    g, outs, lses = q.shape[1] // k.shape[1], [], []
    qo, ko = _offsets(lq), _offsets(lk)
    for i in range(len(lq)):
        kk, vv = (x[ko[i] : ko[i + 1]].repeat_interleave(g, 1) for x in (k, v))
        dist = (torch.arange(lq[i]) + shift[i])[:, None] - torch.arange(lk[i])[None, :]
        s = torch.einsum("qhd,khd->hqk", q[qo[i] : qo[i + 1]], kk) * scale
        s = s.masked_fill(~((dist >= 0) & (dist < window)), float("-inf"))
        lse = torch.logsumexp(s, -1)
        p = torch.exp(s - lse.masked_fill(lse == float("-inf"), 0)[..., None])
        outs.append(torch.einsum("hqk,khd->qhd", p, vv))
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses, 1)


@pytest.mark.parametrize("backend", ["torch_cpu", "math"])
def test_kernels_take_position_offsets_and_rows_without_keys(backend):
    # blocks whose queries start `shift` positions after their keys (the ring's edge blocks, a segment's prefix);
    # some rows see no key: out 0, lse -inf, zero gradient, nothing NaN
    cases = [([5, 300, 3], [7, 290, 3], (3, 10, 0), 12), ([600], [600], (500,), 200), ([40, 2], [30, 5], (35, 1), 3)]
    for lq, lk, shift, w in cases:
        gen = torch.Generator().manual_seed(len(lq))
        q = torch.randn(sum(lq), 4, 8, generator=gen, dtype=torch.float64)
        k, v = (torch.randn(sum(lk), 2, 8, generator=gen, dtype=torch.float64) for _ in range(2))
        dout = torch.randn_like(q)
        cu_q, cu_k = Seqlens(tuple(_offsets(lq))), Seqlens(tuple(_offsets(lk)))
        kw = {"causal": True, "softmax_scale": 0.3, "backend": backend, "window": w, "shift": shift}
        out, lse = attn_forward(q, k, v, cu_q, cu_k, **kw)
        grads = attn_backward(dout, q, k, v, out, lse, cu_q, cu_k, **kw)
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        want_out, want_lse = _block_reference(*leaves, lq, lk, shift, w, 0.3)
        want_out.backward(dout)
        empty = want_lse == float("-inf")
        assert empty.any() and torch.equal(lse == float("-inf"), empty)
        torch.testing.assert_close(out, want_out.detach(), **TOL)
        torch.testing.assert_close(lse[~empty], want_lse[~empty], **TOL)
        for got, leaf in zip(grads, leaves, strict=True):
            assert torch.isfinite(got).all()
            torch.testing.assert_close(got, leaf.grad, **TOL)


# ---- the zigzag ring's plan: pure, every rank in one process ----


def _doc_ids(layout) -> torch.Tensor:
    cu = layout.local_cu_seqlens
    return torch.repeat_interleave(torch.arange(cu.numel() - 1), cu[1:] - cu[:-1])


def _plan_pairs(offsets, d, window):
    """(document, query position, key position) of every pair the plans of all ranks compute; each call's own mask
    (from its rows, shift and window) is checked against the true positions on the way."""
    layouts = [zigzag_layout(offsets, r, d) for r in range(d)]
    padded = Seqlens(tuple(layouts[0].cu_seqlens.tolist()))
    pairs, skipped, run = collections.Counter(), 0, 0
    for r in range(d):
        plan = ring_plan(zigzag_blocks(padded, d), r, d, window)
        skipped, run = skipped + plan.blocks_skipped, run + plan.blocks_run
        for step, calls in enumerate(plan.steps):
            src = (r - step) % d
            mine, theirs = layouts[r], layouts[src]
            rows_all, keys_all = torch.arange(mine.index.numel()), torch.arange(theirs.index.numel())
            for call in calls:
                rows, keys = rows_all[call.q_rows], keys_all[call.k_rows]
                for i in range(len(call.cu_q.offsets) - 1):
                    qr = rows[call.cu_q.offsets[i] : call.cu_q.offsets[i + 1]]
                    kr = keys[call.cu_k.offsets[i] : call.cu_k.offsets[i + 1]]
                    doc = _doc_ids(mine)[qr].unique()
                    assert doc.numel() == 1 and torch.equal(_doc_ids(theirs)[kr].unique(), doc)
                    shift = call.shift[i] if call.shift is not None else 0
                    local = (torch.arange(qr.numel()) + shift)[:, None] - torch.arange(kr.numel())[None, :]
                    computed = torch_cpu._visible(local, call.causal, call.window)
                    true = mine.position_ids[qr][:, None] - theirs.position_ids[kr][None, :]
                    wanted = (true >= 0) & (true < (window or 10**9))
                    assert torch.equal(computed, wanted), f"rank {r} step {step}: the call masks wrong pairs"
                    for a, b in computed.nonzero().tolist():
                        pairs[(int(doc), int(mine.position_ids[qr[a]]), int(theirs.position_ids[kr[b]]))] += 1
    return pairs, padded, run, skipped


@pytest.mark.parametrize("d", [1, 2, 3, 4])
@pytest.mark.parametrize("window", [1, 3, 5, 11, 30, None])
def test_ring_plan_computes_every_pair_in_the_window_once(d, window):
    offsets = _offsets([1, 20, 96])
    pairs, padded, run, skipped = _plan_pairs(offsets, d, window)
    assert max(pairs.values()) == 1  # no pair twice: the merge would count it twice
    want = set()
    for doc, (a, b) in enumerate(zip(padded.offsets[:-1], padded.offsets[1:], strict=True)):
        want |= {(doc, i, j) for i in range(b - a) for j in range(b - a) if 0 <= i - j < (window or 10**9)}
    assert set(pairs) == want
    assert run + skipped == 3 * d * (2 * d + 1)  # every causally visible (query chunk, key chunk, document) block


def test_ring_plan_skips_blocks_outside_the_window():
    # one document of 96 tokens on a ring of 4: chunks of 12, window 5 reaches one chunk back. Of its 36 causal
    # chunk blocks the 8 diagonal and 7 adjacent ones run, 21 are skipped: no kernel call
    padded, d = Seqlens((0, 96)), 4
    plans = [ring_plan(zigzag_blocks(padded, d), r, d, 5) for r in range(d)]
    assert sum(p.blocks_run for p in plans) == 15 and sum(p.blocks_skipped for p in plans) == 21
    causal = [ring_plan(zigzag_blocks(padded, d), r, d, None) for r in range(d)]
    assert sum(p.blocks_run for p in causal) == 36 and sum(p.blocks_skipped for p in causal) == 0
    # a window of 1: only the diagonal, one kernel call per rank; the later ring steps compute nothing
    for r in range(d):
        plan = ring_plan(zigzag_blocks(padded, d), r, d, 1)
        assert plan.calls == 1 and all(not s for s in plan.steps[1:])
    # the module doc's example: 128k tokens, a ring of 8, a 4k window: 31 of 136 blocks run
    long = [ring_plan(zigzag_blocks(Seqlens((0, 131072)), 8), r, 8, 4096) for r in range(8)]
    assert sum(p.blocks_run for p in long) == 31 and sum(p.blocks_skipped for p in long) == 136 - 31


# ---- segment attention (pipeline pieces with a K/V prefix) ----


@pytest.mark.parametrize("backend", ["math", "torch_cpu"])
@pytest.mark.parametrize("window", [1, 3, 10, 45, 200])
def test_segment_attention_with_a_window(backend, window):
    # three pieces: tokens [40, 70) of A (prefix 40), the whole B, tokens [60, 90) of C (prefix 60)
    lens = {"A": 70, "B": 25, "C": 90}
    pieces = [("A", 40, 70), ("B", 0, 25), ("C", 60, 90)]
    data = {name: make_case(i, [n], 4, 2)[:3] for i, (name, n) in enumerate(lens.items())}
    q, k, v = (torch.cat([data[n][j][a:b] for n, a, b in pieces]).requires_grad_() for j in range(3))
    kp, vp = (torch.cat([data[n][j][:a] for n, a, _ in pieces if a > 0]).requires_grad_() for j in (1, 2))
    out = segment_attn_func(q, k, v, [b - a for _, a, b in pieces], [a for _, a, _ in pieces], kp, vp,
                            backend=backend, window=window)  # fmt: skip
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(9), dtype=out.dtype)
    out.backward(dout)
    row = pre = 0
    for name, a, b in pieces:
        d_full = torch.zeros_like(data[name][0])
        d_full[a:b] = dout[row : row + b - a]
        ref_out, _, ref_dq, ref_dk, ref_dv = expected(*data[name], d_full, [0, lens[name]], True, window)
        got = [out[row : row + b - a], q.grad[row : row + b - a], k.grad[row : row + b - a], v.grad[row : row + b - a]]
        for x, want in zip(got, [ref_out[a:b], ref_dq[a:b], ref_dk[a:b], ref_dv[a:b]], strict=True):
            torch.testing.assert_close(x.detach(), want, **TOL)
        if a > 0:  # the prefix cache's gradient: the keys in reach of this piece's windows, zero before them
            torch.testing.assert_close(kp.grad[pre : pre + a], ref_dk[:a], **TOL)
            torch.testing.assert_close(vp.grad[pre : pre + a], ref_dv[:a], **TOL)
            pre += a
        row += b - a


# ---- refusals ----


@pytest.mark.parametrize("bad", [0, -3, True, 2.5, "4"])
def test_bad_window_values_are_refused_with_the_value(bad):
    x = torch.randn(8, 2, 16)
    with pytest.raises(ValueError, match=rf"window must be an int >= 1 .* got {bad!r}"):
        varlen_attn_func(x, x, x, torch.tensor([0, 8]), window=bad)
    with pytest.raises(ValueError, match=rf"segment_attn_func: window must be an int >= 1 .* got {bad!r}"):
        segment_attn_func(x, x, x, [8], [0], x[:0], x[:0], window=bad)


def test_a_window_needs_causal_attention():
    x = torch.randn(8, 2, 16)
    with pytest.raises(ValueError, match="varlen_attn_func: window=3 needs causal=True"):
        varlen_attn_func(x, x, x, torch.tensor([0, 8]), causal=False, window=3)


def test_a_backend_without_a_window_says_so():
    x = torch.randn(8, 2, 16)
    with pytest.raises(ValueError, match=r"'torch_cudnn' cannot compute a sliding window \(window=4\).*cuDNN"):
        varlen_attn_func(x, x, x, torch.tensor([0, 8]), backend="torch_cudnn", window=4)
    assert "torch_cudnn" not in kernels.WINDOW_BACKENDS
    # a measured default that cannot compute a window is passed over for one that can
    cuda = torch.device("cuda")
    kernels.set_default_backend(cuda, torch.bfloat16, "torch_cudnn")
    try:
        assert kernels.default_backend(cuda, torch.bfloat16) == "torch_cudnn"
        if kernels.flash_attn_module() is not None or torch_flash.torch_flash_available():
            assert kernels.default_backend(cuda, torch.bfloat16, window=True) in kernels.WINDOW_BACKENDS
        else:
            with pytest.raises(ValueError, match="no fused CUDA attention here"):
                kernels.default_backend(cuda, torch.bfloat16, window=True)
    finally:
        kernels.set_default_backend(cuda, torch.bfloat16, None)


def test_the_choice_considers_only_kernels_with_a_window():
    from flexorch.config.model import ModelConfig

    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match=r"attention = 'torch_cudnn' cannot compute the model's sliding window"):
        choice.set_attention(ModelConfig(attention="torch_cudnn", attention_window=8), cpu, "fp32")
    try:
        assert "torch_cpu" in choice.set_attention(ModelConfig(attention="torch_cpu", attention_window=8), cpu, "fp32")
        c = choice.choose_backend(cpu, torch.float64, 4, 2, 8, candidates=("torch_cudnn", "torch_cpu", "math"),
                                  probe=(40,), check=(40, 7, 1), reps=1, window=5)  # fmt: skip
        assert set(c.ms) == {"torch_cpu", "math"} and "torch_cudnn" not in c.refused and max(c.errors.values()) < 1e-10
    finally:
        kernels.set_default_backend(cpu, torch.float32, None)
        kernels.set_default_backend(cpu, torch.float64, None)


# ---- the flash adapters' window arguments (CPU fakes computing with math) ----


def _seqlens(cu: torch.Tensor) -> Seqlens:
    return Seqlens(tuple(cu.tolist()))


def _fa2_window(causal: bool, left: int, right: int) -> int | None:
    """The sliding window of FlashAttention-2's (left, right) on equal-length blocks: (w - 1, 0) is causal, w keys."""
    assert right in (0, -1) and (right == 0 or causal or left == -1)
    return left + 1 if left >= 0 else None


def test_flash_attn_adapter_passes_the_window_and_blocks_it_cannot_align_run_elsewhere(monkeypatch):
    calls = []

    def fwd(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, softmax_scale=None, causal=False, **kw):
        calls.append(("fwd", causal, kw.get("window_size")))
        w = _fa2_window(causal, *kw.get("window_size", (-1, -1)))
        out, lse = torch_cpu.math_forward(q, k, v, _seqlens(cu_q), _seqlens(cu_k), causal, softmax_scale, w)
        return out, lse, None

    def bwd(dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, max_q, max_k, p, scale, causal, window_size_left,
            window_size_right, softcap, alibi_slopes, deterministic, rng_state=None):  # fmt: skip
        calls.append(("bwd", causal, (window_size_left, window_size_right)))
        w = _fa2_window(causal, window_size_left, window_size_right)
        grads = torch_cpu.math_backward(dout, q, k, v, out, lse, _seqlens(cu_q), _seqlens(cu_k), causal, scale, w)
        for dst, src in zip((dq, dk, dv), grads, strict=True):
            dst.copy_(src)

    fake = types.SimpleNamespace(flash_attn_varlen_func=fwd, _flash_attn_varlen_backward=bwd)
    monkeypatch.setattr(flash, "flash_attn_module", lambda: fake)
    monkeypatch.setattr(kernels, "flash_attn_module", lambda: fake)
    monkeypatch.setitem(kernels._DEVICE, "flash_attn", "cpu")  # the fake runs on CPU tensors, in float32
    monkeypatch.setitem(kernels.DTYPES, "flash_attn", (torch.float32,))
    q, k, v, dout, offsets = make_case(2, [30, 9], 4, 2)
    q, k, v, dout = (x.float() for x in (q, k, v, dout))
    cu = Seqlens(tuple(offsets))
    for backend in ("flash_attn", "math"):
        kw = {"causal": True, "softmax_scale": 0.25, "backend": backend, "window": 6}
        out, lse = attn_forward(q, k, v, cu, cu, **kw)
        grads = attn_backward(dout, q, k, v, out, lse, cu, cu, **kw)
        if backend == "flash_attn":
            got = (out, lse, *grads)
    assert calls == [("fwd", True, (5, 0)), ("bwd", True, (5, 0))]  # Transformers' window of 6 = flash's (5, 0)
    for a, b in zip(got, (out, lse, *grads), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # a block whose queries start elsewhere than flash-attn aligns them (the ring's window edge) runs on math
    calls.clear()
    kw = {"causal": True, "softmax_scale": 0.25, "backend": "flash_attn", "window": 6, "shift": (3, 8)}
    attn_forward(q, k, v, cu, cu, **kw)
    assert calls == []


class _FakeAten:
    """``torch.ops.aten``'s flash ops on CPU, reading the window as FlashAttention-2 does."""

    def __init__(self):
        self.calls = []

    def _flash_attention_forward(self, q, k, v, cu_q, cu_k, mq, mk, p, causal, debug, *, scale, **window):
        self.calls.append(("fwd", causal, window))
        w = _fa2_window(causal, window.get("window_size_left", -1), window.get("window_size_right", -1))
        out, lse = torch_cpu.math_forward(q, k, v, _seqlens(cu_q), _seqlens(cu_k), causal or w is not None, scale, w)
        return out, lse, None, None, None

    def _flash_attention_backward(self, dout, q, k, v, out, lse, cu_q, cu_k, mq, mk, p, causal, rng, u, *, scale, **w):
        self.calls.append(("bwd", causal, w))
        win = _fa2_window(causal, w.get("window_size_left", -1), w.get("window_size_right", -1))
        return torch_cpu.math_backward(dout, q, k, v, out, lse, _seqlens(cu_q), _seqlens(cu_k),
                                       causal or win is not None, scale, win)  # fmt: skip


def test_torch_flash_adapter_passes_the_window(monkeypatch):
    fake = _FakeAten()
    monkeypatch.setattr(torch_flash, "_aten", lambda: fake)
    q, k, v, dout, offsets = make_case(3, [5, 31, 12], 4, 2)
    q, k, v, dout = (x.float() for x in (q, k, v, dout))
    cu = Seqlens(tuple(offsets))
    out, lse = torch_flash.torch_flash_forward(q, k, v, cu, cu, True, 0.25, window=4)
    grads = torch_flash.torch_flash_backward(dout, q, k, v, out, lse, cu, cu, True, 0.25, window=4)
    window = {"window_size_left": 3, "window_size_right": 0}
    assert fake.calls == [("fwd", False, window), ("bwd", False, window)]  # as torch's varlen_attn passes (3, 0)
    want = expected(*(x.double() for x in (q, k, v, dout)), offsets, True, 4)
    for a, b in zip((out, lse, *grads), want, strict=True):
        torch.testing.assert_close(a.double(), b, rtol=2e-5, atol=2e-5)


def test_an_idle_rank_ignores_the_window():
    from flexorch.workers.step_exec import _idle_attn

    q = torch.zeros(0, 4, 8)
    assert _idle_attn(q, q[:, :2], q[:, :2], window=4, softmax_scale=0.1) is q


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["flash_attn", "torch_flash"])
def test_cuda_window_kernels_match_math_bf16(backend):
    # where a GPU is lent: the fused kernels' window ((w - 1, 0), bottom-right) against the math reference on the
    # same device, at windows shorter and longer than the documents, as the worker's choice checks it
    if backend == "flash_attn":
        pytest.importorskip("flash_attn")
    cuda = torch.device("cuda")
    for window in (1, 16, 200):
        err = choice.kernel_error(backend, 8, 2, 64, cuda, torch.bfloat16, lengths=(300, 17, 1), window=window)
        assert err <= choice.TOLERANCE[torch.bfloat16], f"{backend} window {window}: error {err:.1e}"
