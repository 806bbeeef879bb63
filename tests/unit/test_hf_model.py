"""Hugging Face models in one process: the model directory's checks, and flexorch's attention inside Transformers'
layers against Transformers' own ``sdpa`` attention and masks (an oracle we did not write) on packed documents, for
every family flexorch trains: grouped-query attention, biases, a head size other than hidden / heads (Qwen3, Gemma 3),
q/k norms (Qwen3, OLMo 2, Gemma 3), fused projections (Phi-3), sliding windows on every layer (Mistral) or some
(Gemma 3), and scaled RoPE (llama3, YaRN) at positions beyond the original context."""

from __future__ import annotations

import functools
import json

import pytest
import torch

from flexorch.config import ConfigError, ModelConfig, config_from_dict
from flexorch.config.hf import hf_model_config

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402  (a dependency of transformers)

SHAPE = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 96}  # fmt: skip
_LLAMA3 = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8}  # fmt: skip
CASES = {
    "llama": ("llama", {}),
    "llama-biases": ("llama", {"attention_bias": True, "mlp_bias": True}),
    "llama-rope-llama3": ("llama", {"rope_scaling": _LLAMA3}),  # documents of 30 tokens: beyond the original 8
    "llama-rope-yarn": (
        "llama",
        {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}},
    ),  # fmt: skip
    "mistral": ("mistral", {"sliding_window": 16}),  # every layer windowed, shorter than the longest document
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {"head_dim": 16}),  # 4 heads of 16 on a hidden size of 32
    "phi3": ("phi3", {"pad_token_id": None}),
    "olmo2": ("olmo2", {"pad_token_id": None}),
    "gemma3_text": ("gemma3_text", {"head_dim": 16, "sliding_window": 8, "sliding_window_pattern": 2}),
    "qwen3_moe": (
        "qwen3_moe",
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 16,
            "head_dim": 16,
            "mlp_only_layers": [1],
        },
    ),  # a dense layer after an MoE one
    "mixtral": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 16}),
    "olmoe": ("olmoe", {"num_experts": 4, "num_experts_per_tok": 2, "pad_token_id": None}),
    "gpt_oss": ("gpt_oss", {"num_local_experts": 4, "num_experts_per_tok": 2, "head_dim": 16, "sliding_window": 8,
                            "pad_token_id": None}),  # sinks; sliding and full layers in turn; YaRN
}  # fmt: skip
"""Test models: name -> (model_type, config options beyond SHAPE)."""
FAMILIES = [name for name, (family, _) in CASES.items() if name == family]


def _dir(tmp_path, case="llama", weights=False, **extra):
    family, options = CASES[case]
    conf = transformers.AutoConfig.for_model(family, **{**SHAPE, **options, **extra})
    d = tmp_path / f"{case}{'-w' if weights else ''}"
    if weights:
        torch.manual_seed(1)
        transformers.AutoModelForCausalLM.from_config(conf).save_pretrained(d)
    else:
        conf.save_pretrained(d)
    return d


def _model_cfg(d) -> ModelConfig:
    return ModelConfig.from_dict(hf_model_config(str(d)))


@pytest.mark.parametrize("case,tied", [(c, False) for c in CASES] + [("qwen2", True), ("gemma3_text", True)])
def test_param_shapes_are_the_transformers_models(tmp_path, case, tied):
    from flexorch.workers.model_source import build_model

    d = _dir(tmp_path, case, tie_word_embeddings=tied)
    cfg = _model_cfg(d)
    conf = transformers.AutoConfig.from_pretrained(d)
    with torch.device("meta"):
        lm = transformers.AutoModelForCausalLM.from_config(conf)
    theirs = [(n, tuple(p.shape)) for n, p in lm.named_parameters()]
    assert cfg.param_shapes() == theirs
    assert cfg.num_params() == sum(p.numel() for p in lm.parameters())
    model = build_model(cfg, 3)
    assert [(n, tuple(p.shape)) for n, p in model.named_parameters()] == theirs
    again = build_model(cfg, 3)
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in model.state_dict().items())
    # the buffers (rotary frequencies of each layer kind, Gemma's embedding scale) are rebuilt after to_empty, not
    # left as uninitialised memory
    expected = dict(transformers.AutoModelForCausalLM.from_config(conf).named_buffers())
    assert set(expected) == {n for n, _ in model.named_buffers()}
    for name, buf in model.named_buffers():
        torch.testing.assert_close(buf, expected[name], rtol=0, atol=0, msg=name)


def _their_logits(ref, docs):
    """Transformers' model on each document alone, with the masks it builds itself (causal, its sliding windows):
    ``(sum of lengths, vocab)``, in the packed order."""
    return torch.cat([ref(input_ids=doc[None]).logits[0] for doc in docs])


@pytest.mark.parametrize(
    "case,recompute", [(c, "none") for c in CASES] + [(f, r) for f in FAMILIES for r in ("full", "selective")]
)
def test_flexorch_attention_inside_transformers_equals_its_sdpa_on_packed_documents(tmp_path, case, recompute):
    from flexorch.testing.reference import pack_documents
    from flexorch.workers.attention.api import varlen_attn_func
    from flexorch.workers.model import loss_sum
    from flexorch.workers.model_source import build_model, set_activation_checkpointing

    cfg = _model_cfg(_dir(tmp_path, case))
    ours = build_model(cfg, 0)
    set_activation_checkpointing(ours, recompute)
    ours.train()
    conf = transformers.AutoConfig.from_pretrained(cfg.hf)
    impl = "eager" if case == "gpt_oss" else "sdpa"  # GPT-OSS's sinks: Transformers' eager attention only
    ref = transformers.AutoModelForCausalLM.from_config(conf, attn_implementation=impl)
    missing, unexpected = ref.load_state_dict(ours.state_dict(), strict=False)
    assert not unexpected and set(missing) <= ({"lm_head.weight"} if cfg.tie_embeddings else set())
    gen = torch.Generator().manual_seed(0)
    docs = [torch.randint(0, 96, (n,), generator=gen) for n in (7, 30, 1, 12)]
    b = pack_documents(docs)
    attn = functools.partial(varlen_attn_func, cu_seqlens=b.cu_seqlens, max_seqlen=b.max_seqlen)
    loss_sum(ours(b.tokens, b.position_ids, attn), b.labels).backward()
    logits = _their_logits(ref, docs)
    loss_sum(logits, b.labels).backward()
    torch.testing.assert_close(ours(b.tokens, b.position_ids, attn), logits, rtol=1e-5, atol=1e-5)
    theirs = dict(ref.named_parameters())
    for name, p in ours.named_parameters():  # atol: float reordering, at the gradient's own scale (Transformers
        # 5.25 moved one element of 2,048 of a Gemma-3 gradient, 3.9e-3, by 1.4e-6)
        want = theirs[name].grad
        atol = max(1e-6, 1e-4 * float(want.abs().max()))
        torch.testing.assert_close(p.grad, want, rtol=1e-4, atol=atol, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("family", FAMILIES)
def test_selective_recompute_of_a_transformers_model_keeps_between_none_and_full(tmp_path, family):
    # 'selective' recomputes each layer's MLP only (flexorch.workers.hf_model): its intermediate activations, most
    # of a layer's bytes, are dropped; the rest of the layer keeps what it keeps without recompute
    from flexorch.workers.calibrate import activation_bytes_per_token
    from flexorch.workers.model_source import build_model, set_activation_checkpointing

    cfg = _model_cfg(_dir(tmp_path, family))
    model = build_model(cfg, 0)
    per_token = {}
    for mode in ("none", "selective", "full", "none"):  # back to 'none': the switch is undone
        set_activation_checkpointing(model, mode)
        per_token[mode] = activation_bytes_per_token(model, cfg.vocab_size)
    assert per_token["none"] > per_token["selective"] > per_token["full"] > 0, per_token
    names = [n for n, _ in model.named_parameters()]
    assert names == [n for n, _ in build_model(cfg, 0).named_parameters()]  # checkpoints and exports unchanged
    with pytest.raises(ValueError, match="'none', 'full' or 'selective', got 'auto'"):
        set_activation_checkpointing(model, "auto")


def test_an_empty_micro_batch_reaches_every_parameter_with_zero_gradients(tmp_path):
    """An idle rank under FSDP runs an empty micro-batch: (0, vocab) logits whose backward touches every layer."""
    from flexorch.workers.model import loss_sum
    from flexorch.workers.model_source import build_model

    model = build_model(_model_cfg(_dir(tmp_path, "qwen2", tie_word_embeddings=True)), 0)
    empty = torch.zeros(0, dtype=torch.int64)
    logits = model(empty, empty, attn=None)
    assert logits.shape == (0, 96)
    loss_sum(logits, empty).backward()
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())


def test_weights_are_read_from_the_directory(tmp_path):
    from flexorch.workers.model_source import build_model

    d = _dir(tmp_path, "llama", weights=True)
    cfg = _model_cfg(d)
    assert cfg.hf_weights
    saved = load_file(d / "model.safetensors")
    model = build_model(cfg, seed=123)  # the seed does not matter: the weights are the checkpoint's
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), saved[name].float()), name


# ------------------------------------------------------------------ bad input, before any worker starts


def test_a_missing_directory_and_a_hub_id_are_clear_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        hf_model_config(str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match="Hub id.*never downloads.*hf download meta-llama/Llama-3.2-1B"):
        hf_model_config("meta-llama/Llama-3.2-1B")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no config.json"):
        hf_model_config(str(tmp_path / "empty"))


def test_a_model_that_is_not_a_causal_lm_is_refused(tmp_path):
    d = tmp_path / "bert"
    transformers.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2).save_pretrained(d)
    with pytest.raises(ConfigError, match="model_type 'bert'"):
        hf_model_config(str(d))
    conf = json.loads((d / "config.json").read_text())
    conf["architectures"] = ["BertForMaskedLM"]
    (d / "config.json").write_text(json.dumps(conf))
    with pytest.raises(ConfigError, match="BertForMaskedLM, not a causal language model"):
        hf_model_config(str(d))


@pytest.mark.parametrize(
    "case,extra,match",
    [("llama", {"attention_dropout": 0.1}, "dropout"),
     ("mistral", {"attention_bias": True}, "attention_bias / mlp_bias: a mistral model has no such biases"),
     ("llama", {"hidden_act": "tanh"}, "hidden_act 'tanh' is not supported; use one of silu"),
     ("gemma3_text", {"final_logit_softcapping": 30.0}, "final_logit_softcapping = 30.0.*no soft-capping"),
     ("gemma3_text", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping = 50.0"),
     ("gemma3_text", {"use_bidirectional_attention": True}, "causal language models only"),
     ("mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise 0.1: .*fresh random noise per token"),
     ("olmoe", {"num_experts_per_tok": 5}, "num_experts_per_tok 5 is more than the 4 experts"),
     ("llama", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
      "rope_type 'dynamic'.*longest position in each forward call.*llama3, yarn")],
)  # fmt: skip
def test_options_flexorch_does_not_compute_are_refused(tmp_path, case, extra, match):
    with pytest.raises(ConfigError, match=match):
        hf_model_config(str(_dir(tmp_path, case, **extra)))


@pytest.mark.parametrize(
    "edit,match",
    [({"model_type": "qwen3_next"}, "model_type 'qwen3_next': Qwen3-Next mixes linear-attention"),
     ({"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"]},
      "vision tower.*model_type gemma3_text"),
     ({"model_type": "deepseek_v3"}, "model_type 'deepseek_v3'; flexorch trains the llama, .*, gpt_oss families"),
     ({"layer_types": ["chunked_attention", "full_attention"]}, "layer_types has 'chunked_attention' layers"),
     ({"layer_types": ["full_attention"]}, "one kind per layer \\(2\\)"),
     ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "rope_type 'longrope'"),
     ({"sliding_window": None, "layer_types": ["sliding_attention"] * 2}, "sliding_window is None")],
)  # fmt: skip
def test_config_keys_flexorch_does_not_run_are_named_with_the_reason(tmp_path, edit, match):
    d = _dir(tmp_path, "llama")
    conf = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**conf, **edit}))
    with pytest.raises(ConfigError, match=match):
        hf_model_config(str(d))


def test_missing_and_misshaped_weights_are_named(tmp_path):
    d = _dir(tmp_path, "llama", weights=True)
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    tensors["model.norm.weight"] = torch.ones(31)
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(ConfigError, match=r"1 missing \(first: model.layers.1.mlp.up_proj.weight\).*model.norm.weight"):
        hf_model_config(str(d))
    (d / "model.safetensors").write_bytes(b"\x01\x02")
    with pytest.raises(ConfigError, match="not a readable safetensors file"):
        hf_model_config(str(d))
    (d / "model.safetensors").unlink()
    (d / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(ConfigError, match="safetensors only"):
        hf_model_config(str(d))


def test_a_run_with_an_hf_model_fails_before_any_worker_on_a_bad_directory(tmp_path):
    with pytest.raises(ConfigError, match=r"\[model\] hf: directory"):
        config_from_dict({"model": {"hf": str(tmp_path / "missing")}, "data": {"tokenizer": "byte"}})


def test_a_sliding_window_reaches_the_planner_and_documents_may_be_longer(tmp_path):
    """Documents longer than the window train (the kernels compute the window); the run's planner profile prices
    the windowed layers by it (Gemma 3 here: 1 of 2 layers slides)."""
    from flexorch.control.calibration import fitted_profile
    from flexorch.solver.profiles import get_profile

    d = _dir(tmp_path, "gemma3_text", sliding_window=64)
    cfg = config_from_dict({"model": {"hf": str(d)}, "data": {"tokenizer": "byte", "max_context": 1024}, "workers": 4})
    assert (cfg.model.attention_window, cfg.model.window_layers, cfg.model.window_fraction) == (64, (0,), 0.5)
    assert [cfg.model.layer_window(i) for i in range(2)] == [64, None]
    profile = fitted_profile(get_profile("gpt-7b-a100"), cfg)
    assert (profile.attention_window, profile.window_fraction, profile.head_dim) == (64, 0.5, 16)
    mistral = _model_cfg(_dir(tmp_path, "mistral", sliding_window=512))
    assert (mistral.attention_window, mistral.window_layers, mistral.window_fraction) == (512, (0, 1), 1.0)


def test_a_large_export_is_split_into_safetensors_shards_that_both_transformers_and_flexorch_load(tmp_path):
    """`export_hf` splits the weights as save_pretrained does (an index and files of at most max_shard_bytes);
    Transformers loads the directory, and flexorch reads it back through the index, tensor for tensor."""
    from flexorch.control.checkpoint import save_checkpoint
    from flexorch.control.hf_export import export_hf
    from flexorch.workers.model_source import build_model

    cfg = _model_cfg(_dir(tmp_path, "qwen2", tie_word_embeddings=True))
    state = build_model(cfg, 7).state_dict()
    worker = {"model": state, "optimizer": {}, "scheduler": {}, "rng": {}}
    ckpt = save_checkpoint(tmp_path / "run", 1, worker, {"config": {"model": cfg.to_dict(), "data": {}}}).path
    got = export_hf(ckpt, tmp_path / "out", max_shard_bytes=20_000)
    assert len(got["files"]) > 1 and (tmp_path / "out" / "model.safetensors.index.json").is_file()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", local_files_only=True)
    ids = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(0))
    ours = build_model(cfg, 7)
    with torch.no_grad():
        theirs = loaded(input_ids=ids).logits[0]
        mine = ours(ids[0], torch.arange(9), functools.partial(_causal, n=9))
    torch.testing.assert_close(theirs, mine, rtol=1e-5, atol=1e-5)
    again = _model_cfg(tmp_path / "out")
    assert again.hf_weights
    back = build_model(again, seed=123)
    assert all(torch.equal(back.state_dict()[n], t) for n, t in state.items())


@pytest.mark.parametrize("case", list(CASES))
def test_every_family_exports_to_a_directory_that_from_pretrained_loads_with_the_same_logits(tmp_path, case):
    """A checkpoint of each family (random weights) exported: Transformers' own class (``architectures``) loads it
    with no missing or unexpected weight, and gives flexorch's logits on a 20-token document (past the windows and
    the original RoPE context of the test models)."""
    from flexorch.control.checkpoint import save_checkpoint
    from flexorch.control.hf_export import export_hf
    from flexorch.workers.model_source import build_model

    cfg = _model_cfg(_dir(tmp_path, case))
    ours = build_model(cfg, 5)
    worker = {"model": ours.state_dict(), "optimizer": {}, "scheduler": {}, "rng": {}}
    ckpt = save_checkpoint(tmp_path / "run", 1, worker, {"config": {"model": cfg.to_dict(), "data": {}}}).path
    export_hf(ckpt, tmp_path / "out")
    conf = json.loads((tmp_path / "out" / "config.json").read_text())
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", local_files_only=True, output_loading_info=True
    )
    assert type(loaded).__name__ in conf["architectures"]
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ids = torch.randint(0, 96, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = loaded(input_ids=ids).logits[0]
        mine = ours(ids[0], torch.arange(20), functools.partial(_causal, n=20))
    torch.testing.assert_close(theirs, mine, rtol=1e-5, atol=1e-5)


def _causal(q, k, v, n, **kwargs):
    from flexorch.workers.attention.api import varlen_attn_func

    return varlen_attn_func(q, k, v, torch.tensor([0, n], dtype=torch.int32), n, **kwargs)


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")  # inside PEFT
def test_an_export_with_adapters_is_the_base_model_plus_one_peft_adapter_per_task(tmp_path, capsys):
    """`flexorch export` of a run with per-task LoRA adapters: the safetensors are the base model alone (no `.lora.`
    tensor; from_pretrained reports no missing or unexpected key) and each task's adapter is a PEFT directory,
    `adapters/<task>/`. Transformers' model with PEFT's adapter (code we did not write, with Transformers' own
    attention) gives flexorch's logits with that task active; the base alone, flexorch's with none."""
    peft = pytest.importorskip("peft")
    from flexorch.cli.main import main
    from flexorch.config.adapters import LoraSpec
    from flexorch.control.checkpoint import save_checkpoint
    from flexorch.workers.lora import set_active_task
    from flexorch.workers.model_source import build_model

    specs = (  # every linear map of a Llama layer, q_proj in both tasks; B != 0, so an adapter changes the logits
        LoraSpec("chat", 4, 8.0, ("q_proj", "v_proj"), init_b_std=0.02),
        LoraSpec("code", 2, 3.0, ("q_proj", "k_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), init_b_std=0.02),
    )
    cfg = ModelConfig.from_dict({**hf_model_config(str(_dir(tmp_path, "llama"))), "adapters": specs})
    ours = build_model(cfg, 7).eval()
    state = ours.state_dict()
    worker = {"model": state, "optimizer": {}, "scheduler": {}, "rng": {}}
    ckpt = save_checkpoint(tmp_path / "run", 1, worker, {"config": {"model": cfg.to_dict(), "data": {}}}).path
    out = tmp_path / "out"
    assert main(["export", ckpt, str(out)]) == 0
    printed = capsys.readouterr().out.splitlines()
    for s in specs:
        assert sum(f"adapter {s.task} -> {out / 'adapters' / s.task}/" in line for line in printed) == 1, printed

    saved = load_file(out / "model.safetensors")
    assert not [n for n in saved if ".lora." in n]
    assert sorted(saved) == sorted(n for n in state if ".lora." not in n)

    def base():
        lm, info = transformers.AutoModelForCausalLM.from_pretrained(
            out, local_files_only=True, output_loading_info=True
        )
        assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
        return lm.eval()

    ids = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(0))

    def mine(task):
        set_active_task(ours, task)
        with torch.no_grad():
            return ours(ids[0], torch.arange(9), functools.partial(_causal, n=9))

    with torch.no_grad():
        torch.testing.assert_close(base()(input_ids=ids).logits[0], mine(None), rtol=1e-5, atol=1e-5)
    for s in specs:
        where = out / "adapters" / s.task
        conf = json.loads((where / "adapter_config.json").read_text())
        assert (conf["peft_type"], conf["r"], conf["lora_alpha"], conf["lora_dropout"]) == ("LORA", s.rank, s.alpha, 0)
        assert sorted(conf["target_modules"]) == sorted(s.targets)
        twin = peft.PeftModel.from_pretrained(base(), where).eval()
        theirs = dict(twin.named_parameters())
        ours_lora = {n: p for n, p in ours.named_parameters() if f".lora.{s.task}." in n}
        assert len(ours_lora) == len([n for n in theirs if ".lora_" in n]) == 2 * len(s.targets) * 2
        for name, p in ours_lora.items():  # model.layers.0.lora.code.q_proj.A -> ....q_proj.lora_A.default.weight
            layer, _, rest = name.partition(".lora.")
            _, target, which = rest.split(".")
            (twin_name,) = [n for n in theirs if n.startswith(f"base_model.model.{layer}.") and
                            n.endswith(f".{target}.lora_{which}.default.weight")]  # fmt: skip
            assert torch.equal(theirs[twin_name], p.detach()), name
        with torch.no_grad():
            adapted = twin(input_ids=ids).logits[0]
        torch.testing.assert_close(adapted, mine(s.task), rtol=1e-5, atol=1e-5)
        assert not torch.allclose(adapted, mine(None), rtol=1e-3, atol=1e-3), "the adapter changes the logits"


def test_an_export_of_our_decoder_with_adapters_is_one_state_dict_and_says_so(tmp_path, capsys):
    """flexorch's own decoder has no Transformers layout to export to: `export_hf` refuses it, naming its adapters,
    and `flexorch export` writes one state dict that keeps them under flexorch's names."""
    from flexorch.cli.main import main
    from flexorch.config.adapters import LoraSpec
    from flexorch.control.checkpoint import CheckpointError, save_checkpoint
    from flexorch.control.hf_export import export_hf
    from flexorch.workers.model_source import build_model

    cfg = ModelConfig(vocab_size=64, dim=32, num_layers=1, num_heads=4, num_kv_heads=2, ffn_dim=48,
                      adapters=(LoraSpec("chat", 2, 4.0, ("wq", "w2")),))  # fmt: skip
    state = build_model(cfg, 0).state_dict()
    worker = {"model": state, "optimizer": {}, "scheduler": {}, "rng": {}}
    ckpt = save_checkpoint(tmp_path / "run", 1, worker, {"config": {"model": cfg.to_dict(), "data": {}}}).path
    with pytest.raises(CheckpointError, match=r"own decoder.*LoRA adapters \(tasks chat\).*model\.pt"):
        export_hf(ckpt, tmp_path / "hf")
    assert main(["export", ckpt, str(tmp_path / "model.pt")]) == 0
    assert "LoRA adapters of tasks chat under flexorch's names" in capsys.readouterr().out
    back = torch.load(tmp_path / "model.pt", weights_only=True)
    assert sorted(back) == sorted(state) and "layers.0.lora.chat.wq.A" in back


def test_an_idle_ranks_empty_micro_batch_returns_no_view_from_the_fsdp_root(tmp_path):
    # FSDP2 warns when a wrapped module returns a view (an in-place op on it would drop the pre-backward hook): an
    # idle rank's (0, vocab) logits were a slice of the dummy token's, and every FSDP worker warned after each world
    # change that left a rank idle. A world of one over gloo, the decoder sharded as workers shard it.
    import warnings

    import torch.distributed as dist

    from flexorch.workers.fsdp import build_mesh, fill_initial, sharded_decoder
    from flexorch.workers.process_groups import ProcessGroupRegistry

    if dist.is_initialized():
        pytest.skip("a torch.distributed world is already open in this process")
    cfg = _model_cfg(_dir(tmp_path))
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    with ProcessGroupRegistry(store=store, rank=0, world_size=1, epoch=0, backend="gloo"):
        model = sharded_decoder(cfg, build_mesh("fsdp", 1, None, "cpu"))
        fill_initial(model, cfg, 0)
        empty = torch.zeros(0, dtype=torch.int64)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            logits = model(empty, empty, None)
            logits.sum().backward()
    assert logits.shape == (0, cfg.vocab_size) and logits._base is None
    assert not [w for w in caught if "view tensor" in str(w.message)], [str(w.message) for w in caught]
    assert all(p.grad is not None for p in model.parameters()), "the backward reached every FSDP unit"
