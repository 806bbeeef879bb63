"""The real ``TrainingDriver`` and elastic executor stepped without Ray: one transition at a time.

Every test drives ``TrainingDriver`` over the in-process :class:`~tests.fake_cluster.FakeWorkerGroup` (real model,
real AdamW, the single-process reference step on each step's documents) and ``LocalPlannerClient`` (real MILP
solves), injects a failure, and asserts the state after each :meth:`~TrainingDriver.step`: what ran, the decisions
executed, the world's members, the step number, the stream position (each document trained exactly once, in the
stream's order), the records on disk, and the parameters against the single-process reference. No Ray cluster is
started (checked at the end of the module). The whole file runs in a few seconds.
"""

from __future__ import annotations

import functools

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
from flexorch.control.elastic import Elastic, ElasticError
from flexorch.control.failures import Failure
from flexorch.control.membership import ElasticPolicy, Fail, Retry, Shrink, WaitForCapacity
from flexorch.control.transitions import Ran
from flexorch.data.stream import DocumentStream
from flexorch.records.writer import read_records
from flexorch.testing.faults import PlannerHang
from flexorch.testing.reference import reference_train
from tests.fake_cluster import FakeWorkerGroup, Fault, fake_driver, memory_corpus
from tests.train_helpers import cpu_profile

# token lengths of the corpus: long-tailed, the longest (128) needs a 2-worker group at 64 tokens per worker
LENGTHS = [5, 40, 120, 17, 90, 64, 127, 60, 8, 33, 128, 71, 12, 50, 99, 3, 110, 45, 64, 22, 100, 7, 30, 55]


STATIC = {"mode": "static-ulysses-2"}
"""Tests whose story does not depend on the plan use a forced layout (planned in milliseconds, no MILP); the
others plan with the real adaptive planner (MILP solves, a few tens of milliseconds each)."""


@pytest.fixture(scope="module")
def corpus():
    rng = np.random.default_rng(0)
    return memory_corpus([rng.integers(1, 257, n) for n in LENGTHS], vocab_size=257)


@pytest.fixture(scope="module")
def profile(tmp_path_factory):
    return cpu_profile(tmp_path_factory.mktemp("profile") / "profile.json")


def _cfg(tmp_path, profile, **kw) -> TrainConfig:
    plan = {
        "profile": str(profile),
        "tokens_per_worker": 64,
        "time_limit_s": 0.03,
        "timeout_s": 5.0,
        **kw.pop("plan", {}),
    }
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
    """Every member's parameters equal the single-process reference trained on ``trained`` (doc ids per step, steps
    in order; within a batch in doc-id order, as the fake packs them, so the two compute the same floats)."""
    ref = _reference(corpus, cfg.model, cfg.optim, cfg.seed, tuple(tuple(sorted(ids)) for ids in trained))
    for params in driver.replica_parameters():
        assert [name for name, _ in params] == list(ref)
        for name, value in params:
            np.testing.assert_allclose(value, ref[name].numpy(), rtol=1e-6, atol=1e-8, err_msg=name)


@functools.cache
def _reference(corpus, model_cfg, optim_cfg, seed: int, trained: tuple[tuple[int, ...], ...]) -> dict:
    """``reference_train``'s parameters after ``trained`` (computed once per distinct run: tests share prefixes)."""
    batches = [[corpus.blocks[b][o : o + n] for b, o, n in _where(corpus, ids)] for ids in trained]
    return reference_train(model_cfg, optim_cfg, batches, seed)[1]


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


def test_retry_when_the_world_breaks_with_every_worker_alive(tmp_path, profile, corpus):
    cfg = _cfg(tmp_path, profile, steps=3, plan=STATIC)
    batches = _batches(cfg, 3)
    driver, group = fake_driver(cfg, corpus, faults=[Fault(1, "step", 1, "break")])
    try:
        driver.step()
        t = driver.step()
        assert (t.ran, t.step, t.next_step, t.decisions) == (Ran.TRAINED, 1, 2, ("Retry",))
        (rec,) = t.recoveries
        assert rec["lost"] == [] and rec["world_after"] == [0, 1, 2, 3] and "every worker is alive" in rec["reason"]
        assert group.worker_ids == (0, 1, 2, 3) and len(group.worlds) == 2, "nobody dropped, a new world formed"
        assert t.record["doc_ids"] == batches[1] and t.record["world_size"] == 4
        assert _on_disk(cfg) == [0, 1]
        _check_params(driver, corpus, cfg, batches[:2])
    finally:
        driver.shutdown()


def test_a_hung_worker_is_dropped_then_replaced_on_its_freed_slot(tmp_path, profile, corpus):
    cfg = _cfg(tmp_path, profile, steps=4)
    batches = _batches(cfg, 4)
    driver, group = fake_driver(cfg, corpus, faults=[Fault(2, "step", 1, "hang")])
    try:
        driver.step()
        t = driver.step()  # worker 2 never answers: killed at the collective timeout, its slot free again
        assert t.decisions == ("Shrink",) and group.worker_ids == (0, 1, 3) and t.record["world_size"] == 3
        assert list(group.joining) == [], "a replacement starts at the next step boundary"
        t = driver.step()  # the boundary starts worker 4; it is not up yet, so step 2 runs on three
        assert (t.ran, t.recoveries, group.worker_ids, list(group.joining)) == (Ran.TRAINED, (), (0, 1, 3), [4])
        t = driver.step()  # worker 4 is up: it joins (state copied from a member) before step 3
        (grow,) = t.recoveries
        assert grow["what"] == "grow" and grow["joined"] == [4] and grow["world_after"] == [0, 1, 3, 4]
        assert t.record["worker_ids"] == [0, 1, 3, 4] and t.record["step"] == 3
        assert [r["doc_ids"] for r in read_records(cfg.run_dir + "/steps.jsonl")] == batches
        _check_params(driver, corpus, cfg, batches)
    finally:
        driver.shutdown()


def test_grow_onto_capacity_that_joins_mid_run(tmp_path, profile, corpus):
    cfg = _cfg(tmp_path, profile, steps=4)
    batches = _batches(cfg, 4)
    driver, group = fake_driver(cfg, corpus, slots=2)  # a cluster with room for 2 of the 4 workers asked for
    try:
        t = driver.step()
        assert group.worker_ids == (0, 1) and t.record["world_size"] == 2 and not group.joining
        group.add_slots(2)  # a node joins
        t = driver.step()
        assert t.recoveries == () and sorted(group.joining) == [2, 3] and t.record["world_size"] == 2
        t = driver.step()
        (grow,) = t.recoveries
        assert grow["joined"] == [2, 3] and group.worker_ids == (0, 1, 2, 3) and t.record["world_size"] == 4
        assert t.record["step"] == 2 and t.record["doc_ids"] == batches[2]
        _check_params(driver, corpus, cfg, batches[:3])
    finally:
        driver.shutdown()


def test_below_min_workers_waits_for_capacity_that_appears_late(tmp_path, profile, corpus):
    cfg = _cfg(tmp_path, profile, steps=3, elastic={"min_workers": 4})
    batches = _batches(cfg, 3)
    driver, group = fake_driver(cfg, corpus, faults=[Fault(3, "step", 1)])
    try:
        driver.step()
        group.add_slots(1, after_polls=3)  # the lost node's replacement shows up on the third poll
        t = driver.step()
        assert (t.ran, t.step, t.decisions) == (Ran.TRAINED, 1, ("WaitForCapacity",))
        (rec,) = t.recoveries
        assert rec["lost"] == [3] and rec["world_after"] == [0, 1, 2, 4]
        assert t.record["world_size"] == 4 and t.record["doc_ids"] == batches[1]
        events = [e for e in driver.poll(0)[0] if e["event"] == "waiting"]
        assert events and events[0]["need"] == 1 and events[0]["timeout_s"] == cfg.elastic.wait_s
        _check_params(driver, corpus, cfg, batches[:2])
    finally:
        driver.shutdown()


def test_no_capacity_within_wait_s_is_a_clear_error_and_the_state_stays(tmp_path, profile, corpus):
    elastic = {"min_workers": 4, "wait_s": 0.1}
    cfg = _cfg(tmp_path, profile, steps=3, checkpoint_every=1, elastic=elastic, plan=STATIC)
    batches = _batches(cfg, 3)
    driver, group = fake_driver(cfg, corpus, faults=[Fault(3, "step", 1)])
    try:
        driver.step()
        with pytest.raises(ElasticError, match=r"min_workers=4.*elastic\.wait_s=0\.1 s.*checkpoint_000001.*--resume"):
            driver.step()
        assert driver.step_no == 1 and driver.stream.peek().doc_ids == tuple(batches[1]), "nothing was consumed"
        assert _on_disk(cfg) == [0]
    finally:
        driver.shutdown()


def test_a_fatal_error_in_admission_after_a_shrink_keeps_the_work_in_an_emergency_checkpoint(tmp_path, profile, corpus):
    # worker 2 hangs in step 1 (the run shrinks, its slot comes free, worker 4 starts there); when worker 4 is admitted
    # before step 3, worker 0 raises while the world forms (a bug: not retried). No periodic checkpoint was due; the
    # run writes the state after step 3 from the members that hold it and the error says how to go on
    cfg = _cfg(tmp_path, profile, steps=6, plan=STATIC)
    batches = _batches(cfg, 6)
    driver, group = fake_driver(cfg, corpus, faults=[Fault(2, "step", 1, "hang"), Fault(0, "join", 3, "raise")])
    try:
        with pytest.raises(ElasticError) as err:
            driver.run()
    finally:
        driver.shutdown()
    text = str(err.value)
    assert text.startswith("admit joining workers: worker 0 failed (not a membership problem"), text
    assert "emergency checkpoint of the state after step 3" in text and "checkpoint_000003" in text, text
    assert f"flexorch train --config {cfg.run_dir}/config.json --resume" in text and "No checkpoint" not in text
    assert _on_disk(cfg) == [0, 1, 2]
    again, _ = fake_driver(cfg.replace(resume=True), corpus)
    try:
        assert again.step_no == 3 and again.stream.peek().doc_ids == tuple(batches[3]), "the exact next batch"
        again.run()
        assert _on_disk(cfg) == [0, 1, 2, 3, 4, 5]
        assert [r["doc_ids"] for r in read_records(cfg.run_dir + "/steps.jsonl")] == batches
        _check_params(again, corpus, cfg, batches)
    finally:
        again.shutdown()


def test_a_fatal_error_says_why_no_emergency_checkpoint_could_be_written(tmp_path, profile, corpus):
    # the error strikes in step 1 before its update: every member holds the state after step 0, but none answers
    # which state it holds (stand-in for a group whose workers all went silent): nothing is kept, and the error says
    # why and that no checkpoint was written
    cfg = _cfg(tmp_path, profile, steps=3, plan=STATIC)
    driver, group = fake_driver(cfg, corpus, faults=[Fault(1, "step", 1, "raise")])
    group.state_versions = lambda timeout_s: {}
    try:
        with pytest.raises(ElasticError, match=r"worker 1 failed.*No emergency checkpoint could be written \(Runtime"
                           r"Error: no live worker holds the state after step 1 \(steps applied: no worker answered"
                           r"\)\); no checkpoint was written yet"):  # fmt: skip
            driver.run()
    finally:
        driver.shutdown()


def test_infeasible_batch_is_skipped_and_counted(tmp_path, profile, corpus):
    # a forced one-worker layout cannot hold a document longer than 100 tokens: such batches are skipped
    plan = {"mode": "static-ulysses-1", "on_infeasible": "skip", "tokens_per_worker": 100}
    cfg = _cfg(tmp_path, profile, steps=4, batch_size=3, plan=plan)
    batches = _batches(cfg, 4)
    fits = [max(LENGTHS[i] for i in ids) <= 100 for ids in batches]
    assert not all(fits) and any(fits), "the corpus must give both kinds of batch"
    driver, group = fake_driver(cfg, corpus)
    try:
        for step, (ids, fit) in enumerate(zip(batches, fits, strict=True)):
            t = driver.step()
            assert (t.ran, t.step, t.next_step) == ((Ran.TRAINED if fit else Ran.SKIPPED), step, step + 1)
            assert t.record["doc_ids"] == ids and t.record["skipped"] == (not fit)
            assert driver.skipped_batches == fits[: step + 1].count(False)
        assert driver.finished and _on_disk(cfg) == [0, 1, 2, 3]
        skipped = [r for r in read_records(cfg.run_dir + "/steps.jsonl") if r["skipped"]]
        assert all("static layout ulysses x1" in r["reason"] for r in skipped)
        _check_params(driver, corpus, cfg, [ids for ids, fit in zip(batches, fits, strict=True) if fit])
    finally:
        driver.shutdown()


def test_stage_parts_lost_roll_back_to_the_checkpoint_and_train_again(tmp_path, profile, corpus):
    # 2 stages x 1 worker, stage-local parameters: worker 1 holds stage 1's layers alone. It dies in step 2; a
    # replacement joins (min_workers = 2), but stage 1's parameters are gone: back to the checkpoint of step 2
    cfg = _cfg(tmp_path, profile, workers=2, steps=4, checkpoint_every=1, pipeline={"stages": 2})
    batches = _batches(cfg, 4)
    driver, group = fake_driver(cfg, corpus, slots=3, faults=[Fault(1, "step", 2)])
    try:
        for _ in range(2):
            assert driver.step().record["pipeline"]["stage_ranks"] == [[0], [1]]
        t = driver.step()
        assert (t.ran, t.step, t.next_step, t.record) == (Ran.ROLLED_BACK, 2, 2, None)
        back = t.recoveries[-1]
        assert back["rollback"] and back["lost"] == [1] and (back["from_step"], back["to_step"]) == (2, 2)
        assert group.worker_ids == (0, 2) and driver.step_no == 2 and driver.stream.peek().doc_ids == tuple(batches[2])
        assert _on_disk(cfg) == [0, 1]
        _check_params(driver, corpus, cfg, batches[:2])  # the checkpoint's parameters, on both members
        t = driver.step()
        assert (t.ran, t.step, t.record["doc_ids"], t.record["worker_ids"]) == (Ran.TRAINED, 2, batches[2], [0, 2])
        assert [r.get("rollback") for r in t.record["recoveries"]] == [True], "the roll-back is recorded once"
        t = driver.step()
        assert t.record["step"] == 3 and driver.finished and _on_disk(cfg) == [0, 1, 2, 3]
        _check_params(driver, corpus, cfg, batches)
    finally:
        driver.shutdown()


class _Seen:
    """A step callback of a test's own (``control.step_callbacks``): the steps it was handed, and the rewinds."""

    def __init__(self):
        self.steps, self.rewinds = [], []

    def on_step(self, record: dict, plan) -> None:
        self.steps.append((record["step"], plan is not None))

    def on_rewind(self, step: int) -> None:
        self.rewinds.append(step)


def test_step_callbacks_see_every_written_record_in_order_and_a_roll_back_rewinds_them(tmp_path, profile, corpus):
    # the same story as above, watched through the callback list: the run's own callbacks come first, in their
    # documented order, and a callback appended by a user sees each record once written, and the roll-back
    from flexorch.control.step_callbacks import CheckpointCallback, MetricsCallback, ProgressCallback, TrackerCallback

    cfg = _cfg(tmp_path, profile, workers=2, steps=4, checkpoint_every=1, pipeline={"stages": 2})
    driver, _ = fake_driver(cfg, corpus, slots=3, faults=[Fault(1, "step", 2)])
    kinds = [type(c).__name__ for c in driver.callbacks]
    assert kinds == [c.__name__ for c in (TrackerCallback, MetricsCallback)] + [
        "FallbackWatch",
        CheckpointCallback.__name__,
        ProgressCallback.__name__,
    ]
    seen = _Seen()
    driver.callbacks.append(seen)
    events = []
    try:
        while not driver.finished:
            driver.step()
        events = driver.events.poll(0)[0]
    finally:
        driver.shutdown()
    assert seen.steps == [(0, True), (1, True), (2, True), (3, True)] and seen.rewinds == [2]
    assert _on_disk(cfg) == [0, 1, 2, 3]
    steps = [e for e in events if e["event"] == "step"]
    assert [e["step"] for e in steps] == [0, 1, 2, 3] and all(e["eta_s"] >= 0 for e in steps)
    assert steps[-1]["eta_s"] == 0.0, "no step is left after the last"


def test_stage_parts_lost_without_a_checkpoint_is_a_clear_error(tmp_path, profile, corpus):
    cfg = _cfg(tmp_path, profile, workers=2, steps=3, pipeline={"stages": 2})
    driver, group = fake_driver(cfg, corpus, slots=3, faults=[Fault(1, "step", 1)])
    try:
        driver.step()
        with pytest.raises(ElasticError, match=r"layer:1.*held only by lost workers \[1\].*no checkpoint yet"):
            driver.step()
    finally:
        driver.shutdown()


def test_a_stuck_planner_costs_timeout_s_once_and_the_step_runs_the_fallback_plan(tmp_path, profile, corpus):
    cfg = _cfg(tmp_path, profile, steps=2, plan={**STATIC, "timeout_s": 0.2})
    batches = _batches(cfg, 2)
    driver, group = fake_driver(cfg, corpus)
    try:
        driver.planner.add_probe(PlannerHang())
        t = driver.step()
        assert t.record["status"] == "fallback" and t.record["doc_ids"] == batches[0]
        assert any(e["event"] == "planner" and "plan.timeout_s=0.2" in e["message"] for e in driver.poll(0)[0])
        assert driver.step().record["status"] != "fallback", "the replacement planner plans the next step"
        _check_params(driver, corpus, cfg, batches)
    finally:
        driver.shutdown()


@pytest.mark.parametrize(
    "decision, world_after, error",
    [
        (Shrink(lost=(3,), survivors=(0, 1)), (0, 1), None),  # keeps exactly the survivors named
        (Retry("the world broke"), (0, 1, 2, 3), None),  # drops nobody, re-forms the world
        (WaitForCapacity(lost=(3,), survivors=(0, 1, 2), need=2, timeout_s=0.05), None, r"for 1 more.*wait_s=0\.05 s"),
        (Fail("told to"), None, r"recover: told to\. hint"),
    ],
)
def test_the_executor_does_what_the_decision_says(tmp_path, profile, decision, world_after, error):
    """Elastic.recover executes the policy's decision as given: its survivors, its need and timeout, its reason."""

    class Told(ElasticPolicy):
        def on_failure(self, alive, failure, attempt):
            return decision

    cfg = _cfg(tmp_path, profile)
    group = FakeWorkerGroup(cfg, slots=4)
    group.form_world()
    events = []
    elastic = Elastic(group, Told(2, 4), events.append, lambda: "hint")
    if error is not None:
        with pytest.raises(ElasticError, match=error):
            elastic.recover(Failure(frozenset({3})), 0, "recover")
        return
    rec = elastic.recover(Failure(frozenset({3})), 0, "recover")
    assert group.worker_ids == world_after and group.worlds[-1] == world_after
    assert rec.decisions == (type(decision).__name__,) and rec.world_after == world_after


def test_run_loops_the_transitions_to_the_end_without_ray(tmp_path, profile, corpus):
    import ray

    if ray.is_initialized():  # the suite's shared Ray, from an earlier module: this test proves it is not needed
        ray.shutdown()
    cfg = _cfg(tmp_path, profile, steps=3)
    driver, group = fake_driver(cfg, corpus, faults=[Fault(0, "step", 1)])
    try:
        summary = driver.run()
        assert summary["steps"] == 3 and summary["checkpoint"].endswith("checkpoint_000003")
        assert group.worker_ids == (1, 2, 3) and _on_disk(cfg) == [0, 1, 2]
        _check_params(driver, corpus, cfg, _batches(cfg, 3))
        assert [e["event"] for e in driver.poll(0)[0]][-1] == "done" and driver.poll(0)[1]
    finally:
        driver.shutdown()
    assert not ray.is_initialized(), "the transition tests must not start Ray"


@pytest.mark.parametrize("budget", ["step", "fixed"])
def test_each_plan_gets_a_share_of_the_last_measured_step_and_the_record_says_so(tmp_path, profile, corpus, budget):
    # the plan of step k is solved while step k-1 runs, so it gets a share of step k-2's measured time (the floor,
    # time_limit_s, before any step was measured); with budget = "fixed" always the floor
    plan = {"budget": budget, "budget_share": 1.0, "time_limit_s": 0.001, "timeout_s": 5.0}
    cfg = _cfg(tmp_path, profile, steps=4, plan=plan)
    driver, _ = fake_driver(cfg, corpus)
    try:
        for _ in range(4):
            driver.step()
    finally:
        driver.shutdown()
    recs = read_records(cfg.run_dir + "/steps.jsonl", validate=True)
    assert [r["step"] for r in recs] == [0, 1, 2, 3]
    budgets = [r["plan_budget_s"] for r in recs]
    if budget == "fixed":
        assert budgets == [0.001] * 4
    else:
        assert budgets[:2] == [0.001, 0.001]
        for k in (2, 3):
            assert budgets[k] == pytest.approx(cfg.plan.budget_for(recs[k - 2]["measured_ms"]), rel=1e-3)
            assert budgets[k] > 0.001
    for r in recs:
        assert r["gap"] is None or r["gap"] == pytest.approx(r["predicted_ms"] / r["bound_ms"] - 1, abs=1e-9)
