"""A stop keeps every trained step, and every step without the planner's plan says why (issue: busy clusters).

The real ``TrainingDriver`` over the in-process :class:`~tests.fake_cluster.FakeWorkerGroup` (real model, real AdamW)
and ``LocalPlannerClient`` (real MILP solves); no Ray. The end-to-end versions (a signal to ``flexorch train``,
``ray job stop``, a run beside CPU hogs) are in ``tests/integration/test_stop_resume.py``.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from flexorch.config import CorpusConfig, ElasticSettings, ModelConfig, OptimConfig, PlanSettings, TrainConfig
from flexorch.data.stream import DocumentStream
from flexorch.records.schema import RecordError, validate_record
from flexorch.records.writer import read_records
from flexorch.testing.faults import PlannerHang
from flexorch.testing.reference import reference_train
from tests.fake_cluster import fake_driver, memory_corpus
from tests.train_helpers import cpu_profile

LENGTHS = [5, 40, 120, 17, 90, 64, 127, 60, 8, 33, 128, 71, 12, 50, 99, 3, 110, 45, 64, 22, 100, 7, 30, 55]


@pytest.fixture(scope="module")
def corpus():
    rng = np.random.default_rng(0)
    return memory_corpus([rng.integers(1, 257, n) for n in LENGTHS], vocab_size=257)


@pytest.fixture(scope="module")
def profile(tmp_path_factory):
    return cpu_profile(tmp_path_factory.mktemp("profile") / "profile.json")


def _cfg(run_dir, profile, **kw) -> TrainConfig:
    plan = {"profile": str(profile), "tokens_per_worker": 64, "time_limit_s": 0.05, "timeout_s": 5.0}
    plan.update(kw.pop("plan", {}))
    values = {
        "steps": 6,
        "workers": 4,
        "batch_size": 6,
        "run_dir": str(run_dir),
        "model": ModelConfig(),
        "optim": OptimConfig(lr=1e-3, warmup_steps=1),
        "data": CorpusConfig(source="memory", max_context=128),
        "plan": PlanSettings(**plan),
        "elastic": ElasticSettings(wait_s=2.0),
        **kw,
    }
    return TrainConfig(**values)


def _reference_losses(cfg, corpus, records) -> list[float]:
    """The single-process reference's losses on the records' documents (in doc-id order, as the fake packs them)."""
    batches = []
    for r in records:
        docs = corpus.locate(sorted(r["doc_ids"]))
        batches.append([corpus.blocks[d.block][d.offset : d.offset + d.length] for d in docs])
    return reference_train(cfg.model, cfg.optim, batches, cfg.seed)[0]


def test_a_stop_checkpoints_the_steps_done_and_resume_equals_an_uninterrupted_run(tmp_path, profile, corpus):
    whole = _cfg(tmp_path / "whole", profile)
    driver, _ = fake_driver(whole, corpus)
    try:
        summary = driver.run()
    finally:
        driver.shutdown()
    assert summary["stopped"] is None and summary["steps"] == 6

    cfg = _cfg(tmp_path / "stopped", profile, checkpoint_every=0)
    driver, _ = fake_driver(cfg, corpus)
    try:
        driver.step()
        driver.step()
        driver.request_stop("SIGTERM")
        driver.request_stop("SIGINT")  # a second request keeps the first reason
        summary = driver.run()
        events = driver.poll(0)[0]
    finally:
        driver.shutdown()
    assert summary["stopped"] == "SIGTERM" and summary["steps"] == 2
    assert summary["checkpoint"].endswith("checkpoint_000002")
    assert any(e["event"] == "progress" and "SIGTERM: stopping after step 3" in e["message"] for e in events)
    assert [e["step"] for e in events if e["event"] == "checkpoint"] == [2]

    again, _ = fake_driver(cfg.replace(resume=True), corpus)
    try:
        assert again.step_no == 2
        again.request_stop("SIGINT")  # stopped again at once: the checkpoint it resumed from is kept, not rewritten
        assert again.run()["checkpoint"] == summary["checkpoint"]
        assert not [e for e in again.poll(0)[0] if e["event"] == "checkpoint"]
    finally:
        again.shutdown()
    again, _ = fake_driver(cfg.replace(resume=True), corpus)
    try:
        assert again.run()["stopped"] is None
    finally:
        again.shutdown()
    got = read_records(cfg.run_dir + "/steps.jsonl", validate=True)
    ref = read_records(whole.run_dir + "/steps.jsonl", validate=True)
    assert [r["doc_ids"] for r in got] == [r["doc_ids"] for r in ref], "resume continues at the next document"
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in ref], rel=1e-6)
    assert [r["loss"] for r in got] == pytest.approx(_reference_losses(cfg, corpus, got), rel=1e-5, abs=1e-6)


def test_shutdown_while_the_loop_runs_ends_it_without_an_internal_error(tmp_path, profile, corpus):
    cfg = _cfg(tmp_path / "run", profile, steps=50, plan={"mode": "static-ulysses-2"})
    driver, _ = fake_driver(cfg, corpus)
    out: dict = {}
    first = threading.Event()

    def loop():
        try:
            out["summary"] = driver.run()
        except Exception as e:  # noqa: BLE001 - the test reports it
            out["error"] = e

    real_finish = driver._finish

    def finish(*a, **kw):
        rec = real_finish(*a, **kw)
        first.set()
        return rec

    driver._finish = finish
    t = threading.Thread(target=loop)
    t.start()
    assert first.wait(60)
    driver.shutdown()  # takes the workers away under the running loop (a second Ctrl-C)
    t.join(60)
    assert not t.is_alive()
    assert "error" not in out, out.get("error")
    assert out["summary"]["stopped"] in ("shutdown",) and out["summary"]["steps"] < 50
    assert not [e for e in driver.poll(0)[0] if e["event"] == "error"]


def test_every_fallback_says_why_and_many_of_them_warn_once(tmp_path, profile, corpus):
    cfg = _cfg(tmp_path / "run", profile, steps=12, plan={"mode": "static-ulysses-2", "timeout_s": 0.2})
    driver, _ = fake_driver(cfg, corpus)
    try:
        driver.planner.add_probe(PlannerHang())  # step 0: the planner hangs past timeout_s
        records = [driver.step().record]
        real = driver.planner.planner.plan

        def broken(*a, **kw):
            raise RuntimeError("boom in the planner")

        driver.planner.planner.plan = broken  # step 1: the planner raises
        driver.planner.forget()  # (step 1's plan was solved ahead during step 0)
        records.append(driver.step().record)
        driver.planner.planner.plan = real
        driver.planner.forget()
        records += [driver.step().record for _ in range(10)]
        events = driver.poll(0)[0]
    finally:
        driver.shutdown()
    fb = [r["fallback"] for r in records]
    assert fb[0]["reason"] == "timeout" and "plan.timeout_s=0.2" in fb[0]["message"]
    assert fb[1]["reason"] == "error" and "boom in the planner" in fb[1]["message"]
    assert fb[2:] == [None] * 10
    assert [r["status"] for r in records[:2]] == ["fallback", "fallback"]
    warnings = [e["message"] for e in events if e["event"] == "planner" and e["message"].startswith("WARNING")]
    assert len(warnings) == 1, warnings  # said once, not every step
    assert "2 of the last 10 steps" in warnings[0] and "timeout 1" in warnings[0] and "error 1" in warnings[0]
    assert "plan.time_limit_s" in warnings[0]
    on_disk = read_records(cfg.run_dir + "/steps.jsonl", validate=True)
    assert [r["fallback"] for r in on_disk] == fb
    # the losses are untouched by which plan ran
    assert [r["loss"] for r in records] == pytest.approx(_reference_losses(cfg, corpus, records), rel=1e-5, abs=1e-6)


def test_one_fallback_in_many_steps_does_not_warn(tmp_path, profile, corpus):
    cfg = _cfg(tmp_path / "run", profile, steps=12, plan={"mode": "static-ulysses-2", "timeout_s": 0.2})
    driver, _ = fake_driver(cfg, corpus)
    try:
        driver.planner.add_probe(PlannerHang())
        for _ in range(12):
            driver.step()
        events = driver.poll(0)[0]
    finally:
        driver.shutdown()
    assert not [e for e in events if e["event"] == "planner" and e["message"].startswith("WARNING")]


def test_a_skipped_batch_records_infeasible_and_the_schema_checks_fallbacks(tmp_path, profile, corpus):
    # a static layout of degree 1 cannot hold the 120-token documents at 64 tokens per worker: skipped, recorded
    cfg = _cfg(tmp_path / "run", profile, steps=2, plan={"mode": "static-ring-1", "on_infeasible": "skip"})
    stream = DocumentStream(len(LENGTHS), cfg.batch_size, cfg.seed)
    assert max(LENGTHS[i] for i in stream.next_batch().doc_ids) > 64
    driver, _ = fake_driver(cfg, corpus)
    try:
        rec = driver.step().record
    finally:
        driver.shutdown()
    assert rec["skipped"] and rec["fallback"]["reason"] == "infeasible" and rec["fallback"]["message"]
    validate_record(rec)
    for bad in ({"reason": "tired", "message": ""}, {"reason": "timeout"}, "timeout"):
        with pytest.raises(RecordError, match="'fallback' must be null"):
            validate_record({**rec, "fallback": bad})
    with pytest.raises(RecordError, match="solver_crashes"):
        validate_record({**rec, "solver_crashes": -1})
