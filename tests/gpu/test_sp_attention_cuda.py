"""The attention kernels and SP attention on CUDA in bf16, against the float64 reference of ``test_sp_attention.py``;
NCCL parity at degree 1 on one GPU and degree 2 on two. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from flexorch.workers.attention.api import varlen_attn_func
from flexorch.workers.attention.sharding import shard
from tests._dist_utils import DistPool
from tests.unit.test_sp_attention import METHODS, MIXES, expected, make_case

# bf16 against a float64 reference: outputs and LSE within 1e-2; gradients (sums over many keys) within 2e-2
# relative to their largest magnitude.
BF16_TOL = {"rtol": 1e-2, "atol": 1e-2}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["flash_attn", "torch_cudnn", "torch_flash", "math"])
def test_cuda_kernels_bf16(backend):
    if backend == "flash_attn":
        pytest.importorskip("flash_attn")
    q, k, v, dout, offsets = make_case(11, MIXES["random"] + [300], 8, 2, hd=64)
    ref = expected(q, k, v, dout, offsets, True)
    leaves = [x.to("cuda", torch.bfloat16).requires_grad_() for x in (q, k, v)]
    cu = torch.tensor(offsets, device="cuda", dtype=torch.int32)
    out, lse = varlen_attn_func(*leaves, cu, causal=True, return_lse=True, backend=backend)
    out.backward(dout.to("cuda", torch.bfloat16))
    for got, want in zip([out, lse, *(x.grad for x in leaves)], ref, strict=True):
        torch.testing.assert_close(got.double().cpu(), want, rtol=2e-2, atol=2e-2 * max(1.0, want.abs().max().item()))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_cudnn_long_documents_bf16():
    """torch_cudnn's own path: documents of at least ``MIN_TOKENS`` on cuDNN (5000 padded to 5120, 4096 as is),
    the short ones on torch's flash kernels in one call; out, lse and gradients against float64 math."""
    from flexorch.workers.attention.torch_cudnn import MIN_TOKENS

    lengths = [5000, 300, MIN_TOKENS, 1, 77]
    offsets = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    gen = torch.Generator().manual_seed(3)
    q, dout = (torch.randn(offsets[-1], 4, 64, dtype=torch.float64, generator=gen) for _ in range(2))
    k, v = (torch.randn(offsets[-1], 2, 64, dtype=torch.float64, generator=gen) for _ in range(2))
    ref = expected(q, k, v, dout, offsets, True)
    leaves = [x.to("cuda", torch.bfloat16).requires_grad_() for x in (q, k, v)]
    cu = torch.tensor(offsets, device="cuda", dtype=torch.int32)
    out, lse = varlen_attn_func(*leaves, cu, causal=True, return_lse=True, backend="torch_cudnn")
    out.backward(dout.to("cuda", torch.bfloat16))
    for got, want in zip([out, lse, *(x.grad for x in leaves)], ref, strict=True):
        torch.testing.assert_close(got.double().cpu(), want, rtol=2e-2, atol=2e-2 * max(1.0, want.abs().max().item()))


def _nccl_job(ctx, method):
    from flexorch.workers.process_groups import ProcessGroupRegistry

    torch.cuda.set_device(ctx.rank)
    with ProcessGroupRegistry(
        store=ctx.store, rank=ctx.rank, world_size=ctx.world_size, epoch=ctx.job, backend="cpu:gloo,cuda:nccl"
    ) as reg:
        fn, layout_fn = METHODS[method]
        q, k, v, dout, offsets = make_case(5, MIXES["random"] + [200], 8, 2, hd=64)
        ref = expected(q, k, v, dout, offsets, True)
        layout = layout_fn(offsets, ctx.rank, ctx.world_size)
        local = [shard(x, layout).to("cuda", torch.bfloat16).requires_grad_() for x in (q, k, v)]
        out, lse = fn(*local, layout.cu_seqlens.cuda(), layout.max_seqlen, reg.world, return_lse=True)
        out.backward(shard(dout, layout).to("cuda", torch.bfloat16))
        real, idx = layout.loss_mask, layout.index[layout.loss_mask]
        torch.testing.assert_close(out[real.cuda()].double().cpu(), ref[0][idx], **BF16_TOL)
        torch.testing.assert_close(lse[:, real.cuda()].double().cpu(), ref[1][:, idx], **BF16_TOL)
        for x, want in zip(local, ref[2:], strict=True):
            want = want[idx]
            got = x.grad[real.cuda()].double().cpu()
            torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * max(1.0, want.abs().max().item()))
        return 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("method", ["ulysses", "ring"])
def test_nccl_parity_bf16(method, world_size):
    # One NCCL rank per GPU: a single GPU runs degree 1 (same code path), two or more run degree 2.
    if torch.cuda.device_count() < world_size:
        pytest.skip(f"needs {world_size} CUDA devices")
    p = DistPool(world_size)
    try:
        assert p.run(_nccl_job, method) == [1] * world_size
    finally:
        p.close()
