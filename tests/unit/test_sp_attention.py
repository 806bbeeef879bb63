"""Sequence-parallel attention is exact: parity of Ulysses and zigzag ring attention with a float64 reference.

Real processes, real gloo: one pool of 4 spawned processes per module runs every multi-process case; groups of
degree 1, 2 and 4 (overlapping ones too) run inside one world. Tolerance: float32 results against a float64
dense reference with rtol = atol = 1e-5 (observed errors are ~1e-6). Sliding windows run in float64 end to end,
within 1e-10 of the reference, and the ring's kernel calls are counted against its plan (blocks outside every window
make none).
"""

from __future__ import annotations

import random

import pytest
import torch

from flexorch.workers.attention.api import ulysses_attn_varlen_func, varlen_attn_func, zigzag_ring_attn_varlen_func
from flexorch.workers.attention.kernels import Seqlens, attn_backward, attn_forward
from flexorch.workers.attention.sharding import contiguous_layout, shard, zigzag_layout
from tests._dist_utils import DistPool

TOL = {"rtol": 1e-5, "atol": 1e-5}
METHODS = {
    "ulysses": (ulysses_attn_varlen_func, contiguous_layout),
    "ring": (zigzag_ring_attn_varlen_func, zigzag_layout),
}


def reference(q, k, v, offsets, causal, scale, window=None):
    """Dense single-device attention over the packed batch with a block-diagonal (causal) mask; autograd.
    ``window``: Transformers' ``sliding_window``, query i sees keys i - window < j <= i of its document."""
    t, h = q.shape[:2]
    lengths = torch.tensor([b - a for a, b in zip(offsets[:-1], offsets[1:], strict=True)])
    doc = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    allowed = doc[:, None] == doc[None, :]
    if causal:
        allowed &= torch.ones(t, t, dtype=torch.bool).tril()
    if window is not None:
        pos = torch.arange(t)
        allowed &= pos[:, None] - pos[None, :] < window  # same document: global distance = in-document distance
    g = h // k.shape[1]
    s = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(g, 1)) * scale
    s = s.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(s, -1)
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v.repeat_interleave(g, 1)), lse


def make_case(seed, lengths, h, h_kv, hd=16):
    gen = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    q, k, v, dout = (torch.randn(t, n, hd, generator=gen, dtype=torch.float64) for n in (h, h_kv, h_kv, h))
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    return q, k, v, dout, offsets


def expected(q, k, v, dout, offsets, causal, window=None):
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse = reference(*leaves, offsets, causal, q.shape[2] ** -0.5, window)
    out.backward(dout)
    return out.detach(), lse, *(x.grad for x in leaves)


def random_lengths(seed, n, lo, hi):
    rng = random.Random(seed)
    return [1] + [rng.randint(lo, hi) for _ in range(n - 1)]


# Document mixes: random lengths with a length-1 document and lengths not divisible by 2d; one document
# spanning the whole batch; many tiny documents.
MIXES = {
    "random": random_lengths(1, 7, 1, 29),
    "one_doc": [77],
    "tiny": random_lengths(2, 40, 1, 3),
}
HEADS = {"mha": (4, 4), "gqa": (4, 2), "gqa1": (8, 1)}


def _check_case(ctx, reg, case):
    """Run one case on its group and assert outputs, LSE and gradients; non-members return at once."""
    ranks, method, mix, heads, causal, seed, *backend = case
    if ctx.rank not in ranks:
        return 0
    fn, layout_fn = METHODS[method]
    group = reg.group(ranks)
    q, k, v, dout, offsets = make_case(seed, MIXES[mix], *HEADS[heads])
    ref = expected(q, k, v, dout, offsets, causal)
    layout = layout_fn(offsets, ranks.index(ctx.rank), len(ranks))
    local = [shard(x.float(), layout).requires_grad_() for x in (q, k, v)]
    kw = {"causal": causal, "return_lse": True, "backend": backend[0] if backend else None}
    out, lse = fn(*local, layout.cu_seqlens, layout.max_seqlen, group, **kw)
    out.backward(shard(dout.float(), layout))
    real, idx = layout.loss_mask, layout.index[layout.loss_mask]
    msg = f"case {case}"
    torch.testing.assert_close(out[real].double(), ref[0][idx], **TOL, msg=lambda m: f"{msg} out: {m}")
    torch.testing.assert_close(lse[:, real].double(), ref[1][:, idx], **TOL, msg=lambda m: f"{msg} lse: {m}")
    for name, x, want in zip("qkv", local, ref[2:], strict=True):
        torch.testing.assert_close(x.grad[real].double(), want[idx], **TOL, msg=lambda m, n=name: f"{msg} d{n}: {m}")
        # Padding keys are seen only by padding queries, whose loss gradient is zero: no gradient may leak.
        assert torch.count_nonzero(x.grad[~real]) == 0, f"{msg}: gradient on padding in d{name}"
    return 1


def _parity_job(ctx, groups, cases):
    with ctx.registry() as reg:
        reg.ensure(groups)
        return sum(_check_case(ctx, reg, case) for case in cases)


def _cases(method, group_sets, seed0):
    cases, seed = [], seed0
    for mix in MIXES:
        for heads in HEADS:
            for i, ranks in enumerate(group_sets):
                seed += 1
                # Ring attention is causal only; Ulysses also runs some non-causal cases.
                causal = method == "ring" or i % 2 == 0 or mix == "random"
                cases.append((ranks, method, mix, heads, causal, seed))
    return cases


@pytest.fixture(scope="module")
def pool():
    p = DistPool(4)
    yield p
    p.close()


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ulysses", "ring"])
def test_parity_degree_2_and_1(pool, method):
    # {0,1} and {2,3} run different cases concurrently; {0} and {3} are degree-1 groups (same code path).
    groups = [(0, 1), (2, 3), (0,), (3,)]
    cases = _cases(method, [(0, 1), (2, 3)], 100) + _cases(method, [(0,), (3,)], 200)
    done = pool.run(_parity_job, groups, cases)
    assert sum(done) == sum(len(c[0]) for c in cases)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ulysses", "ring"])
def test_parity_degree_4(pool, method):
    cases = _cases(method, [(0, 1, 2, 3)], 300)
    assert pool.run(_parity_job, [(0, 1, 2, 3)], cases) == [len(cases)] * 4


@pytest.mark.slow
def test_overlapping_groups_attention(pool):
    # One world, overlapping groups used one after another: {0,1,2,3}, {0,1}, {2,3}, {1,3}.
    groups = [(0, 1, 2, 3), (0, 1), (2, 3), (1, 3)]
    cases = []
    for i, ranks in enumerate(groups + [(0, 1, 2, 3)]):
        for method in METHODS:
            # The last round uses the device-agnostic math kernel (the CUDA fallback) through both methods.
            backend = "math" if i == len(groups) else "torch_cpu"
            cases.append((ranks, method, "random", "gqa", True, 400 + 2 * i + (method == "ring"), backend))
    done = pool.run(_parity_job, groups, cases)
    assert done == [sum(r in c[0] for c in cases) for r in range(4)]


# ---- sliding windows, float64 end to end ----

# Documents shorter than, as long as and several times longer than a window of 16: ring chunks of 96 tokens are 12
# (degree 4) or 24 (degree 2) tokens, so blocks several chunks apart are skipped and the ones at the edge are masked.
WINDOW_MIXES = {"mixed": [1, 7, 16, 96, 37, 64], "long": [200], "tiny": [1, 2, 3, 1, 5, 2, 4]}
WINDOW_TOL = {"rtol": 1e-10, "atol": 1e-10}


def _count_calls(module, names):
    """Wrap ``module``'s kernel entry points ``names`` with call counters; returns (counts, restore)."""
    counts, saved = dict.fromkeys(names, 0), {n: getattr(module, n) for n in names}

    def wrap(name):
        def counted(*args, **kwargs):
            counts[name] += 1
            return saved[name](*args, **kwargs)

        return counted

    for n in names:
        setattr(module, n, wrap(n))
    return counts, lambda: [setattr(module, n, f) for n, f in saved.items()]


def _check_window_case(ctx, reg, case):
    """One fp64 window case: out, LSE, dq, dk, dv within 1e-10 of the reference; for the ring, the kernel calls made
    equal its plan's. Returns the ring's skipped blocks on this rank (0 for Ulysses), None on non-members."""
    from flexorch.workers.attention import ring as ring_mod
    from flexorch.workers.attention.ring_plan import ring_plan, zigzag_blocks

    ranks, method, mix, heads, window, seed, backend = case
    if ctx.rank not in ranks:
        return None
    fn, layout_fn = METHODS[method]
    q, k, v, dout, offsets = make_case(seed, WINDOW_MIXES[mix], *HEADS[heads])
    ref = expected(q, k, v, dout, offsets, True, window)
    rank, d = ranks.index(ctx.rank), len(ranks)
    layout = layout_fn(offsets, rank, d)
    local = [shard(x, layout).requires_grad_() for x in (q, k, v)]
    counts, restore = _count_calls(ring_mod, ("attn_forward", "attn_backward"))
    try:
        out, lse = fn(*local, layout.cu_seqlens, layout.max_seqlen, reg.group(ranks), return_lse=True,
                      backend=backend, window=window)  # fmt: skip
        out.backward(shard(dout, layout))
    finally:
        restore()
    real, idx = layout.loss_mask, layout.index[layout.loss_mask]
    msg = f"case {case}"
    torch.testing.assert_close(out[real], ref[0][idx], **WINDOW_TOL, msg=lambda m: f"{msg} out: {m}")
    torch.testing.assert_close(lse[:, real], ref[1][:, idx], **WINDOW_TOL, msg=lambda m: f"{msg} lse: {m}")
    for name, x, want in zip("qkv", local, ref[2:], strict=True):
        torch.testing.assert_close(x.grad[real], want[idx], **WINDOW_TOL, msg=lambda m, n=name: f"{msg} d{n}: {m}")
        assert torch.count_nonzero(x.grad[~real]) == 0, f"{msg}: gradient on padding in d{name}"
    if method != "ring":
        assert counts == {"attn_forward": 0, "attn_backward": 0}
        return 0
    plan = ring_plan(zigzag_blocks(Seqlens(tuple(layout.cu_seqlens.tolist())), d), rank, d, window)
    assert counts == {"attn_forward": plan.calls, "attn_backward": plan.calls}, f"{msg}: {counts} vs {plan.calls}"
    return plan.blocks_skipped


def _window_job(ctx, groups, cases):
    with ctx.registry() as reg:
        reg.ensure(groups)
        return [_check_window_case(ctx, reg, case) for case in cases]


def _window_cases(method, group_sets, seed0):
    cases, seed = [], seed0
    for i, (mix, window) in enumerate([("mixed", 16), ("mixed", 5), ("long", 1), ("tiny", 2), ("long", 37)]):
        for ranks in group_sets:
            seed += 1
            heads = ("gqa", "mha", "gqa1")[(i + seed) % 3]
            cases.append((ranks, method, mix, heads, window, seed, "math" if i == 3 else None))
    return cases


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ulysses", "ring"])
def test_window_parity_fp64(pool, method):
    # degree 2 on {0,1} and {2,3} at once, then degree 4; every case checks out, lse and the three gradients
    groups = [(0, 1), (2, 3), (0, 1, 2, 3)]
    cases = _window_cases(method, [(0, 1), (2, 3)], 500) + _window_cases(method, [(0, 1, 2, 3)], 600)
    skipped = pool.run(_window_job, groups, cases)
    for r in range(4):
        assert sum(s is not None for s in skipped[r]) == sum(r in c[0] for c in cases)
    if method == "ring":  # the 200-token document under windows of 1 and 37: blocks outside every window skipped
        long_cases = [i for i, c in enumerate(cases) if c[2] == "long"]
        assert all(sum(skipped[r][i] or 0 for r in range(4)) > 0 for i in long_cases)


def _bad_input_job(ctx):
    """Every bad input raises ValueError on every rank before any collective; the group stays usable."""
    with ctx.registry() as reg:
        reg.ensure([(0, 1, 2, 3)])
        g = reg.group((0, 1, 2, 3))
        q = torch.randn(8, 4, 16)
        cu = torch.tensor([0, 8, 32])
        cu_ring = torch.tensor([0, 16, 32])
        bad = [
            (
                ulysses_attn_varlen_func,
                (torch.randn(8, 6, 16), torch.randn(8, 6, 16), torch.randn(8, 6, 16), cu),
                "6 query heads are not divisible by the sequence-parallel degree 4",
            ),
            (
                ulysses_attn_varlen_func,
                (q, torch.randn(7, 4, 16), torch.randn(7, 4, 16), cu),
                "mismatched shapes",
            ),
            (zigzag_ring_attn_varlen_func, (q, q, torch.randn(8, 4, 8), cu_ring), "mismatched shapes"),
            (
                zigzag_ring_attn_varlen_func,
                (q, torch.randn(8, 3, 16), torch.randn(8, 3, 16), cu_ring),
                "not a multiple of 3 KV heads",
            ),
            (ulysses_attn_varlen_func, (q, q, q, torch.tensor([0, 20, 12, 32])), "strictly increasing"),
            (zigzag_ring_attn_varlen_func, (q, q, q, torch.tensor([0, 16, 16, 32])), "strictly increasing"),
            (ulysses_attn_varlen_func, (q, q, q, torch.tensor([0, 8, 30])), "ends at 30 but .* 32 tokens"),
            (zigzag_ring_attn_varlen_func, (q, q, q, torch.tensor([0, 16, 40])), "ends at 40"),
            (
                zigzag_ring_attn_varlen_func,
                (q, q, q, torch.tensor([0, 12, 32])),
                "12 tokens, not a multiple of",
            ),
            (ulysses_attn_varlen_func, (q[0], q[0], q[0], cu), "must be \\(tokens, heads, head_dim\\)"),
            (ulysses_attn_varlen_func, (q, q, q, torch.tensor([0.0, 8.0, 32.0])), "1-D integer tensor"),
            (
                lambda *a: zigzag_ring_attn_varlen_func(*a, causal=False),
                (q, q, q, cu_ring),
                "causal=True only",
            ),
            (lambda *a: ulysses_attn_varlen_func(*a, window=0), (q, q, q, cu), "window must be an int >= 1.*got 0"),
            (lambda *a: zigzag_ring_attn_varlen_func(*a, window=True), (q, q, q, cu_ring), "got True"),
            (lambda *a: zigzag_ring_attn_varlen_func(*a, window=2.0), (q, q, q, cu_ring), "got 2.0"),
            (
                lambda *a: ulysses_attn_varlen_func(*a, window=4, causal=False),
                (q, q, q, cu),
                "window=4 needs causal=True",
            ),
            (
                lambda *a: ulysses_attn_varlen_func(*a, window=4, backend="torch_cudnn"),
                (q, q, q, cu),
                "'torch_cudnn' cannot compute a sliding window",
            ),
        ]
        raised = 0
        for fn, args, pattern in bad:
            try:
                fn(*args, None, g)
            except ValueError as e:
                import re

                assert re.search(pattern, str(e)), f"{fn.__name__}: {e!r} does not match {pattern!r}"
                raised += 1
        try:
            varlen_attn_func(q, q, q, torch.tensor([0, 8]), max_seqlen=4)
        except ValueError as e:
            assert "max_seqlen=4 < longest document 8" in str(e)
            raised += 1
        # The group is still in step on every rank: a valid call works afterwards.
        out = ulysses_attn_varlen_func(q, q, q, cu, None, g)
        assert out.shape == q.shape and torch.isfinite(out).all()
        return raised


@pytest.mark.slow
def test_bad_input_raises_clear_errors_without_hanging(pool):
    assert pool.run(_bad_input_job, timeout_s=60) == [18] * 4


def _one_rank_bad_input_job(ctx):
    """Only rank 0 gets bad input: it raises at once; the others' all-to-all fails (rank 0 left the world, or
    the group's 5 s timeout), it does not hang."""
    import time
    from datetime import timedelta

    import torch.distributed as dist

    with ctx.registry():  # the world rendezvous keeps the pool's generous timeout (a loaded machine is slow)
        group = dist.new_group([0, 1, 2, 3], timeout=timedelta(seconds=5))
        q = torch.randn(8, 4, 16)
        k = torch.randn(7 if ctx.rank == 0 else 8, 4, 16)
        t0 = time.monotonic()
        try:
            ulysses_attn_varlen_func(q, k, k, torch.tensor([0, 32]), None, group)
        except ValueError as e:
            assert ctx.rank == 0 and "mismatched shapes" in str(e)
            return "ValueError"
        except RuntimeError:
            assert ctx.rank != 0 and time.monotonic() - t0 < 30
            return "timeout"
        raise AssertionError(f"rank {ctx.rank}: no error")


@pytest.mark.slow
def test_bad_input_on_one_rank_times_out_instead_of_hanging(pool):
    assert pool.run(_one_rank_bad_input_job, timeout_s=60) == ["ValueError", "timeout", "timeout", "timeout"]


# ---- single-process tests of the kernel interface ----


# Adds a long document between short ones: long documents get their own CPU kernel call, runs of short ones
# share one masked call.
KERNEL_MIXES = {**MIXES, "long_and_short": [3, 150, 1, 2, 40, 7, 129]}


@pytest.mark.parametrize("backend", ["torch_cpu", "math"])
@pytest.mark.parametrize("mix", list(KERNEL_MIXES))
@pytest.mark.parametrize("causal", [True, False])
def test_kernels_match_reference(backend, mix, causal):
    q, k, v, dout, offsets = make_case(7, KERNEL_MIXES[mix], 4, 2)
    ref = expected(q, k, v, dout, offsets, causal)
    leaves = [x.float().requires_grad_() for x in (q, k, v)]
    out, lse = varlen_attn_func(*leaves, torch.tensor(offsets), causal=causal, return_lse=True, backend=backend)
    out.backward(dout.float())
    for got, want in zip([out, lse, *(x.grad for x in leaves)], ref, strict=True):
        torch.testing.assert_close(got.double(), want, **TOL)


def test_kernel_backward_sums_over_key_blocks():
    # Ring attention relies on this: backward of a key block with the *full* out/lse gives that block's share.
    q, k, v, dout, _ = make_case(3, [40], 4, 2)
    q, k, v, dout = (x.float() for x in (q, k, v, dout))
    full, first, rest = Seqlens((0, 40)), Seqlens((0, 15)), Seqlens((0, 25))
    out, lse = attn_forward(q, k, v, full, full, causal=False, softmax_scale=0.25)
    g_all = attn_backward(dout, q, k, v, out, lse, full, full, causal=False, softmax_scale=0.25)
    g1 = attn_backward(dout, q, k[:15], v[:15], out, lse, full, first, causal=False, softmax_scale=0.25)
    g2 = attn_backward(dout, q, k[15:], v[15:], out, lse, full, rest, causal=False, softmax_scale=0.25)
    torch.testing.assert_close(g1[0] + g2[0], g_all[0], **TOL)
    torch.testing.assert_close(torch.cat([g1[1], g2[1]]), g_all[1], **TOL)
    torch.testing.assert_close(torch.cat([g1[2], g2[2]]), g_all[2], **TOL)


def test_unknown_backend_is_rejected():
    x = torch.randn(4, 2, 8)
    with pytest.raises(ValueError, match="unknown attention backend 'nope'"):
        varlen_attn_func(x, x, x, torch.tensor([0, 4]), backend="nope")


_FAKE_BWD_ARGS = [
    "Tensor dout", "Tensor q", "Tensor k", "Tensor v", "Tensor out", "Tensor softmax_lse", "Tensor(a!) dq",
    "Tensor(b!) dk", "Tensor(c!) dv", "Tensor cu_seqlens_q", "Tensor cu_seqlens_k", "int max_seqlen_q",
    "int max_seqlen_k", "float dropout_p", "float softmax_scale", "bool causal", "int window_size_left",
    "int window_size_right", "float softcap", "Tensor? alibi_slopes", "bool deterministic",
    "Tensor? rng_state=None",
]  # fmt: skip
_FAKE_BWD_SCHEMA = f"({', '.join(_FAKE_BWD_ARGS)}) -> Tensor"
_fake_ops = {}


def _fake_flash_attn(custom_op: bool):
    """A stand-in for flash_attn.flash_attn_interface computing with the math kernel, in both API styles:
    flash-attn 2.5/2.6 (plain function, ``window_size`` tuple) and >= 2.7 (torch custom op, split windows)."""
    import types

    from flexorch.workers.attention import torch_cpu

    def seqlens(cu):
        return Seqlens(tuple(cu.tolist()))

    def fwd(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, softmax_scale=None, causal=False, **kw):
        assert kw == {"return_attn_probs": True} and dropout_p == 0.0
        assert (max_q, max_k) == (seqlens(cu_q).max_seqlen, seqlens(cu_k).max_seqlen)
        return (*torch_cpu.math_forward(q, k, v, seqlens(cu_q), seqlens(cu_k), causal, softmax_scale), None)

    def bwd_impl(dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, max_q, max_k, dropout_p, scale, causal):
        assert (max_q, max_k, dropout_p) == (seqlens(cu_q).max_seqlen, seqlens(cu_k).max_seqlen, 0.0)
        grads = torch_cpu.math_backward(dout, q, k, v, out, lse, seqlens(cu_q), seqlens(cu_k), causal, scale)
        for dst, src in zip((dq, dk, dv), grads, strict=True):
            dst.copy_(src)
        return torch.empty(0)

    if custom_op:
        if "op" not in _fake_ops:
            _fake_ops["op"] = torch.library.custom_op(
                "flexorch_test::flash_bwd",
                _new_style_backward(bwd_impl),
                mutates_args=("dq", "dk", "dv"),
                schema=_FAKE_BWD_SCHEMA,
            )
        bwd = _fake_ops["op"]
    else:

        def bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                max_seqlen_k, dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic,
                rng_state=None):  # fmt: skip
            assert (window_size, alibi_slopes, deterministic) == ((-1, -1), None, False)
            return bwd_impl(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                            max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal)  # fmt: skip

    return types.SimpleNamespace(flash_attn_varlen_func=fwd, _flash_attn_varlen_backward=bwd)


def _new_style_backward(impl):
    """flash-attn >= 2.7's backward signature (custom_op keeps this function as ``_init_fn``)."""

    def _flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q,
                                    cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                                    causal, window_size_left, window_size_right, softcap, alibi_slopes,
                                    deterministic, rng_state=None):  # fmt: skip
        assert (window_size_left, window_size_right, softcap, alibi_slopes) == (-1, -1, 0.0, None)
        return impl(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                    max_seqlen_k, dropout_p, softmax_scale, causal)  # fmt: skip

    return _flash_attn_varlen_backward


@pytest.mark.parametrize("custom_op", [False, True])
def test_flash_attn_adapter_passes_arguments_in_order(monkeypatch, custom_op):
    # No GPU needed: the flash-attn adapter runs against a fake module, with unequal q / k documents (as in
    # ring steps) so a swapped argument changes the result or trips an assertion in the fake.
    from flexorch.workers.attention import flash, torch_cpu

    monkeypatch.setattr(flash, "flash_attn_module", lambda: _fake_flash_attn(custom_op))
    q, k, v, dout, _ = make_case(9, [24, 40], 4, 2)
    q, k, v, dout = (x.float() for x in (q, k, v, dout))
    cu_q, cu_k = Seqlens((0, 24, 64)), Seqlens((0, 10, 64))
    got = flash.flash_forward(q, k, v, cu_q, cu_k, False, 0.3)
    want = torch_cpu.cpu_forward(q, k, v, cu_q, cu_k, False, 0.3)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, **TOL)
    got = flash.flash_backward(dout, q, k, v, *want, cu_q, cu_k, False, 0.3)
    want = torch_cpu.cpu_backward(dout, q, k, v, *want, cu_q, cu_k, False, 0.3)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, **TOL)
