"""Hugging Face models trained by `flexorch train` match Transformers' own attention in one process.

Tiny random configs of every family (grouped-query attention; Qwen2 with q/k/v biases and tied embeddings; Qwen3
with a head size other than hidden / heads and q/k norms; Phi-3's fused projections; OLMo 2's norms; Gemma 3's
sliding-window layers beside a global one; Mistral windowed on every layer; Llama 3's scaled RoPE past its original
context; Qwen3-MoE, Mixtral and GPT-OSS with 4 experts, 2 per token, and their router loss over the whole global
batch, GPT-OSS with its attention sinks) are trained 3 steps on 4 real Ray workers with adaptive plans (Ulysses and
zigzag-ring groups, a 256-token document four times one worker's 64-token budget, longer than the windows). The
oracle is not flexorch code: the same Transformers class built with ``attn_implementation="sdpa"`` or ``"eager"``,
run in ONE process on each step's documents one at a time (so the masks are the family's own: causal, and its
sliding windows), its loss summed over the predicted tokens (an MoE model's plus its own
``load_balancing_loss_func`` over every document's router logits), then the same AdamW. Per-step losses and the
final parameters must agree at fp32 tolerances, under replicated and FSDP2-sharded model state.
"""

from __future__ import annotations

import dataclasses
import sys

import numpy as np
import pytest
import torch

from flexorch.config import ConfigError, CorpusConfig, ModelConfig, config_from_dict
from flexorch.config.hf import hf_model_config
from flexorch.config.sharding import ShardingSettings
from tests.train_helpers import assert_params_close, run_driver, train_config, training_env

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow

SHAPE = {"hidden_size": 64, "intermediate_size": 172, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 320}  # fmt: skip


_LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 64}  # fmt: skip
VARIANTS = {
    "llama-rope": ("llama", {"rope_scaling": _LLAMA3}),  # the 256-token document: 4x the original context
    "mistral": ("mistral", {"sliding_window": 48}),
    "qwen3": ("qwen3", {"head_dim": 32}),  # 4 heads of 32 on a hidden size of 64
    "phi3": ("phi3", {"pad_token_id": None}),
    "olmo2": ("olmo2", {"pad_token_id": None}),
    "gemma3_text": ("gemma3_text", {"head_dim": 16, "sliding_window": 40, "sliding_window_pattern": 2}),
    "qwen3_moe": ("qwen3_moe", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                "output_router_logits": True, "router_aux_loss_coef": 0.1}),
    "mixtral": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2,
                            "output_router_logits": True, "router_aux_loss_coef": 0.1}),
    "gpt_oss": ("gpt_oss", {"num_local_experts": 4, "num_experts_per_tok": 2, "head_dim": 16, "sliding_window": 40,
                            "pad_token_id": None, "output_router_logits": True, "router_aux_loss_coef": 0.1}),
}  # fmt: skip
"""Test models beyond plain Llama and Qwen2: name -> (model_type, config options beyond SHAPE)."""


def write_model_dir(path, family: str, **extra):
    """A random-init model directory as ``save_pretrained`` writes it (config.json only); ``family``: a model_type
    or a name in ``VARIANTS``."""
    family, options = VARIANTS.get(family, (family, {}))
    transformers.AutoConfig.for_model(family, **{**SHAPE, **options, **extra}).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    yield from training_env(tmp_path_factory, "hf")


def _cfg(env, name, model_dir, **kw):
    root, corpus_dir, profile, _ = env
    # the head and loss in chunks of 24 tokens, as tests.train_helpers' own model: checked against the plain loss
    model = ModelConfig.from_dict({**hf_model_config(str(model_dir)), "loss_chunk_tokens": 24})
    data = CorpusConfig(source=str(corpus_dir), max_context=256, tokenizer="byte")
    return train_config(corpus_dir, root / name, profile, model=model, data=data, **kw)


def oracle_train(cfg, batches, impl: str, start: dict | None = None, aux: list | None = None):
    """Transformers' own model and attention (``impl``) in one process, on each step's documents one at a time (the
    masks it builds: causal, and the family's sliding windows); starts from ``start`` (default: flexorch's initial
    parameters, which the test of weight loading checks on their own), trains with the run's AdamW. An MoE model
    that trains its router loss adds ``router_aux_loss_coef`` times Transformers' ``load_balancing_loss_func`` over
    the router logits of all the step's documents (appended to ``aux``); the losses returned are the cross-entropy.
    Returns (losses, parameters)."""
    from flexorch.testing.reference import pack_documents
    from flexorch.workers.model_source import build_model
    from flexorch.workers.optim import build_optimizer

    conf = transformers.AutoConfig.from_pretrained(cfg.model.hf, local_files_only=True)
    model = transformers.AutoModelForCausalLM.from_config(conf, attn_implementation=impl, dtype=torch.float32)
    if start is None:
        start = build_model(cfg.model, cfg.seed).state_dict()
    else:
        start = {n: torch.as_tensor(v) for n, v in start.items()}
    missing, unexpected = model.load_state_dict(start, strict=False)
    assert not unexpected and set(missing) <= ({"lm_head.weight"} if cfg.model.tie_embeddings else set())
    optimizer, scheduler = build_optimizer(model, cfg.optim)
    losses = []
    for docs in batches:
        b = pack_documents(docs)
        optimizer.zero_grad(set_to_none=True)
        ids = [torch.as_tensor(d, dtype=torch.long) for d in docs]
        outs = [model(input_ids=d[None], output_router_logits=bool(cfg.model.router_aux_coef) or None) for d in ids]
        logits = torch.cat([o.logits[0] for o in outs])  # (T, vocab) in the packed order
        loss = torch.nn.functional.cross_entropy(logits.float(), b.labels, reduction="sum") / b.n_predicted
        objective = loss
        if cfg.model.router_aux_coef:  # every document's router logits, layer by layer, into one loss
            per_layer = tuple(torch.cat(layer) for layer in zip(*(o.router_logits for o in outs), strict=True))
            lbl = sys.modules[type(model).__module__].load_balancing_loss_func  # the family's own
            step_aux = lbl(per_layer, cfg.model.num_experts, cfg.model.experts_per_token)
            aux.append(float(step_aux.detach()))
            objective = loss + cfg.model.router_aux_coef * step_aux
        objective.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        optimizer.step()
        scheduler.step()
        losses.append(float(loss.detach()))
    state = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
    return losses, state


@pytest.mark.parametrize(
    "family,mode,impl,recompute",
    [("llama", "replicate", "sdpa", "none"), ("qwen2", "replicate", "eager", "none"),
     ("llama", "fsdp", "sdpa", "full"), ("qwen2", "fsdp", "sdpa", "selective"), ("llama", "fsdp", "sdpa", "auto"),
     ("qwen3", "fsdp", "sdpa", "none"), ("phi3", "replicate", "sdpa", "none"), ("olmo2", "fsdp", "eager", "selective"),
     ("gemma3_text", "replicate", "eager", "none"), ("gemma3_text", "fsdp", "sdpa", "full"),
     ("mistral", "fsdp", "sdpa", "none"), ("llama-rope", "replicate", "sdpa", "none"),
     ("qwen3_moe", "fsdp", "sdpa", "none"), ("mixtral", "replicate", "sdpa", "selective"),
     ("gpt_oss", "fsdp", "eager", "none")],
)  # fmt: skip
def test_hf_model_steps_equal_transformers_own_attention_in_one_process(env, tmp_path, family, mode, impl, recompute):
    tied = family in ("qwen2", "gemma3_text")
    model_dir = write_model_dir(tmp_path / family, family, tie_word_embeddings=tied)
    sharding = ShardingSettings(mode=mode, activation_checkpointing=recompute)
    cfg = _cfg(env, f"{family}-{mode}", model_dir, sharding=sharding)
    assert (cfg.model.family, cfg.model.tie_embeddings) == (VARIANTS.get(family, (family,))[0], tied)
    assert cfg.model.qkv_bias == (family in ("qwen2", "gpt_oss"))  # GPT-OSS: attention_bias by default
    corpus = env[3]
    records, replicas = run_driver(cfg, corpus)
    assert len(records) == 3
    groups = [(g["kind"], g["degree"]) for r in records for mb in r["plan"]["micro_batches"] for g in mb]
    assert any(k == "ring" and d > 1 for k, d in groups) or any(k == "ulysses" and d > 1 for k, d in groups)
    assert max(d for _, d in groups) == 4, "the 256-token document needs all 4 workers"
    if recompute == "auto":  # the GPU default: no recompute, the MLPs or whole layers per group, as it fits
        for r in records:  # which modes run depends on the packing the measured times pick (2 busy cores here)
            assert [len(row) for row in r["recompute"]] == [len(mb) for mb in r["plan"]["micro_batches"]]
            assert {m for row in r["recompute"] for m in row} <= {"none", "selective", "full"}, r["recompute"]
    if cfg.model.attention_window is not None:  # the windows matter: some document is longer
        assert max(len(d) for r in records for d in corpus.get_tokens(r["doc_ids"])) > cfg.model.attention_window
    batches = [corpus.get_tokens(r["doc_ids"]) for r in records]
    aux = []
    losses, params = oracle_train(cfg, batches, impl, aux=aux)
    assert [r["loss"] for r in records] == pytest.approx(losses, rel=1e-5, abs=1e-6)
    assert [r.get("router_aux_loss") for r in records] == (pytest.approx(aux, rel=1e-5) if aux else [None] * 3)
    assert bool(aux) == bool(cfg.model.router_aux_coef) and all(r.get("router_ms", 0) >= 0 for r in records)
    assert_params_close(replicas, params)


def test_ring_and_ulysses_groups_both_run_an_hf_model(env, tmp_path):
    """Static layouts force each SP method over all 4 workers for the same steps: both equal the oracle."""
    model_dir = write_model_dir(tmp_path / "llama", "llama")
    corpus = env[3]
    for mode in ("static-ulysses-4", "static-ring-4"):
        cfg = _cfg(env, mode, model_dir, plan={"mode": mode}, steps=2)
        records, replicas = run_driver(cfg, corpus)
        kinds = {(g["kind"], g["degree"]) for r in records for mb in r["plan"]["micro_batches"] for g in mb}
        assert kinds == {(mode.split("-")[1], 4)}
        losses, params = oracle_train(cfg, [corpus.get_tokens(r["doc_ids"]) for r in records], "sdpa")
        assert [r["loss"] for r in records] == pytest.approx(losses, rel=1e-5, abs=1e-6)
        assert_params_close(replicas, params)


def test_hf_models_refuse_pipeline_stages_and_unknown_keys(tmp_path):
    model_dir = write_model_dir(tmp_path / "llama", "llama")
    base = {"model": {"hf": str(model_dir)}, "data": {"tokenizer": "byte"}, "workers": 4}
    with pytest.raises(ConfigError, match="pipeline stages cut its own decoder"):
        config_from_dict({**base, "pipeline": {"stages": 2}})
    with pytest.raises(ConfigError, match="remove \\['dim'\\]"):
        config_from_dict({**base, "model": {"hf": str(model_dir), "dim": 32}})
    cfg = config_from_dict(base)
    assert config_from_dict(cfg.to_dict()).model == cfg.model  # a saved config reads back without the directory
    assert dataclasses.replace(cfg.model).num_params() == sum(np.prod(s) for _, s in cfg.model.param_shapes())


def _train_and_checkpoint(cfg, corpus, steps: int = 2):
    from flexorch.control.driver import TrainingDriver

    driver = TrainingDriver(cfg, corpus=corpus)
    try:
        driver.setup()
        records = [driver.step().record for _ in range(steps)]
        return records, driver.checkpoint()
    finally:
        driver.shutdown()


def _flexorch_logits(model_cfg, state, docs):
    """Logits of flexorch's HFDecoder (single-device varlen attention) holding ``state`` on the packed ``docs``."""
    import functools

    from flexorch.testing.reference import pack_documents
    from flexorch.workers.attention.api import varlen_attn_func
    from flexorch.workers.model_source import build_model

    model = build_model(model_cfg, 0)
    model.load_state_dict(state)
    b = pack_documents(docs)
    attn = functools.partial(varlen_attn_func, cu_seqlens=b.cu_seqlens, max_seqlen=b.max_seqlen)
    with torch.no_grad():
        return model(b.tokens, b.position_ids, attn)


@pytest.mark.parametrize("family,mode", [("llama", "fsdp"), ("qwen2", "replicate")])
def test_export_loads_with_from_pretrained_and_training_continues_from_it(env, tmp_path, family, mode):
    """`flexorch export` writes a directory Transformers loads (same logits as flexorch's model), and that directory
    is a model source with weights: a run from it starts at exactly the exported parameters, loaded shard by
    shard under FSDP."""
    from flexorch.cli.main import main
    from flexorch.control.checkpoint_export import consolidated_state

    model_dir = write_model_dir(tmp_path / family, family, tie_word_embeddings=family == "qwen2")
    cfg = _cfg(env, f"export-{family}", model_dir, sharding=ShardingSettings(mode=mode))
    corpus = env[3]
    _, ckpt = _train_and_checkpoint(cfg, corpus)
    out = tmp_path / "exported"
    assert main(["export", str(ckpt), str(out)]) == 0
    assert {"config.json", "model.safetensors"} <= {p.name for p in out.iterdir()}
    trained = consolidated_state(ckpt)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="sdpa", local_files_only=True)
    docs = corpus.get_tokens(list(range(6)))
    with torch.no_grad():
        theirs = torch.cat([loaded(input_ids=torch.as_tensor(d, dtype=torch.long)[None]).logits[0] for d in docs])
    ours = _flexorch_logits(cfg.model, trained, docs)
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)
    assert not any(torch.equal(trained[n], t) for n, t in _flexorch_start(cfg).items() if t.dim() == 2)

    again = _cfg(env, f"from-export-{family}", out, sharding=ShardingSettings(mode=mode), steps=1)
    assert again.model.hf_weights and again.model.hf == str(out.resolve())
    records, replicas = run_driver(again, corpus)
    start = {n: t.numpy() for n, t in trained.items()}
    losses, params = oracle_train(again, [corpus.get_tokens(r["doc_ids"]) for r in records], "sdpa", start=start)
    assert [r["loss"] for r in records] == pytest.approx(losses, rel=1e-5, abs=1e-6)
    assert_params_close(replicas, params)


def _flexorch_start(cfg) -> dict:
    from flexorch.workers.model_source import build_model

    return build_model(cfg.model, cfg.seed).state_dict()


def test_the_planner_offers_only_ulysses_degrees_that_divide_the_models_heads(env, tmp_path):
    """6 query heads: Ulysses of degree 4 cannot split them, so the 256-token document that needs all 4 workers
    runs on a zigzag ring; Ulysses pairs (6 % 2 == 0) stay allowed. The run still equals the oracle."""
    import json

    model_dir = write_model_dir(tmp_path / "llama6", "llama", hidden_size=96, num_attention_heads=6)
    profile = json.loads(env[2].read_text())
    (tmp_path / "profile.json").write_text(json.dumps({**profile, "hidden": 96, "num_heads": 6}))
    cfg = _cfg(env, "six-heads", model_dir, steps=2, plan={"profile": str(tmp_path / "profile.json")})
    assert (cfg.model.num_heads, cfg.model.num_kv_heads) == (6, 2)
    corpus = env[3]
    records, replicas = run_driver(cfg, corpus)
    groups = {(g["kind"], g["degree"]) for r in records for mb in r["plan"]["micro_batches"] for g in mb}
    assert ("ring", 4) in groups and ("ulysses", 4) not in groups, groups
    losses, params = oracle_train(cfg, [corpus.get_tokens(r["doc_ids"]) for r in records], "sdpa")
    assert [r["loss"] for r in records] == pytest.approx(losses, rel=1e-5, abs=1e-6)
    assert_params_close(replicas, params)
