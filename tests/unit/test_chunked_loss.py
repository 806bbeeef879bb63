"""The LM head fused with the loss in chunks (``flexorch.workers.chunked_loss``) against the plain loss of whole
logits (``loss_sum(F.linear(h, W), labels)``, plain PyTorch): the same loss and the same gradients for every chunk
size, in float32 and bf16, with ignored positions, an empty micro-batch, and through our decoder and a Transformers
Llama; and no whole-logits storage held for the backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flexorch.config import ModelConfig
from flexorch.workers.activation_memory import measure_activation_bytes
from flexorch.workers.chunked_loss import IGNORE_INDEX, head_loss_sum
from flexorch.workers.model import init_model, loss_sum, next_token_labels


def _case(t=37, dim=16, vocab=50, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(t, dim, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(vocab, dim, generator=g) * 0.3).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (t,), generator=g)
    labels[::5] = IGNORE_INDEX  # document ends predict nothing
    return h, w, labels


def _loss_and_grads(fn, h, w, labels):
    h = h.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    loss = fn(h, w, labels)
    loss.backward()
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("chunk", [0, 1, 5, 36, 37, 64])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_every_chunk_size_gives_the_plain_loss_and_gradients(chunk, dtype, tol):
    h, w, labels = _case(dtype=dtype)
    plain = _loss_and_grads(lambda h, w, y: loss_sum(F.linear(h, w), y), h, w, labels)
    fused = _loss_and_grads(lambda h, w, y: head_loss_sum(h, w, y, chunk), h, w, labels)
    assert fused[0].dtype == torch.float32 and fused[0].shape == ()
    torch.testing.assert_close(fused[0], plain[0], rtol=tol, atol=tol)
    for got, want in zip(fused[1:], plain[1:], strict=True):
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_an_empty_micro_batch_and_an_all_ignored_chunk_give_zero_and_still_reach_the_weight():
    h, w, labels = _case(t=0)
    loss, gh, gw = _loss_and_grads(lambda h, w, y: head_loss_sum(h, w, y, 4), h, w, labels)
    assert float(loss) == 0.0 and gw is not None and not gw.any()  # the backward reaches the head (FSDP needs it)
    h, w, labels = _case(t=12)
    labels[:8] = IGNORE_INDEX  # the first two chunks of 4 predict nothing
    plain = _loss_and_grads(lambda h, w, y: loss_sum(F.linear(h, w), y), h, w, labels)
    fused = _loss_and_grads(lambda h, w, y: head_loss_sum(h, w, y, 4), h, w, labels)
    torch.testing.assert_close(fused[0], plain[0])
    assert not fused[1][:8].any()


def test_bad_arguments_are_named():
    h, w, labels = _case(t=6)
    with pytest.raises(ValueError, match=r"labels must be \(6,\)"):
        head_loss_sum(h, w, labels[:5], 2)
    with pytest.raises(ValueError, match="chunk must be >= 0"):
        head_loss_sum(h, w, labels, -1)
    with pytest.raises(ValueError, match="loss_chunk_tokens must be an integer >= 0"):
        ModelConfig(loss_chunk_tokens=-4)


def _self_attn(q, k, v):  # one document: causal attention over it (the shapes flexorch's kernels take)
    return F.scaled_dot_product_attention(
        q.transpose(0, 1), k.repeat_interleave(q.shape[1] // k.shape[1], 1).transpose(0, 1),
        v.repeat_interleave(q.shape[1] // v.shape[1], 1).transpose(0, 1), is_causal=True,
    ).transpose(0, 1)  # fmt: skip


def _check_fused_equals_plain(model, ids, pos, labels) -> None:
    """The model's loss with ``labels`` (head + loss in chunks) and every parameter's gradient equal the plain loss
    of its whole logits."""
    plain = loss_sum(model(ids, pos, _self_attn), labels)
    plain.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    fused = model(ids, pos, _self_attn, labels=labels)
    fused.backward()
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=1e-4, atol=1e-6, msg=n)


def test_our_decoder_with_labels_equals_its_logits_loss_and_holds_no_whole_logits():
    cfg = ModelConfig(vocab_size=4096, loss_chunk_tokens=16)
    model = init_model(cfg, seed=0)
    t = 96
    ids = torch.randint(0, cfg.vocab_size, (t,), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(t)
    labels = next_token_labels(ids, torch.tensor([0, t], dtype=torch.int32))
    _check_fused_equals_plain(model, ids, pos, labels)
    whole = measure_activation_bytes(init_model(ModelConfig(vocab_size=4096, loss_chunk_tokens=0), 0), ids, pos,
                                     _self_attn, labels)  # fmt: skip
    chunked = measure_activation_bytes(model, ids, pos, _self_attn, labels)
    logits_bytes = t * cfg.vocab_size * 4
    assert whole - chunked >= logits_bytes, (whole, chunked)  # the fp32 logits (and their log-softmax) not held


@pytest.mark.parametrize("tied", [False, True])
def test_a_transformers_llama_with_labels_equals_its_logits_loss(tmp_path, tied):
    transformers = pytest.importorskip("transformers")
    import dataclasses

    from flexorch.config.hf import hf_model_config
    from flexorch.workers.model_source import build_model

    transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=300, tie_word_embeddings=tied,
    ).save_pretrained(tmp_path)  # fmt: skip
    cfg = dataclasses.replace(ModelConfig.from_dict(hf_model_config(str(tmp_path))), loss_chunk_tokens=7)
    model = build_model(cfg, 0)
    t = 40
    ids = torch.randint(0, 300, (t,), generator=torch.Generator().manual_seed(2))
    pos = torch.arange(t)
    labels = next_token_labels(ids, torch.tensor([0, t], dtype=torch.int32))
    _check_fused_equals_plain(model, ids, pos, labels)
    model.zero_grad(set_to_none=True)
    empty = torch.zeros(0, dtype=torch.int64)
    idle = model(empty, empty, None, labels=empty)  # an idle rank under FSDP: zero, and every parameter reached
    idle.backward()
    assert float(idle.detach()) == 0.0 and all(p.grad is not None and not p.grad.any() for p in model.parameters())


def test_the_chunk_is_a_model_key_allowed_beside_hf(tmp_path):
    transformers = pytest.importorskip("transformers")
    from flexorch.config import ConfigError, load_train_config

    transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=300,
    ).save_pretrained(tmp_path / "m")  # fmt: skip
    run = tmp_path / "run.toml"
    run.write_text(f"[data]\ntokenizer = 'byte'\n[model]\nhf = '{tmp_path / 'm'}'\nloss_chunk_tokens = 8192\n")
    cfg = load_train_config(run)
    assert (cfg.model.loss_chunk_tokens, cfg.model.dim, cfg.model.family) == (8192, 32, "llama")
    run.write_text(f"[data]\ntokenizer = 'byte'\n[model]\nhf = '{tmp_path / 'm'}'\ndim = 64\n")
    with pytest.raises(ConfigError, match=r"shape comes from its config.json; remove \['dim'\]"):
        load_train_config(run)
    assert load_train_config(None).model.loss_chunk_tokens == 4096  # the default
