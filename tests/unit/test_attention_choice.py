"""The cuDNN attention adapter at its seam (CPU fakes of the CUDA-only ops, computing with ``math``) and the measured
choice of the attention kernel. The real cuDNN kernels run in the CUDA tests and ``benchmarks/gpu/gpu_profile.py``."""

from __future__ import annotations

import pytest
import torch

from flexorch.workers.attention import choice, kernels, torch_cudnn, torch_flash
from flexorch.workers.attention.kernels import Seqlens, attn_backward, attn_forward


def _one(n: int) -> Seqlens:
    return Seqlens((0, n))


class _FakeAten:
    """``torch.ops.aten``'s cuDNN and flash attention ops on CPU: check the arguments, compute with ``math``."""

    def __init__(self):
        self.calls = []

    def _scaled_dot_product_cudnn_attention(self, q, k, v, bias, want_lse, dropout, causal, debug, *, scale):
        assert bias is None and want_lse and dropout == 0.0 and causal and not debug
        assert q.dim() == 4 and q.shape == k.shape == v.shape  # (1, h, n, hd), K/V repeated to every head
        n, h = q.shape[2], q.shape[1]
        self.calls.append(("cudnn_fwd", n))
        out, lse = attn_forward(*(x[0].transpose(0, 1) for x in (q, k, v)), _one(n), _one(n), causal=True,
                                softmax_scale=scale, backend="math")  # fmt: skip
        zero = torch.zeros(1, dtype=torch.int64)
        return out.transpose(0, 1)[None], lse.reshape(1, h, n, 1), None, None, n, n, zero, zero, None

    def _scaled_dot_product_cudnn_attention_backward(
        self, dout, q, k, v, out, lse, seed, offset, bias, cum_q, cum_k, max_q, max_k, dropout, causal, *, scale
    ):
        assert bias is None and cum_q is None and cum_k is None and dropout == 0.0 and causal
        assert int(seed) == 0 and int(offset) == 0 and lse.shape == (1, q.shape[1], q.shape[2], 1)
        n = q.shape[2]
        self.calls.append(("cudnn_bwd", n))
        g = attn_backward(*(x[0].transpose(0, 1) for x in (dout, q, k, v, out)), lse.reshape(q.shape[1], n),
                          _one(n), _one(n), causal=True, softmax_scale=scale, backend="math")  # fmt: skip
        return tuple(x.transpose(0, 1)[None] for x in g)

    def _flash_attention_forward(self, q, k, v, cu_q, cu_k, max_q, max_k, dropout, causal, debug, *, scale):
        self.calls.append(("flash_fwd", tuple(cu_q.tolist())))
        out, lse = attn_forward(q, k, v, Seqlens(tuple(cu_q.tolist())), Seqlens(tuple(cu_k.tolist())),
                                causal=causal, softmax_scale=scale, backend="math")  # fmt: skip
        return out, lse, None, None, None

    def _flash_attention_backward(self, dout, q, k, v, out, lse, cu_q, cu_k, mq, mk, dropout, causal, rng, u, *, scale):
        self.calls.append(("flash_bwd", tuple(cu_q.tolist())))
        return attn_backward(dout, q, k, v, out, lse, Seqlens(tuple(cu_q.tolist())), Seqlens(tuple(cu_k.tolist())),
                             causal=causal, softmax_scale=scale, backend="math")  # fmt: skip


@pytest.fixture
def fake(monkeypatch):
    aten = _FakeAten()
    monkeypatch.setattr(torch_cudnn, "_aten", lambda: aten)
    monkeypatch.setattr(torch_flash, "_aten", lambda: aten)
    monkeypatch.setattr(torch_cudnn, "MIN_TOKENS", 16)  # small sizes, the same paths
    monkeypatch.setattr(torch_cudnn, "PAD_TOKENS", 8)
    torch_cudnn.split.cache_clear()
    yield aten
    torch_cudnn.split.cache_clear()


def _case(lengths, h=4, h_kv=2, hd=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    return [torch.randn(t, n, hd, dtype=torch.float64, generator=g) for n in (h, h_kv, h_kv, h)]


@pytest.mark.parametrize("causal", [True, False])
def test_cudnn_adapter_equals_the_reference(fake, causal):
    lengths = [37, 5, 1, 20, 16, 3]  # 37, 20, 16 on "cuDNN" (37 and 20 padded to 40 and 24); the rest on flash
    q, k, v, dout = _case(lengths)
    cu = Seqlens(tuple(int(x) for x in torch.tensor([0, *lengths]).cumsum(0)))
    out, lse = torch_cudnn.torch_cudnn_forward(q, k, v, cu, cu, causal, 0.3)
    grads = torch_cudnn.torch_cudnn_backward(dout, q, k, v, out, lse, cu, cu, causal, 0.3)
    want_out, want_lse = attn_forward(q, k, v, cu, cu, causal=causal, softmax_scale=0.3, backend="math")
    want = attn_backward(dout, q, k, v, want_out, want_lse, cu, cu, causal=causal, softmax_scale=0.3, backend="math")
    for got_t, want_t in zip((out, lse, *grads), (want_out, want_lse, *want), strict=False):
        torch.testing.assert_close(got_t, want_t, rtol=1e-10, atol=1e-10)
    if causal:
        assert [c for c in fake.calls if c[0].startswith("cudnn")] == [
            ("cudnn_fwd", 40), ("cudnn_fwd", 24), ("cudnn_fwd", 16),
            ("cudnn_bwd", 40), ("cudnn_bwd", 24), ("cudnn_bwd", 16),
        ]  # fmt: skip
        assert ("flash_fwd", (0, 5, 6, 9)) in fake.calls  # the short documents in one call
    else:  # ring blocks that are not causal stay on flash whole
        assert [c[0] for c in fake.calls] == ["flash_fwd", "flash_bwd"]


def test_the_choice_checks_then_times_and_sets_the_default():
    cpu = torch.device("cpu")
    try:
        c = choice.choose_backend(
            cpu, torch.float64, 4, 2, 8, candidates=("torch_cpu", "math"), probe=(64, 32), check=(40, 7, 1), reps=1
        )
        assert set(c.ms) == {"torch_cpu", "math"} and c.name == min(c.ms, key=c.ms.get)
        assert max(c.errors.values()) < 1e-10 and not c.refused and c.tokens == 96
        assert kernels.default_backend(cpu, torch.float64) == c.name
        assert "measured" in c.describe() and c.name in c.describe()
        assert c.seconds > 0 and c.describe().endswith(f"chosen in {c.seconds:.1f} s")  # what it adds to a start
    finally:
        kernels.set_default_backend(cpu, torch.float64, None)
    assert kernels.default_backend(cpu, torch.float64) == "torch_cpu"


def test_a_kernel_that_is_wrong_or_fails_is_not_chosen(monkeypatch):
    cpu = torch.device("cpu")
    good = kernels._FORWARD["torch_cpu"]

    def off_by_a_bit(q, k, v, cu_q, cu_k, causal, scale):
        out, lse = good(q, k, v, cu_q, cu_k, causal, scale)
        return out * 1.01, lse

    monkeypatch.setitem(kernels._FORWARD, "torch_cpu", off_by_a_bit)
    try:
        c = choice.choose_backend(cpu, torch.float32, 4, 2, 8, candidates=("torch_cpu", "math"), probe=(16,),
                                  check=(9, 1), reps=1)  # fmt: skip
        assert c.name == "math" and "error" in c.refused["torch_cpu"]
        monkeypatch.setitem(kernels._FORWARD, "torch_cpu", lambda *a: 1 / 0)
        c = choice.choose_backend(cpu, torch.float32, 4, 2, 8, candidates=("torch_cpu", "math"), probe=(16,),
                                  check=(9, 1), reps=1)  # fmt: skip
        assert c.refused["torch_cpu"].startswith("ZeroDivisionError")
        monkeypatch.setitem(kernels._FORWARD, "math", lambda *a: 1 / 0)
        with pytest.raises(RuntimeError, match="no attention kernel matches the reference"):
            choice.choose_backend(cpu, torch.float32, 4, 2, 8, candidates=("torch_cpu", "math"), probe=(16,),
                                  check=(9, 1), reps=1)  # fmt: skip
    finally:
        kernels.set_default_backend(cpu, torch.float32, None)


def test_a_named_kernel_that_cannot_run_here_says_so():
    with pytest.raises(ValueError, match=r"\[model\] attention = 'torch_cudnn' cannot run float32 on cpu"):
        kernels.set_default_backend(torch.device("cpu"), torch.float32, "torch_cudnn")
    with pytest.raises(ValueError, match="ModelConfig.attention must be one of"):
        from flexorch.config.model import ModelConfig

        ModelConfig(attention="fast")
