"""Every attention path in every float dtype: exact to that dtype's tolerance, or refused at the call.

The matrix (issue 18): fp16, bf16, fp32, fp64 through the single-device varlen function, Ulysses and zigzag ring
attention (degree 2, real gloo between two processes) and segment attention (a K/V prefix), on each CPU backend; with a
sliding window too (single device in every dtype, Ulysses and the ring in fp32 and bf16).
References: a float64 dense attention with autograd (``test_sp_attention.reference``), which is itself checked
against torch's own ``scaled_dot_product_attention``. Low-precision results are compared with what the same inputs,
rounded to that dtype, give in float64 (so the tolerance measures the kernel, not the input rounding).

Tolerances, from the dtypes' unit roundoff u (fp64 2^-53, fp32 2^-24, bf16 2^-8, fp16 2^-11) times a few: outputs
and LSE within ``rtol = atol = TOL[dtype]``; gradients (sums over up to ~100 keys) within ``2 * TOL`` of their
largest magnitude.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flexorch.workers.attention.api import ulysses_attn_varlen_func, varlen_attn_func, zigzag_ring_attn_varlen_func
from flexorch.workers.attention.kernels import (
    DTYPES,
    acc_dtype,
    attn_forward,
    available_backends,
    default_backend,
    resolve_backend,
)
from flexorch.workers.attention.segment import segment_attn_func
from flexorch.workers.attention.sharding import contiguous_layout, shard, zigzag_layout
from tests._dist_utils import DistPool
from tests.unit.test_sp_attention import expected, make_case, reference

DTYPES_ALL = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
TOL = {torch.float64: 1e-12, torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
LENGTHS = [1, 13, 40, 7, 29]  # a length-1 document, lengths not divisible by 2d


def _name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def _case(dtype, seed=3, lengths=LENGTHS, heads=(4, 2), window=None):
    """Inputs rounded to ``dtype`` and the float64 reference on those rounded inputs (with a sliding ``window``)."""
    q, k, v, dout, offsets = make_case(seed, lengths, *heads)
    q, k, v, dout = (x.to(dtype).double() for x in (q, k, v, dout))
    return (q, k, v, dout, offsets), expected(q, k, v, dout, offsets, True, window)


def _close(got: torch.Tensor, want: torch.Tensor, dtype, what: str, grad: bool = False) -> None:
    tol = TOL[dtype]
    atol = 2 * tol * max(1.0, want.abs().max().item()) if grad else tol
    torch.testing.assert_close(
        got.double(), want, rtol=2 * tol if grad else tol, atol=atol, msg=lambda m: f"{_name(dtype)} {what}: {m}"
    )


def test_the_float64_reference_is_torch_sdpa():
    # The dense reference every test here compares with, against torch's own attention (an oracle we did not write).
    q, k, v, _dout, offsets = make_case(1, [9, 17], 4, 4)
    out, _ = reference(q, k, v, offsets, True, 16**-0.5)
    for a, b in zip(offsets[:-1], offsets[1:], strict=True):
        want = F.scaled_dot_product_attention(*(x[a:b].transpose(0, 1) for x in (q, k, v)), is_causal=True)
        torch.testing.assert_close(out[a:b], want.transpose(0, 1), rtol=1e-12, atol=1e-12)


WINDOW = 6  # shorter than three of LENGTHS' documents (40 is several windows long), as long as none


@pytest.mark.parametrize("window", [None, WINDOW], ids=["causal", "window"])
@pytest.mark.parametrize("backend", ["torch_cpu", "math"])
@pytest.mark.parametrize("dtype", DTYPES_ALL, ids=_name)
def test_single_device_every_dtype(dtype, backend, window):
    (q, k, v, dout, offsets), ref = _case(dtype, window=window)
    leaves = [x.to(dtype).requires_grad_() for x in (q, k, v)]
    cu = torch.tensor(offsets)
    out, lse = varlen_attn_func(*leaves, cu, return_lse=True, backend=backend, window=window)
    assert out.dtype == dtype and lse.dtype == acc_dtype(dtype)
    out.backward(dout.to(dtype))
    _close(out, ref[0], dtype, "out")
    _close(lse, ref[1], dtype, "lse")
    for name, x, want in zip("qkv", leaves, ref[2:], strict=True):
        assert x.grad.dtype == dtype
        _close(x.grad, want, dtype, f"d{name}", grad=True)


@pytest.mark.parametrize("dtype", DTYPES_ALL, ids=_name)
def test_segment_attention_every_dtype(dtype):
    # two pieces: [0, 30) of a 40-token sequence with a 10-token prefix, and a whole 12-token sequence
    (q, k, v, dout, offsets), _ = _case(dtype, lengths=[40, 12])
    rows = torch.cat([torch.arange(10, 40), torch.arange(40, 52)])
    dout[:10] = 0  # the prefix's own outputs belong to an earlier segment: no loss gradient from them here
    ref = expected(q, k, v, dout, offsets, True)
    leaves = [x[rows].to(dtype).requires_grad_() for x in (q, k, v)]
    prefix = [x[:10].to(dtype).requires_grad_() for x in (k, v)]
    out = segment_attn_func(*leaves, [30, 12], [10, 0], *prefix, backend="torch_cpu")
    assert out.dtype == dtype
    out.backward(dout[rows].to(dtype))
    _close(out, ref[0][rows], dtype, "out")
    _close(leaves[0].grad, ref[2][rows], dtype, "dq", grad=True)
    dk = ref[3].clone()
    _close(torch.cat([prefix[0].grad, leaves[1].grad[:30]]), dk[:40], dtype, "dk", grad=True)


def _sp_job(ctx, method, dtype_name, backend, window=None):
    dtype = getattr(torch, dtype_name)
    fn, layout_fn = (
        (ulysses_attn_varlen_func, contiguous_layout)
        if method == "ulysses"
        else (zigzag_ring_attn_varlen_func, zigzag_layout)
    )
    with ctx.registry() as reg:
        (q, k, v, dout, offsets), ref = _case(dtype, seed=7, window=window)
        layout = layout_fn(offsets, ctx.rank, ctx.world_size)
        local = [shard(x, layout).to(dtype).requires_grad_() for x in (q, k, v)]
        kw = {"return_lse": True, "backend": backend, "window": window}
        out, lse = fn(*local, layout.cu_seqlens, layout.max_seqlen, reg.world, **kw)
        assert out.dtype == dtype and lse.dtype == acc_dtype(dtype), (out.dtype, lse.dtype)
        out.backward(shard(dout, layout).to(dtype))
        real, idx = layout.loss_mask, layout.index[layout.loss_mask]
        _close(out[real], ref[0][idx], dtype, f"{method} out")
        _close(lse[:, real], ref[1][:, idx], dtype, f"{method} lse")
        for name, x, want in zip("qkv", local, ref[2:], strict=True):
            assert x.grad.dtype == dtype
            _close(x.grad[real], want[idx], dtype, f"{method} d{name}", grad=True)
        return 1


@pytest.fixture(scope="module")
def pool():
    p = DistPool(2)
    yield p
    p.close()


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch_cpu", "math"])
@pytest.mark.parametrize("dtype", DTYPES_ALL, ids=_name)
@pytest.mark.parametrize("method", ["ulysses", "ring"])
def test_sequence_parallel_every_dtype(pool, method, dtype, backend):
    # fp64 keeps fp64 end to end (the ring's merge and gradient accumulators included), low precisions accumulate
    # in float32 and stay within their own tolerance
    assert pool.run(_sp_job, method, _name(dtype), backend) == [1, 1]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_name)
@pytest.mark.parametrize("method", ["ulysses", "ring"])
def test_sequence_parallel_window_low_precision(pool, method, dtype):
    # a sliding window through both methods on the CPU kernel: the ring's masked edge blocks and skipped blocks
    # keep the dtype's tolerance (accumulation in float32)
    assert pool.run(_sp_job, method, _name(dtype), "torch_cpu", WINDOW) == [1, 1]


def test_bf16_matches_the_fp32_result_at_bf16_tolerance():
    # the bf16 check: bf16 outputs and gradients against the fp32 run of the same (bf16-rounded) inputs
    (q, k, v, dout, offsets), _ = _case(torch.bfloat16, seed=11, lengths=[64, 3, 100])
    cu = torch.tensor(offsets)
    runs = {}
    for dt in (torch.float32, torch.bfloat16):
        leaves = [x.to(dt).requires_grad_() for x in (q, k, v)]
        out = varlen_attn_func(*leaves, cu)
        out.backward(dout.to(dt))
        runs[dt] = [out, *(x.grad for x in leaves)]
    for what, a, b in zip(["out", "dq", "dk", "dv"], runs[torch.bfloat16], runs[torch.float32], strict=True):
        _close(a, b.double(), torch.bfloat16, what, grad=what != "out")


# ---- refused, with the policy in the message ----


def test_cuda_fp32_and_fp64_are_refused_with_the_dtype_policy():
    # pure: no GPU needed to choose (and refuse) a CUDA backend
    for dt in (torch.float32, torch.float64):
        with pytest.raises(ValueError, match=rf"got {_name(dt)}.*bf16.*backend='math'"):
            default_backend(torch.device("cuda"), dt)


def test_backends_refuse_dtypes_and_devices_they_cannot_run():
    q = torch.randn(8, 2, 16)
    cu = torch.tensor([0, 8])
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        varlen_attn_func(q, q, q, cu, backend="torch_flash")
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        varlen_attn_func(q, q, q, cu, backend="flash_attn")
    with pytest.raises(ValueError, match="unknown attention backend"):
        varlen_attn_func(q, q, q, cu, backend="xformers")
    qi = torch.randint(0, 5, (8, 2, 16))
    with pytest.raises(ValueError, match="cannot run torch.int64"):
        varlen_attn_func(qi, qi, qi, cu, backend="math")
    with pytest.raises(ValueError, match="cannot run torch.int64"):
        resolve_backend(None, qi)


def test_dtype_table_and_available_backends():
    assert DTYPES["torch_flash"] == DTYPES["flash_attn"] == (torch.float16, torch.bfloat16)
    cpu = torch.device("cpu")
    assert available_backends(cpu, torch.float64) == ["torch_cpu", "math"]
    assert available_backends(cpu, torch.bfloat16) == ["torch_cpu", "math"]
    # on a machine without CUDA, no CUDA backend is offered, and on CUDA fp32 only the reference
    cuda = torch.device("cuda")
    if not torch.cuda.is_available():
        assert available_backends(cuda, torch.bfloat16) == ["math"]
    assert available_backends(cuda, torch.float32) == ["math"]


# ---- the torch_flash adapter at its seam (the real kernels run in the CUDA tests / benchmarks/gpu/gpu_check.py) ----


class _FakeAten:
    """Stands in for ``torch.ops.aten``'s flash ops on CPU: checks the varlen arguments, computes with ``math``."""

    def __init__(self):
        self.calls = []

    def _flash_attention_forward(self, q, k, v, cu_q, cu_k, max_q, max_k, dropout, causal, debug, *, scale):
        self.calls.append(("fwd", cu_q.dtype, cu_k.dtype, max_q, max_k, dropout, causal, debug, scale))
        from flexorch.workers.attention.kernels import Seqlens

        out, lse = attn_forward(
            q,
            k,
            v,
            Seqlens(tuple(cu_q.tolist())),
            Seqlens(tuple(cu_k.tolist())),
            causal=causal,
            softmax_scale=scale,
            backend="math",
        )
        return out, lse, torch.zeros(2), torch.empty(0), torch.empty(0)

    def _flash_attention_backward(
        self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout, causal, rng, unused, *, scale
    ):
        self.calls.append(("bwd", cu_q.dtype, max_q, max_k, dropout, causal, scale))
        from flexorch.workers.attention.kernels import Seqlens, attn_backward

        return attn_backward(
            dout,
            q,
            k,
            v,
            out,
            lse,
            Seqlens(tuple(cu_q.tolist())),
            Seqlens(tuple(cu_k.tolist())),
            causal=causal,
            softmax_scale=scale,
            backend="math",
        )


def test_torch_flash_adapter_passes_the_varlen_arguments(monkeypatch):
    from flexorch.workers.attention import torch_flash
    from flexorch.workers.attention.kernels import Seqlens

    fake = _FakeAten()
    monkeypatch.setattr(torch_flash, "_aten", lambda: fake)
    (q, k, v, dout, offsets), ref = _case(torch.float32, lengths=[5, 31, 12])
    q, k, v, dout = (x.float() for x in (q, k, v, dout))
    cu = Seqlens(tuple(offsets))
    out, lse = torch_flash.torch_flash_forward(q, k, v, cu, cu, True, 0.25)
    dq, dk, dv = torch_flash.torch_flash_backward(dout, q, k, v, out, lse, cu, cu, True, 0.25)
    assert fake.calls[0] == ("fwd", torch.int32, torch.int32, 31, 31, 0.0, True, False, 0.25)
    assert fake.calls[1] == ("bwd", torch.int32, 31, 31, 0.0, True, 0.25)
    want_out, want_lse = reference(q.double(), k.double(), v.double(), offsets, True, 0.25)
    torch.testing.assert_close(out.double(), want_out, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(lse.double(), want_lse, rtol=2e-5, atol=2e-5)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
