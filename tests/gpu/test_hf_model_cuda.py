"""A Transformers model (``[model] hf``) on CUDA in bf16 with flexorch's attention, against the same weights in fp32
with Transformers' own ``sdpa`` (``test_hf_model.py`` holds the CPU tests); skipped without a GPU."""

from __future__ import annotations

import functools

import pytest
import torch

transformers = pytest.importorskip("transformers")
from tests.unit.test_hf_model import FAMILIES, _dir, _model_cfg, _their_logits  # noqa: E402  (after the skip)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", FAMILIES)
def test_a_transformers_model_in_bf16_on_cuda_with_flexorch_attention_equals_its_fp32_sdpa(tmp_path, family):
    """The GPU path of an HF model: flexorch's attention (the fused CUDA kernel the device and dtype pick) inside
    Transformers' layers in bf16, against the same weights in fp32 with Transformers' own ``sdpa`` attention on the
    same GPU, each document alone (the masks the family builds, its sliding windows included). Tolerances are
    bf16's: the logits within 2e-2 of their largest magnitude, every gradient within 5e-2
    in relative norm."""
    from flexorch.testing.reference import pack_documents
    from flexorch.workers.attention.api import varlen_attn_func
    from flexorch.workers.attention.kernels import resolve_backend
    from flexorch.workers.model import loss_sum
    from flexorch.workers.model_source import build_model

    shape = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2}
    cfg = _model_cfg(_dir(tmp_path, family, **shape))
    ours = build_model(cfg, 0).to("cuda", torch.bfloat16).train()
    conf = transformers.AutoConfig.from_pretrained(cfg.hf)
    impl = "eager" if family == "gpt_oss" else "sdpa"  # GPT-OSS's sinks: Transformers' eager attention only
    ref = transformers.AutoModelForCausalLM.from_config(conf, attn_implementation=impl)
    missing, _ = ref.load_state_dict({k: v.float() for k, v in ours.state_dict().items()}, strict=False)
    assert set(missing) <= ({"lm_head.weight"} if cfg.tie_embeddings else set())
    ref = ref.to("cuda").train()
    gen = torch.Generator().manual_seed(0)
    docs = [torch.randint(0, 96, (n,), generator=gen) for n in (200, 31, 1, 120)]
    b = pack_documents(docs)
    cu = b.cu_seqlens.cuda()
    attn = functools.partial(varlen_attn_func, cu_seqlens=cu, max_seqlen=b.max_seqlen)
    tokens, pos, labels = b.tokens.cuda(), b.position_ids.cuda(), b.labels.cuda()
    assert resolve_backend(None, torch.empty(1, device="cuda", dtype=torch.bfloat16)) in ("flash_attn", "torch_flash")
    logits = ours(tokens, pos, attn)
    loss_sum(logits.float(), labels).backward()
    want = _their_logits(ref, [d.cuda() for d in docs])
    loss_sum(want, labels).backward()
    err = (logits.float() - want).abs().max() / want.abs().max().clamp_min(1.0)
    assert err < 2e-2, f"logits differ by {err:.2e}"
    theirs = dict(ref.named_parameters())
    for name, p in ours.named_parameters():
        g, w = p.grad.float(), theirs[name].grad
        rel = (g - w).norm() / w.norm().clamp_min(1e-12)
        assert rel < 5e-2, f"{name}: gradient differs by {rel:.2e} in relative norm"
