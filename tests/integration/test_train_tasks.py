"""Several tasks in one run (``[[tasks]]``, Spindle): three tasks with different length distributions (chat turns,
long text files, short prompt/completion pairs) and adapter ranks, trained on 4 real Ray workers with Spindle's
per-step device allocation, each task's groups running its own LoRA adapter. Each task's losses and the trained
parameters equal a single-process reference that trains the same tasks on the same documents
(``flexorch.testing.reference.reference_train_tasks``), with the base frozen and trained, replicated and FSDP2-sharded,
for flexorch's decoder and a Hugging Face Llama."""

from __future__ import annotations

import numpy as np
import pytest

from flexorch.config import CorpusConfig, ModelConfig
from flexorch.config.tasks import TaskSettings
from flexorch.data.task_corpus import TaskStreams, load_task_corpus
from tests.chat_helpers import conversations, prompt_completions, write_jsonl
from tests.train_helpers import assert_params_close, cpu_profile, run_driver, train_config, write_corpus

pytestmark = pytest.mark.slow

MAX_CONTEXT = 256


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    from tests.ray_env import shared_ray

    shared_ray()
    root = tmp_path_factory.mktemp("tasks")
    data = {
        "chat": write_jsonl(root / "chat" / "chat.jsonl", conversations()),
        "code": write_corpus(root / "code"),  # text files up to 255 bytes: the long ones need SP groups
        "qa": write_jsonl(root / "qa" / "pairs.jsonl", prompt_completions()),
    }
    return root, data, cpu_profile(root / "profile.json")


def _tasks(data, weights=(1.0, 2.0, 1.0)):
    base = CorpusConfig(max_context=MAX_CONTEXT, tokenizer="byte", on_bad_record="skip")
    spec = [("chat", 0.5, 4, None), ("code", 0.25, 2, ("wq", "wk", "w2")), ("qa", 0.25, 8, ("wv",))]
    return tuple(
        TaskSettings(
            name=name,
            data=CorpusConfig(**{**base.__dict__, "source": str(data[name])}),
            share=share,
            weight=w,
            lora_rank=rank,
            lora_alpha=2.0 * rank,
            lora_targets=targets,
        )
        for (name, share, rank, targets), w in zip(spec, weights, strict=True)
    )


def _run(env, tag: str, model: ModelConfig, faults=(), **kw):
    root, data, profile = env
    cfg = train_config(data["code"], root / f"run-{tag}", profile, steps=2, model=model, tasks=_tasks(data), **kw)
    corpus = load_task_corpus(cfg.tasks)
    records, replicas = run_driver(cfg, corpus, faults)
    return cfg, corpus, records, replicas


def _check(cfg, corpus, records, replicas, whole=True):
    """The ledger (each task's documents from its own stream), each task's loss and the parameters against the
    reference; with the base frozen, the base parameters are their initial values."""
    from flexorch.testing.reference import reference_train_tasks
    from flexorch.workers.model_source import build_model

    streams = TaskStreams(corpus, cfg.task_counts, cfg.seed)
    assert [r["doc_ids"] for r in records] == [list(streams.next_batch().doc_ids) for _ in records]
    names, weights = [t.name for t in cfg.tasks], [t.weight for t in cfg.tasks]
    batches = [
        list(zip(corpus.task_of[r["doc_ids"]].tolist(), corpus.get_stored(r["doc_ids"]), strict=True)) for r in records
    ]
    ref_losses, ref_tasks, ref_state = reference_train_tasks(cfg.model, cfg.optim, batches, cfg.seed, names, weights)
    assert [r["loss"] for r in records] == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
    for r, ref in zip(records, ref_tasks, strict=True):
        assert r["task_losses"] == pytest.approx(ref, rel=1e-5, abs=1e-6)
        assert {n: e["loss"] for n, e in r["tasks"].items()} == pytest.approx(ref, rel=1e-5, abs=1e-6)
        assert sum(e["targets"] for e in r["tasks"].values()) == r["targets"]
        assert [e["docs"] for e in r["tasks"].values()] == list(cfg.task_counts)
        assert all(e["epoch"] == 0 for e in r["tasks"].values())  # each task's first pass over its data
    ref_params = {k: v.numpy() for k, v in ref_state.items()}
    assert_params_close(replicas, ref_params, whole=whole)
    initial = {k: v.detach().numpy() for k, v in build_model(cfg.model, cfg.seed).state_dict().items()}
    moved = {k for k in ref_params if not np.array_equal(ref_params[k], initial[k])}
    adapters = {k for k in ref_params if ".lora." in k}
    assert {k for k in adapters if k.endswith(".B")} <= moved, "every adapter's B trained"
    if not cfg.model.base_trainable:
        assert moved <= adapters, f"a frozen base moved: {sorted(moved - adapters)[:3]}"
    else:
        assert moved - adapters, "the base trained"


def _groups(records):
    return [(g["degree"], g["seq_ids"]) for r in records for mb in r["plan"]["micro_batches"] for g in mb]


def test_three_tasks_with_a_frozen_base_train_exactly_their_adapters_on_spindle_plans_through_a_shrink_and_resume(env):
    model = ModelConfig(loss_chunk_tokens=24, base_trainable=False)
    # worker 2 dies in step 1's first micro-batch: the step is planned again for the 3 workers left and re-run
    elastic = {"min_workers": 2}
    faults = [(2, "micro_batch", 1, 1, "exit")]
    plan = {"tokens_per_worker": 128}  # a 256-token document fits 2 of the 3 workers left
    cfg, corpus, records, replicas = _run(env, "frozen", model, faults, checkpoint_every=1, elastic=elastic, plan=plan)
    assert [r["world_size"] for r in records] == [4, 3] and records[1]["recoveries"]
    assert {p[2] for p in records[1]["multitask"]["parts"]} <= {1, 2, 3}, "Spindle's blocks lie within 3 workers"
    for r in records:  # the planner's model state: the frozen base's weights alone, the adapters with their AdamW
        held = [rank["state_bytes"] for rank in r["ranks"]]
        assert held == pytest.approx([r["model_state"]["plan_resident_bytes"]] * len(held), rel=1e-3)
    for r in records:  # every group runs one task's documents; Spindle placed the tasks on their own devices
        task_of = corpus.task_of[r["doc_ids"]]
        for _, seq_ids in _groups([r]):
            assert len({int(task_of[i]) for i in seq_ids}) == 1
        assert r["status"] in ("spindle", "spindle-in_turn", "fallback") and r["plan"]["micro_batches"]
    assert max(d for d, _ in _groups(records)) > 1, "the long documents ran on SP groups"
    _check(cfg, corpus, records, replicas)
    # --resume from the checkpoint after step 1: it holds every task's stream position, so the resumed run trains
    # step 1 again on the same documents of each task, then step 2 on each task's next ones
    more, replicas = run_driver(cfg.replace(steps=3, resume=True), corpus)
    assert [r["step"] for r in more] == [1, 2] and more[0]["doc_ids"] == records[1]["doc_ids"]
    assert more[0]["loss"] == pytest.approx(records[1]["loss"], rel=1e-6)
    _check(cfg.replace(steps=3), corpus, records[:1] + more, replicas)


def test_three_tasks_training_the_base_too_equal_the_reference_with_fsdp_sharded_state(env):
    from flexorch.config.sharding import ShardingSettings

    model = ModelConfig(loss_chunk_tokens=24, base_trainable=True)
    cfg, corpus, records, replicas = _run(env, "fsdp", model, sharding=ShardingSettings(mode="fsdp"))
    _check(cfg, corpus, records, replicas, whole=False)


@pytest.mark.parametrize("base_trainable", [False, True])
def test_three_tasks_on_a_hugging_face_llama_in_turn_equal_the_reference(env, tmp_path, base_trainable):
    pytest.importorskip("transformers")
    from flexorch.config.hf import hf_model_config
    from tests.integration.test_train_hf import write_model_dir

    model_dir = write_model_dir(tmp_path / "llama", "llama")
    extra = {"loss_chunk_tokens": 24, "base_trainable": base_trainable}
    model = ModelConfig.from_dict({**hf_model_config(str(model_dir)), **extra})
    root, data, profile = env
    hf_targets = {"chat": None, "code": ("q_proj", "k_proj", "down_proj"), "qa": ("v_proj",)}
    tasks = tuple(TaskSettings(**{**t.__dict__, "lora_targets": hf_targets[t.name]}) for t in _tasks(data))
    cfg = train_config(
        data["code"], root / f"run-hf-{base_trainable}", profile, steps=2, model=model, tasks=tasks,
        plan={"tasks": "in_turn"}, data=CorpusConfig(max_context=MAX_CONTEXT, tokenizer="byte"),
    )  # fmt: skip
    corpus = load_task_corpus(cfg.tasks)
    records, replicas = run_driver(cfg, corpus)
    assert all(r["status"] in ("in_turn", "fallback") for r in records)
    _check(cfg, corpus, records, replicas)
