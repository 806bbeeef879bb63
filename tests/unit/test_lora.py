"""Per-task LoRA adapters (``flexorch.config.adapters``, ``flexorch.workers.lora``; Hu et al., arXiv 2106.09685).

The oracles: PEFT (``peft.get_peft_model`` with the same A and B, an implementation we did not write) on a tiny
Transformers Llama, logits and every gradient; for our decoder, a hand-written ``x A^T B^T * scale`` on one linear
map and the base decoder with the adapter merged into its weights (``W + scale * B A``); for FSDP2, the unsharded
model. Adapters start with a non-zero B in the exactness tests (with B = 0 the gradient of A is exactly 0).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import math

import pytest
import torch
import torch.nn.functional as F

from flexorch.config import ModelConfig, OptimConfig
from flexorch.config.adapters import LoraSpec, check_adapters, target_modules
from flexorch.config.model import RUN_KEYS
from flexorch.testing.reference import pack_documents
from flexorch.workers.attention.api import varlen_attn_func
from flexorch.workers.lora import active_task, adapter_tasks, initial_adapter_value, set_active_task
from flexorch.workers.model import init_model, loss_sum
from flexorch.workers.model_source import build_model, initial_parameters, set_activation_checkpointing
from flexorch.workers.optim import build_optimizer
from tests._dist_utils import DistPool

TOL = {"rtol": 1e-5, "atol": 1e-6}
OURS = (
    LoraSpec("chat", 4, 8.0, ("wq", "wv"), init_b_std=0.05),
    LoraSpec("code", 2, 3.0, ("wo", "w1", "w2"), init_b_std=0.05),
)
HF_SPECS = (
    LoraSpec("chat", 4, 8.0, ("q_proj", "v_proj"), init_b_std=0.05),
    LoraSpec("code", 2, 3.0, ("o_proj", "gate_proj", "down_proj"), init_b_std=0.05),
)
HF_SHAPE = {
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 96,
}


def _docs(seed: int, lengths=(7, 30, 1, 12), vocab: int = 257):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen) for n in lengths]


def _run(model, batch, labels: bool = False):
    attn = functools.partial(varlen_attn_func, cu_seqlens=batch.cu_seqlens, max_seqlen=batch.max_seqlen)
    return model(batch.tokens, batch.position_ids, attn, batch.labels if labels else None)


FAMILY_OPTIONS = {
    "qwen3": {"head_dim": 16},
    "phi3": {"pad_token_id": None},
    "olmo2": {"pad_token_id": None},
    "gemma3_text": {"head_dim": 16, "sliding_window": 8, "sliding_window_pattern": 2},
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "head_dim": 16},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "olmoe": {"num_experts": 4, "num_experts_per_tok": 2, "pad_token_id": None},
    "gpt_oss": {"num_local_experts": 4, "num_experts_per_tok": 2, "head_dim": 16, "pad_token_id": None},
}
"""Options of the test configs of the families beyond Llama and Qwen2 (a head size of their own, windows, experts:
their MLPs' 3-D expert weights take no adapter, their attention does)."""
MOE = ("qwen3_moe", "mixtral", "olmoe", "gpt_oss")


def _hf_dir(tmp_path, family="llama", weights=False, **extra):
    transformers = pytest.importorskip("transformers")
    options = {**HF_SHAPE, **FAMILY_OPTIONS.get(family, {}), **extra}
    conf = transformers.AutoConfig.for_model(family, **options)
    d = tmp_path / f"{family}{'-w' if weights else ''}"
    if weights:
        torch.manual_seed(1)
        transformers.AutoModelForCausalLM.from_config(conf).save_pretrained(d)
    else:
        conf.save_pretrained(d)
    return d


def _hf_cfg(d, **changes) -> ModelConfig:
    from flexorch.config.hf import hf_model_config

    return ModelConfig.from_dict({**hf_model_config(str(d)), **changes})


def _shapes(model):
    return [(n, tuple(p.shape)) for n, p in model.named_parameters()]


# ------------------------------------------------------------------ the config: specs, round trip, bad input


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"task": "my-task"}, "LoraSpec.task must be a name like 'chat'.*'my-task'"),
        ({"rank": 0}, r"task='chat'\): rank must be an integer >= 1, got 0"),
        ({"rank": True}, "rank must be an integer >= 1, got True"),
        ({"alpha": 0}, "alpha must be a finite number > 0, got 0"),
        ({"alpha": math.inf}, "alpha must be a finite number > 0"),
        ({"targets": ()}, "targets must be a non-empty list of module names"),
        ({"targets": "wq"}, "targets must be a non-empty list"),
        ({"targets": ("wq", "wv", "wq")}, r"name \['wq'\] more than once"),
        ({"init_b_std": -1.0}, "init_b_std must be a finite number >= 0"),
    ],
)
def test_a_bad_spec_names_the_field_and_its_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LoraSpec(**{"task": "chat", "rank": 4, "alpha": 8.0, "targets": ("wq",), **kwargs})


def test_an_unknown_target_or_a_task_twice_is_refused_with_the_fix():
    bad = LoraSpec("code", 4, 8.0, ("wq", "qproj"))
    with pytest.raises(
        ValueError,
        match=r"task 'code': unknown LoRA target module 'qproj'; this model's decoder "
        r"layers have wq, wk, wv, wo, w1, w2, w3 \(set \[\[tasks\]\] lora_targets",
    ):
        ModelConfig(adapters=(bad,))
    twice = (LoraSpec("code", 4, 8.0, ("wq",)), LoraSpec("code", 2, 2.0, ("wv",)))
    with pytest.raises(ValueError, match="task 'code' has more than one adapter"):
        ModelConfig(adapters=twice)
    with pytest.raises(ValueError, match="unknown LoRA target module 'q_proj'"):
        check_adapters(ModelConfig(), (LoraSpec("chat", 1, 1.0, ("q_proj",)),))
    with pytest.raises(ValueError, match="adapters must be a list of LoRA adapters"):
        ModelConfig(adapters="chat")
    with pytest.raises(ValueError, match="unknown LoraSpec keys"):
        ModelConfig(adapters=[{"task": "chat", "rank": 1, "alpha": 1.0, "targets": ["wq"], "dropout": 0.1}])
    with pytest.raises(ValueError, match="base_trainable must be true or false, got 'no'"):
        ModelConfig(base_trainable="no")


def test_the_config_round_trips_through_json_and_adapters_are_the_models_shape():
    cfg = ModelConfig(adapters=OURS, base_trainable=False)
    back = ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert back == cfg and hash(back) == hash(cfg)
    assert back.adapters == OURS and isinstance(back.adapters, tuple) and isinstance(back.adapters[0].targets, tuple)
    assert ModelConfig(adapters=[s.to_dict() for s in OURS]).adapters == OURS  # a list of dicts is converted
    assert OURS[0].scale == 2.0 and OURS[1].scale == 1.5
    assert not {"adapters", "base_trainable"} & RUN_KEYS
    assert dataclasses.replace(ModelConfig(), adapters=OURS[:1]).adapters == OURS[:1]


# ------------------------------------------------------------------ shapes, order, initial values


@pytest.mark.parametrize("tied", [False, True])
def test_param_shapes_are_the_built_models_named_parameters_ours(tied):
    cfg = ModelConfig(adapters=OURS, tie_embeddings=tied, num_layers=3)
    model = init_model(cfg, 0)
    assert cfg.param_shapes() == _shapes(model)
    assert cfg.num_params() == sum(p.numel() for p in model.parameters())
    base = ModelConfig(tie_embeddings=tied, num_layers=3)
    assert [e for e in cfg.param_shapes() if ".lora." not in e[0]] == base.param_shapes()
    assert ("layers.2.lora.code.w2.A", (2, 172)) in cfg.param_shapes()
    assert ("layers.2.lora.code.w2.B", (64, 2)) in cfg.param_shapes()
    assert adapter_tasks(model) == ("chat", "code") and adapter_tasks(init_model(base, 0)) == ()


@pytest.mark.parametrize("family,tied", [("llama", False), ("qwen2", True)])
def test_param_shapes_are_the_built_models_named_parameters_hf(tmp_path, family, tied):
    from torch import nn

    from flexorch.workers.model_source import meta_model

    cfg = _hf_cfg(_hf_dir(tmp_path, family, tie_word_embeddings=tied), adapters=HF_SPECS)
    model = build_model(cfg, 3)  # meta_hf_decoder checks the names against param_shapes itself
    assert cfg.param_shapes() == _shapes(model)
    assert cfg.num_params() == sum(p.numel() for p in model.parameters())
    assert ("model.layers.1.lora.code.down_proj.A", (2, 48)) in cfg.param_shapes()
    # target_modules (pure, from the parameter list) are the nn.Linear leaves Transformers builds in a layer
    layer = meta_model(dataclasses.replace(cfg, adapters=())).layers[0]
    linears = tuple(n.rsplit(".", 1)[-1] for n, m in layer.named_modules() if isinstance(m, nn.Linear))
    assert (
        target_modules(cfg) == linears == ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    )
    with pytest.raises(ValueError, match="unknown LoRA target module 'wq'; this model's decoder layers have q_proj"):
        dataclasses.replace(cfg, adapters=OURS)


def _check_adapter_values(params: dict, specs, seed: int) -> None:
    b_std = {s.task: s.init_b_std for s in specs}
    for name, p in params.items():
        if ".lora." not in name:
            continue
        task = name.split(".lora.")[1].split(".")[0]
        assert torch.equal(p.detach(), initial_adapter_value(name, p.shape, seed, b_std[task])), name
        if name.endswith(".A"):
            bound = 1 / math.sqrt(p.shape[1])  # PEFT: kaiming_uniform_(a=sqrt(5)) = U(-1/sqrt(in), 1/sqrt(in))
            assert p.abs().max() <= bound and p.abs().max() > 0.8 * bound and p.std() > 0.4 * bound, name
        elif b_std[task] == 0:
            assert not p.any(), name


def test_adapters_leave_the_base_init_bitwise_unchanged_and_their_own_init_is_deterministic():
    specs = (OURS[0], dataclasses.replace(OURS[1], init_b_std=0.0))
    base = dict(init_model(ModelConfig(), 7).named_parameters())
    cfg = ModelConfig(adapters=specs)
    with_adapters = dict(init_model(cfg, 7).named_parameters())
    again = dict(init_model(cfg, 7).named_parameters())
    assert all(torch.equal(p, with_adapters[n]) for n, p in base.items())
    assert all(torch.equal(p, again[n]) for n, p in with_adapters.items())
    _check_adapter_values(with_adapters, specs, 7)
    assert with_adapters["layers.0.lora.chat.wq.B"].abs().max() > 0  # init_b_std > 0
    a0, a1 = with_adapters["layers.0.lora.chat.wq.A"], with_adapters["layers.1.lora.chat.wq.A"]
    assert not torch.equal(a0, a1)  # every (task, layer, target) has its own stream
    other = dict(init_model(cfg, 8).named_parameters())
    assert not torch.equal(other["layers.0.lora.chat.wq.A"], a0)
    # a sharded worker's rows (model_source.initial_parameters with rows) are rows of the whole values
    rows = {n: (1, 3) for n in with_adapters}
    for name, value in initial_parameters(cfg, 7, cfg.param_shapes(), rows.get):
        assert torch.equal(value, with_adapters[name][1:3].detach()), name


def test_hf_adapters_leave_the_base_init_unchanged_and_are_generated_beside_safetensors_weights(tmp_path):
    d = _hf_dir(tmp_path, "llama")
    base = dict(build_model(_hf_cfg(d), 5).named_parameters())
    cfg = _hf_cfg(d, adapters=HF_SPECS)
    ours = dict(build_model(cfg, 5).named_parameters())
    assert all(torch.equal(p, ours[n]) for n, p in base.items())
    _check_adapter_values(ours, HF_SPECS, 5)
    from safetensors.torch import load_file

    w = _hf_dir(tmp_path, "llama", weights=True)
    saved = load_file(w / "model.safetensors")
    cfg = _hf_cfg(w, adapters=HF_SPECS)
    assert cfg.hf_weights
    loaded = dict(build_model(cfg, 5).named_parameters())
    for name, p in loaded.items():
        want = saved[name].float() if ".lora." not in name else ours[name]
        assert torch.equal(p.detach(), want.detach()), name
    rows = {n: (0, 1) for n in loaded}
    for name, value in initial_parameters(cfg, 5, cfg.param_shapes(), rows.get):
        assert torch.equal(value, loaded[name][:1].detach()), name


# ------------------------------------------------------------------ the forward: our decoder


def test_one_linear_map_against_a_hand_written_update():
    model = init_model(ModelConfig(adapters=OURS), 0)
    wq = model.layers[1].attention.wq
    a, b = model.layers[1].lora.chat.wq.A, model.layers[1].lora.chat.wq.B
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    assert active_task(model) is None
    assert torch.equal(wq(x), F.linear(x, wq.weight))
    set_active_task(model, "chat")
    assert active_task(model) == "chat"
    torch.testing.assert_close(wq(x), x @ wq.weight.T + (x @ a.T @ b.T) * (8.0 / 4), **TOL)
    set_active_task(model, "code")  # code has no adapter on wq
    assert torch.equal(wq(x), F.linear(x, wq.weight))
    set_active_task(model, "none_such")  # a task without adapters: the base
    assert torch.equal(wq(x), F.linear(x, wq.weight))
    with pytest.raises(ValueError, match="a task name or None"):
        set_active_task(model, 3)


def _merged(cfg: ModelConfig, model, spec: LoraSpec):
    """The base decoder with ``spec``'s adapter merged into its weights: W + scale * B A (Hu et al. §4.1)."""
    base = init_model(dataclasses.replace(cfg, adapters=()), 0)
    with torch.no_grad():
        for i, layer in enumerate(base.layers):
            for t in spec.targets:
                linear = getattr(layer.feed_forward if t in ("w1", "w2", "w3") else layer.attention, t)
                ad = model.layers[i].lora[spec.task][t]
                linear.weight += spec.scale * ad.B @ ad.A  # (out, r) @ (r, in) -> (out, in)
    return base


def test_the_lora_decoder_equals_the_base_decoder_with_the_adapter_merged():
    cfg = ModelConfig(adapters=OURS)
    model = init_model(cfg, 0)
    batch = pack_documents(_docs(0))
    for spec in OURS:
        set_active_task(model, spec.task)
        torch.testing.assert_close(_run(model, batch), _run(_merged(cfg, model, spec), batch), **TOL)
    set_active_task(model, None)
    assert torch.equal(_run(model, batch), _run(init_model(ModelConfig(), 0), batch))


def test_with_b_zero_every_task_computes_the_base_model_exactly():
    specs = tuple(dataclasses.replace(s, init_b_std=0.0) for s in OURS)
    model = init_model(ModelConfig(adapters=specs), 0)
    batch = pack_documents(_docs(1))
    want = _run(init_model(ModelConfig(), 0), batch)
    for task in (None, "chat", "code"):
        set_active_task(model, task)
        assert torch.equal(_run(model, batch), want), task


def _grads(model) -> dict:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recomputed_layers_apply_the_active_tasks_adapter(mode):
    cfg = ModelConfig(adapters=OURS)
    batch = pack_documents(_docs(2))
    plain, again = init_model(cfg, 0), init_model(cfg, 0)
    set_activation_checkpointing(again, mode)
    for task in ("chat", "code"):
        for m in (plain, again):
            m.zero_grad(set_to_none=True)
            set_active_task(m, task)
            _run(m, batch, labels=True).backward()  # the backward (and the recompute) right after the forward
        want, got = _grads(plain), _grads(again)
        assert sorted(want) == sorted(got) and any(f".lora.{task}." in n for n in got)
        assert not any(".lora." in n and f".lora.{task}." not in n for n in got)  # the other task: no gradient
        for n in want:
            torch.testing.assert_close(got[n], want[n], **TOL, msg=n)


def test_a_frozen_base_trains_only_the_adapters():
    cfg = ModelConfig(adapters=OURS, base_trainable=False)
    model = init_model(cfg, 0)
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    assert flags == {n: ".lora." in n for n, _ in cfg.param_shapes()}
    set_active_task(model, "code")
    _run(model, pack_documents(_docs(3)), labels=True).backward()
    assert sorted(_grads(model)) == sorted(n for n in flags if ".lora.code." in n)
    optimizer, _ = build_optimizer(model, OptimConfig())
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    assert held == {id(p) for n, p in model.named_parameters() if ".lora." in n}
    assert all(p.requires_grad for p in init_model(dataclasses.replace(cfg, base_trainable=True), 0).parameters())


def test_calibration_probes_a_frozen_base_through_the_costliest_adapter_and_restore_the_task():
    """A probe's backward needs a gradient: with the base frozen it must run through an adapter (seen on
    2026-11-27: `flexorch train` of three tasks failed every probe with "element 0 of tensors does not require
    grad"); the adapter with the most parameters is the one probed, so the time includes the costliest."""
    from flexorch.workers.calibrate import Probe, run_probes
    from flexorch.workers.lora import probing_task

    model = init_model(ModelConfig(adapters=OURS, base_trainable=False), 0)
    set_active_task(model, None)
    with pytest.raises(RuntimeError, match="does not require grad"):
        run_probes(model, [Probe(1, "ulysses", (9, 5), repeats=1)], 0, 1, None, None, 257)
    set_active_task(model, "chat")
    with probing_task(model) as chosen:
        assert chosen == active_task(model) == "code"  # wo, w1, w2 at rank 2 outweigh wq, wv at rank 4
        (ms,) = run_probes(model, [Probe(1, "ulysses", (9, 5), repeats=1)], 0, 1, None, None, 257)
    assert ms > 0 and active_task(model) == "chat"
    with probing_task(init_model(ModelConfig(), 0)) as none:
        assert none is None


def test_a_deep_copy_applies_its_own_adapters():
    model = init_model(ModelConfig(adapters=OURS), 0)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for layer in twin.layers:
            for adapter in layer.lora.chat.values():
                adapter.B.zero_()  # the copy's chat adapter only
    set_active_task(model, "chat")
    assert active_task(twin) is None  # the copy has its own active task
    set_active_task(twin, "chat")
    batch = pack_documents(_docs(4))
    assert torch.equal(_run(twin, batch), _run(init_model(ModelConfig(), 0), batch))
    assert not torch.equal(_run(model, batch), _run(twin, batch))


@pytest.mark.slow
def test_a_compiled_layer_follows_the_active_task():
    # workers compile each layer's body (flexorch.workers.compile); the hook reads the active task, which the
    # compiled graph guards on, so a change of task runs the right graph (aot_eager: no C++ compiler needed)
    torch._dynamo.reset()
    cfg = ModelConfig(adapters=OURS)
    model, eager = init_model(cfg, 0), init_model(cfg, 0)
    for layer in model.layers:
        layer._forward = torch.compile(layer._forward, backend="aot_eager")
    batch = pack_documents(_docs(5))
    for task in ("chat", None, "code", "chat"):
        set_active_task(model, task)
        set_active_task(eager, task)
        torch.testing.assert_close(_run(model, batch), _run(eager, batch), **TOL)


# ------------------------------------------------------------------ the oracle: PEFT on a Transformers Llama


def _peft_twin(cfg: ModelConfig, ours, specs):
    """A Transformers Llama with ``ours``' base weights and PEFT adapters holding ``ours``' A and B, flexorch's
    attention in both (so only LoRA differs); the base trains too, so every gradient is compared."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    from flexorch.workers.hf_model import hf_config

    lm = transformers.AutoModelForCausalLM.from_config(hf_config(cfg), dtype=torch.float32)
    missing, _ = lm.load_state_dict({k: v for k, v in ours.state_dict().items() if ".lora." not in k}, strict=False)
    assert set(missing) <= ({"lm_head.weight"} if cfg.tie_embeddings else set()), missing
    twin = None
    for s in specs:
        conf = peft.LoraConfig(
            r=s.rank, lora_alpha=s.alpha, target_modules=list(s.targets), lora_dropout=0.0, init_lora_weights=False
        )
        if twin is None:
            twin = peft.get_peft_model(lm, conf, adapter_name=s.task)
        else:
            twin.add_adapter(s.task, conf)
    theirs = dict(twin.named_parameters())
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if ".lora." in name:
                theirs[_their_name(name, theirs)].copy_(p)
    return twin, theirs


def _their_name(name: str, theirs: dict) -> str:
    """PEFT's name of our parameter ``name``: a target's base weight (and bias) moves to ``<target>.base_layer.*``."""
    if ".lora." not in name:
        plain = f"base_model.model.{name}"
        module, _, leaf = plain.rpartition(".")
        return plain if plain in theirs else f"{module}.base_layer.{leaf}"
    layer, _, rest = name.partition(".lora.")  # model.layers.0 / chat.q_proj.A
    task, target, which = rest.split(".")
    (match,) = [
        n
        for n in theirs
        if n.startswith(f"base_model.model.{layer}.") and n.endswith(f".{target}.lora_{which}.{task}.weight")
    ]
    return match


def _backward_equals_peft(ours, twin, theirs, batch) -> dict:
    """Forward and backward of ``ours`` (its active task) and of its PEFT ``twin`` (its active adapter) on
    ``batch``: the logits and every gradient of ours equal theirs; returns our gradients by name."""
    attn = functools.partial(varlen_attn_func, cu_seqlens=batch.cu_seqlens, max_seqlen=batch.max_seqlen)
    logits = _run(ours, batch)
    ref = twin(
        input_ids=batch.tokens[None], position_ids=batch.position_ids[None], flexorch_attn=attn, use_cache=False
    ).logits[0]
    torch.testing.assert_close(logits, ref, **TOL)
    loss_sum(logits, batch.labels).backward()
    loss_sum(ref, batch.labels).backward()
    got = _grads(ours)
    for name, g in got.items():
        torch.testing.assert_close(g, theirs[_their_name(name, theirs)].grad, rtol=1e-5, atol=1e-7, msg=name)
    return got


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_hf_adapters_equal_peft_logits_and_gradients_for_each_task(tmp_path, recompute):
    cfg = _hf_cfg(_hf_dir(tmp_path, "llama"), adapters=HF_SPECS)
    ours = build_model(cfg, 0).train()
    set_activation_checkpointing(ours, recompute)
    twin, theirs = _peft_twin(cfg, ours, HF_SPECS)
    twin.train()
    batch = pack_documents(_docs(6, (7, 30, 1, 12), vocab=96))
    for task in ("chat", "code"):
        set_active_task(ours, task)
        twin.set_adapter(task)
        for p in twin.parameters():  # set_adapter freezes all but the active adapter: train the base too
            p.requires_grad_(True)
            p.grad = None
        ours.zero_grad(set_to_none=True)
        got = _backward_equals_peft(ours, twin, theirs, batch)
        assert any(f".lora.{task}." in n for n in got)
        assert not any(".lora." in n and f".lora.{task}." not in n for n in got)
        other = "code" if task == "chat" else "chat"
        assert all(p.grad is None or not p.grad.any() for n, p in theirs.items() if f"lora_A.{other}." in n)


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")  # inside PEFT
@pytest.mark.parametrize("family", list(FAMILY_OPTIONS))
def test_every_familys_projections_take_adapters_equal_to_peft(tmp_path, family):
    """An adapter on every linear map of a decoder layer of each family (Phi-3's fused qkv_proj and gate_up_proj
    included): logits and every gradient equal PEFT's on the same Transformers model."""
    from flexorch.config.adapters import target_modules

    plain = _hf_cfg(_hf_dir(tmp_path, family))
    targets = target_modules(plain)
    assert ("qkv_proj" in targets) == (family == "phi3") and "o_proj" in targets
    assert ("down_proj" in targets) != (family in MOE) and "gate" not in targets and "router" not in targets
    specs = (LoraSpec("chat", 2, 4.0, targets, init_b_std=0.05),)
    cfg = _hf_cfg(plain.hf, adapters=specs)
    ours = build_model(cfg, 0).train()
    twin, theirs = _peft_twin(cfg, ours, specs)
    twin.train()
    for p in twin.parameters():
        p.requires_grad_(True)
    set_active_task(ours, "chat")
    got = _backward_equals_peft(ours, twin, theirs, pack_documents(_docs(6, (7, 30, 1, 12), vocab=96)))
    assert {n.split(".")[-2] for n in got if ".lora." in n} == set(targets)


# ------------------------------------------------------------------ FSDP2: a world of two gloo processes


def _sharded_job(ctx, cfg_dict, docs_per_rank, tasks):
    """Rank r runs task ``tasks[r]`` on ``docs_per_rank[r]`` with the decoder sharded over both ranks, one AdamW
    step; returns the gathered gradients, the gathered parameters after the step and the trainable names."""
    from flexorch.workers import fsdp

    torch.manual_seed(100 + ctx.rank)  # a dependence on the global RNG would make the ranks disagree
    cfg = ModelConfig.from_dict(cfg_dict)
    with ctx.registry():
        model = fsdp.sharded_decoder(cfg, fsdp.build_mesh("fsdp", 2, None, "cpu"), recompute="full")
        fsdp.fill_initial(model, cfg, 0)
        optimizer, _ = build_optimizer(model, OptimConfig(lr=1e-2), foreach=True)
        held = sorted(
            n for n, p in model.named_parameters() if any(p is q for g in optimizer.param_groups for q in g["params"])
        )
        set_active_task(model, tasks[ctx.rank])
        _run(model, pack_documents(docs_per_rank[ctx.rank]), labels=True).backward()
        grads = {n: p.grad.full_tensor().numpy().copy() for n, p in model.named_parameters() if p.requires_grad}
        optimizer.step()
        params = dict(fsdp.gathered_parameters(model))
        trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    return grads, params, trainable, held


@pytest.fixture(scope="module")
def pool():
    p = DistPool(2)
    yield p
    p.close()


@pytest.mark.slow
def test_fsdp2_sharded_adapters_with_a_frozen_base_equal_the_unsharded_model(pool):
    cfg = ModelConfig(adapters=OURS, base_trainable=False)
    docs = [_docs(7, (9, 20)), _docs(8, (14, 3, 11))]
    tasks = ("chat", "code")  # each rank runs another task: the other task's adapter gets zeros there
    out = pool.run(_sharded_job, cfg.to_dict(), docs, tasks)
    model = init_model(cfg, 0)
    optimizer, _ = build_optimizer(model, OptimConfig(lr=1e-2))
    for rank, task in enumerate(tasks):
        set_active_task(model, task)
        _run(model, pack_documents(docs[rank]), labels=True).backward()
    want = {n: p.grad.clone() if p.grad is not None else torch.zeros_like(p) for n, p in model.named_parameters()}
    optimizer.step()
    adapters = sorted(n for n, _ in cfg.param_shapes() if ".lora." in n)
    for grads, params, trainable, held in out:
        assert trainable == adapters and held == adapters
        assert sorted(grads) == adapters
        for n, g in grads.items():
            torch.testing.assert_close(torch.from_numpy(g), want[n], rtol=1e-5, atol=1e-7, msg=n)
        for n, p in model.named_parameters():
            torch.testing.assert_close(torch.from_numpy(params[n]), p.detach(), rtol=1e-5, atol=1e-6, msg=n)
