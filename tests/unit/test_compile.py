"""Regional torch.compile (flexorch.workers.compile): a compiled decoder computes what the eager one computes, for
flexorch's decoder and a Transformers Llama, in every recompute mode, on CPU (Inductor's C++ backend)."""

from __future__ import annotations

import pytest
import torch

from flexorch.config.model import ModelConfig
from flexorch.testing.reference import pack_documents, reference_loss_sum
from flexorch.workers.compile import compile_layers, compiled_layers, wants_compile
from flexorch.workers.model_source import build_model, set_activation_checkpointing

CFG = ModelConfig(vocab_size=97, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=64, loss_chunk_tokens=16)


def _loss_and_grads(model, batch):
    model.zero_grad(set_to_none=True)
    loss = reference_loss_sum(model, batch)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _batches():
    g = torch.Generator().manual_seed(0)
    # two token counts: the second call recompiles shape-generic, the third reuses it
    return [
        pack_documents([torch.randint(0, 97, (n,), generator=g) for n in lens]) for lens in ([9, 23], [31], [5, 7, 20])
    ]


def test_unset_compiles_on_a_gpu_only():
    assert wants_compile(None, torch.device("cuda")) and not wants_compile(None, None)
    assert not wants_compile(None, torch.device("cpu")) and wants_compile(True, None)
    assert not wants_compile(False, torch.device("cuda"))
    with pytest.raises(ValueError, match="compile must be true or false"):
        ModelConfig(compile="yes")


@pytest.mark.slow
@pytest.mark.parametrize("recompute", ["none", "full", "selective"])
def test_compiled_own_decoder_equals_eager(recompute):
    eager, compiled = build_model(CFG, 3), build_model(CFG, 3)
    for m in (eager, compiled):
        set_activation_checkpointing(m, recompute)
    assert compile_layers(compiled) == 2 and compile_layers(compiled) == 0  # idempotent
    assert compiled_layers(compiled) == 2 and compiled_layers(eager) == 0
    torch._dynamo.reset()
    for batch in _batches():
        want_loss, want = _loss_and_grads(eager, batch)
        got_loss, got = _loss_and_grads(compiled, batch)
        torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-5)
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-5, msg=name)
    # the parameter names (checkpoints, FSDP units, export) are the eager model's
    assert [n for n, _ in compiled.named_parameters()] == [n for n, _ in eager.named_parameters()]


@pytest.mark.slow
@pytest.mark.parametrize("recompute", ["none", "full", "selective"])
def test_compiled_transformers_llama_equals_eager(tmp_path, recompute):
    transformers = pytest.importorskip("transformers")
    from flexorch.config.hf import hf_model_config

    transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=97, max_position_embeddings=256,
    ).save_pretrained(tmp_path)  # fmt: skip
    cfg = ModelConfig.from_dict({**hf_model_config(str(tmp_path)), "loss_chunk_tokens": 16})
    eager, compiled = build_model(cfg, 5), build_model(cfg, 5)
    for m in (eager, compiled):
        set_activation_checkpointing(m, recompute)
    compile_layers(compiled)
    if recompute == "selective":  # the MLP under the layer's checkpoint is compiled too, not run eagerly
        assert all(hasattr(layer.mlp.flexorch_plain_forward, "_torchdynamo_orig_callable") for layer in compiled.layers)
    torch._dynamo.reset()
    for batch in _batches()[:2]:
        want_loss, want = _loss_and_grads(eager, batch)
        got_loss, got = _loss_and_grads(compiled, batch)
        torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-5)
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-5, msg=name)


def test_switching_recompute_per_micro_batch_changes_nothing_computed(tmp_path):
    # [sharding] activation_checkpointing = "auto" sets each micro-batch's mode on the model: flexorch's decoder
    # and a Transformers Llama give the same loss and gradients whatever the sequence of modes
    transformers = pytest.importorskip("transformers")
    from flexorch.config.hf import hf_model_config

    transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=97, max_position_embeddings=256,
    ).save_pretrained(tmp_path)  # fmt: skip
    hf = ModelConfig.from_dict({**hf_model_config(str(tmp_path)), "loss_chunk_tokens": 16})
    for cfg in (CFG, hf):
        plain, switched = build_model(cfg, 5), build_model(cfg, 5)
        set_activation_checkpointing(plain, "none")
        for batch, mode in zip(_batches(), ["full", "selective", "full"], strict=True):
            set_activation_checkpointing(switched, mode)
            want_loss, want = _loss_and_grads(plain, batch)
            got_loss, got = _loss_and_grads(switched, batch)
            torch.testing.assert_close(got_loss, want_loss, rtol=1e-6, atol=1e-6)
            for name in want:
                torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=f"{cfg.family} {name}")
        if cfg.hf is not None:  # Transformers' own switch, taken only when the mode changes
            assert switched.model.layers[0].gradient_checkpointing is True


def test_the_compile_time_is_counted_and_shown_on_the_step_line():
    from flexorch.cli.train_console import format_step
    from flexorch.workers.compile import compile_seconds

    m = build_model(CFG, 1)
    compile_layers(m)
    torch._dynamo.reset()  # (clears the account too)
    before = compile_seconds()
    _loss_and_grads(m, _batches()[0])
    assert compile_seconds() > before  # TorchDynamo's own account of its time
    ev = {
        "step": 0, "shape": "<1>", "solve_s": 0.1, "loss": 5.0, "tokens_per_s": 100.0, "predicted_ms": 10.0,
        "compute_ms": 10.0, "measured_ms": 12.0, "eta_s": 1.0, "ranks": [{"compile_s": 7.25}, None, {"compile_s": 0}],
    }  # fmt: skip
    assert format_step(ev, 10).endswith("[compiling the layers: 7.2 s of it]")
    ev["ranks"] = [{"compile_s": 0.0}]
    assert "compiling" not in format_step(ev, 10)


def test_the_start_line_says_which_attention_kernel_and_how_many_compiled_layers():
    from flexorch.cli.train_console import _describe_setup

    ev = {
        "corpus": {"tokens": 1000}, "num_docs": 10, "workers": 1, "min_workers": 1, "max_workers": 1,
        "model_params": 1.1e9, "batches_per_epoch": 3, "profile": "p", "tokens_per_worker": 86982,
        "kernels": {"attention": "attention kernel torch_cudnn, measured: ...", "compiled_layers": 22},
    }  # fmt: skip
    line = _describe_setup(ev)
    assert line.endswith("(86,982 tokens per worker); attention kernel torch_cudnn, measured: ...; 22 layers compiled")
    ev["kernels"] = {"attention": "attention kernel torch_cpu", "compiled_layers": 0}
    assert _describe_setup(ev).endswith("tokens per worker); attention kernel torch_cpu")
    # a small model's Ulysses copies: plan.tokens_per_worker (3,072) is the costliest group's, alone holds more
    ev.update(tokens_per_worker=5379, group_tokens_per_worker=3072)
    assert "(activations for 5,379 tokens per worker alone, 3,072 in the costliest SP group);" in _describe_setup(ev)
