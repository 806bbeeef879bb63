"""The model on CUDA against the same model on CPU (``test_model.py``'s CPU tests are the reference); skipped
without a GPU."""

from __future__ import annotations

import functools

import pytest
import torch

from flexorch.config import ModelConfig
from flexorch.testing.reference import pack_documents, reference_loss_sum
from flexorch.workers.attention.api import varlen_attn_func
from flexorch.workers.model import init_model, loss_sum
from tests.unit.test_model import make_docs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["math", "flash_attn"])
def test_cuda_model_matches_cpu(backend):
    if backend == "flash_attn":
        pytest.importorskip("flash_attn")
    cfg = ModelConfig()
    cpu, gpu = init_model(cfg, 0), init_model(cfg, 0, device="cuda")
    gpu_state = gpu.state_dict()
    assert all(torch.equal(v, gpu_state[k].cpu()) for k, v in cpu.state_dict().items())
    batch = pack_documents(make_docs(4, [37, 1, 64, 5]))
    want = reference_loss_sum(cpu, batch)
    dtype = torch.bfloat16 if backend == "flash_attn" else torch.float32
    gpu = gpu.to(dtype)
    cu = batch.cu_seqlens.cuda()
    attn = functools.partial(varlen_attn_func, cu_seqlens=cu, max_seqlen=batch.max_seqlen, backend=backend)
    logits = gpu(batch.tokens.cuda(), batch.position_ids.cuda(), attn)
    got = loss_sum(logits, batch.labels.cuda())
    tol = {"rtol": 1e-2, "atol": 1e-2} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-4}
    torch.testing.assert_close(got.cpu(), want.detach(), **tol)
