"""Loss masks are exact through `flexorch train`: chat, prompt/completion, tokenized Parquet and ``datasets``
sources, each trained on 4 real Ray workers with adaptive plans (SP groups of Ulysses or zigzag-ring attention over
documents longer than one worker's 64-token budget, an over-long conversation split between its exchanges), equal
step by step to the single-process reference on the same stored tokens and masks; the chat run with a Hugging
Face Llama equals Transformers' own loss (``model(input_ids, labels=...)``, its own attention and label shift, one
conversation per forward, one process) with the answers' labels and the prompts' -100."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flexorch.config import CorpusConfig, ModelConfig
from flexorch.data.corpus import load_corpus
from flexorch.data.targets import hf_labels
from tests.chat_helpers import conversations, prompt_completions, tokenized_rows, write_jsonl, write_parquet
from tests.train_helpers import (
    assert_params_close,
    check_against_reference,
    cpu_profile,
    run_driver,
    train_config,
)

pytestmark = pytest.mark.slow

MAX_CONTEXT = 256  # the long conversation (~1,150 tokens) is split between exchanges


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    from tests.ray_env import shared_ray

    shared_ray()
    root = tmp_path_factory.mktemp("masked")
    rows = conversations() + [{"messages": c["messages"][::-1][1:][::-1]} for c in conversations()[:5]]
    sources = {
        "chat": write_jsonl(root / "chat" / "chat.jsonl", rows),
        "prompt_completion": write_jsonl(root / "pc" / "pairs.jsonl", prompt_completions() * 2),
        "tokenized": write_parquet(root / "tok" / "rows.parquet", tokenized_rows() * 2),
    }
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list(rows).save_to_disk(str(root / "ds"))
    sources["hf_dataset"] = root / "ds"
    return root, sources, cpu_profile(root / "profile.json")


def _run(env, name: str, **kw):
    root, sources, profile = env
    data = CorpusConfig(source=str(sources[name]), max_context=MAX_CONTEXT, on_bad_record="skip", tokenizer="byte")
    corpus = load_corpus(data)
    run_dir = root / f"run-{name}-{'hf' if 'model' in kw else 'own'}"
    cfg = train_config(sources[name], run_dir, profile, data=data, steps=2, **kw)
    records, replicas = run_driver(cfg, corpus)
    groups = [(g["kind"], g["degree"]) for r in records for mb in r["plan"]["micro_batches"] for g in mb]
    assert max(d for _, d in groups) > 1, "documents longer than one worker's budget run on SP groups"
    for r in records:  # the loss's denominator is the targets, fewer than the tokens the step computed
        assert 0 < r["targets"] < r["tokens"]
        assert r["targets"] == sum(loc.predicted for loc in corpus.locate(r["doc_ids"]))
    return cfg, corpus, records, replicas, groups


@pytest.mark.parametrize("name", ["chat", "prompt_completion", "tokenized", "hf_dataset"])
def test_masked_sources_train_exactly_like_one_process(env, name):
    cfg, corpus, records, replicas, groups = _run(env, name)
    if name == "chat":
        assert corpus.stats["split_docs"] >= 1, "over-long conversations were split between their exchanges"
        assert corpus.stats["bad_records"] >= 1, "a conversation without an answer was skipped and counted"
    check_against_reference(cfg, corpus, records, replicas)


@pytest.mark.parametrize("how", ["fsdp", "pipeline"])
def test_masked_chat_trains_exactly_with_sharded_state_and_on_pipeline_stages(env, how):
    """The labels of FSDP2-sharded steps and of pipeline units (pieces of a conversation on each stage) come from
    the same stored masks: the same reference."""
    from flexorch.config.sharding import ShardingSettings

    if how == "fsdp":
        cfg, corpus, records, replicas, _ = _run(env, "chat", sharding=ShardingSettings(mode="fsdp"))
    else:
        root, sources, profile = env
        data = CorpusConfig(source=str(sources["chat"]), max_context=MAX_CONTEXT, on_bad_record="skip")
        corpus = load_corpus(data)
        cfg = train_config(sources["chat"], root / "run-chat-pp", profile, data=data, steps=2, pipeline={"stages": 2})
        records, replicas = run_driver(cfg, corpus)
        assert all(r["pipeline"] is not None and 0 < r["targets"] < r["tokens"] for r in records)
    check_against_reference(cfg, corpus, records, replicas, whole=how == "fsdp")


def test_a_chat_run_of_a_hugging_face_llama_equals_transformers_own_loss_with_masked_labels(env, tmp_path):
    transformers = pytest.importorskip("transformers")
    from flexorch.config.hf import hf_model_config
    from flexorch.workers.model_source import build_model
    from flexorch.workers.optim import build_optimizer
    from tests.integration.test_train_hf import write_model_dir

    model_dir = write_model_dir(tmp_path / "llama", "llama")
    model = ModelConfig.from_dict({**hf_model_config(str(model_dir)), "loss_chunk_tokens": 24})
    cfg, corpus, records, replicas, groups = _run(env, "chat", model=model)
    # the oracle: Transformers' model, attention and loss (labels shifted inside), one conversation per forward
    conf = transformers.AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    hf = transformers.AutoModelForCausalLM.from_config(conf, attn_implementation="sdpa", dtype=torch.float32)
    hf.load_state_dict(build_model(cfg.model, cfg.seed).state_dict())
    optimizer, scheduler = build_optimizer(hf, cfg.optim)
    losses = []
    for r in records:
        optimizer.zero_grad(set_to_none=True)
        docs = [hf_labels(s) for s in corpus.get_stored(r["doc_ids"])]
        n = [int((lab[1:] != -100).sum()) for _, lab in docs]
        total = torch.zeros(())
        for (ids, lab), k in zip(docs, n, strict=True):  # HF's loss is a mean over its targets: weigh it by them
            out = hf(input_ids=torch.from_numpy(ids)[None], labels=torch.from_numpy(lab)[None])
            total = total + out.loss * k
        loss = total / sum(n)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), cfg.optim.grad_clip)
        optimizer.step()
        scheduler.step()
        losses.append(float(loss.detach()))
        assert r["targets"] == sum(n)
    assert [r["loss"] for r in records] == pytest.approx(losses, rel=1e-5, abs=1e-6)
    assert_params_close(replicas, {k: v.detach().numpy() for k, v in hf.named_parameters()})
    assert not np.isnan(losses).any()
