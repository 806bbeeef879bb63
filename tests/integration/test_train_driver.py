"""The driver with real Ray actors: resume, the epoch ledger, bad input, infeasible batches, calibration, a worker's
error, a stuck planner. (The real `flexorch train` CLI, stopped and resumed: tests/integration/test_stop_resume.py;
its bad input: tests/unit/test_cli_bad_input.py.)"""

from __future__ import annotations

import dataclasses

import pytest

from flexorch.config import CorpusConfig
from flexorch.control.driver import TrainingDriver
from flexorch.data.errors import DataError
from flexorch.records.writer import read_records
from flexorch.solver.errors import InfeasibleBatchError
from flexorch.testing.faults import PlannerHang, WorkerFault
from tests.train_helpers import check_against_reference, train_config, training_env

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    yield from training_env(tmp_path_factory, "driver")


# 2 workers where the story needs no more (each worker's start is ~4 s of imports on these 2 cores): 128 tokens
# each then hold data.max_context=256
_TPW128 = {"tokens_per_worker": 128}


def _run(cfg, corpus, steps=None):
    driver = TrainingDriver(cfg, corpus=corpus)
    try:
        driver.setup()
        out = [driver.step().record for _ in range(steps if steps is not None else cfg.steps - driver.step_no)]
        driver.checkpoint()
        return out, dict(driver.replica_parameters()[0])
    finally:
        driver.shutdown()


def test_resume_equals_uninterrupted_run(env):
    # what an uninterrupted run computes is the single-process reference on the same batches (the invariant):
    # checkpoint after step 2 ("crash"), resume, and compare the 5 steps and the parameters with it
    root, corpus_dir, profile, corpus = env
    part_cfg = train_config(corpus_dir, root / "part", profile, steps=5, workers=2, plan=_TPW128)
    first, _ = _run(part_cfg, corpus, steps=2)  # checkpoint after step 2, then the "crash"
    resumed_cfg = dataclasses.replace(part_cfg, resume=True)
    rest, resumed_params = _run(resumed_cfg, corpus)

    assert [r["step"] for r in first + rest] == list(range(5))
    # the ledger (resume continues at the next document), the losses and the parameters against the reference
    check_against_reference(resumed_cfg, corpus, first + rest, [list(resumed_params.items())])
    records = read_records(root / "part" / "steps.jsonl", validate=True)
    assert [r["step"] for r in records] == list(range(5)), "steps.jsonl holds every trained step exactly once"


def test_every_document_once_per_epoch(env):
    root, corpus_dir, profile, corpus = env
    # 24 documents, batches of 7: epochs of 4 batches (7+7+7+3); 9 steps = 2 full epochs and one batch more
    cfg = train_config(corpus_dir, root / "ledger", profile, steps=9, batch_size=7, workers=2, plan=_TPW128)
    records, _ = _run(cfg, corpus)
    by_epoch: dict[int, list[int]] = {}
    for r in records:
        by_epoch.setdefault(r["epoch"], []).extend(r["doc_ids"])
    assert sorted(by_epoch[0]) == list(range(corpus.num_docs))
    assert sorted(by_epoch[1]) == list(range(corpus.num_docs))
    assert by_epoch[0] != by_epoch[1], "each epoch has its own seeded order"
    assert len(by_epoch[2]) == len(set(by_epoch[2])) == 7
    for r in records:  # every planned group ran exactly the documents of its batch
        seqs = sorted(i for mb in r["plan"]["micro_batches"] for g in mb for i in g["seq_ids"])
        assert seqs == list(range(len(r["doc_ids"])))


def test_infeasible_batch_errors_or_is_skipped_and_counted(env):
    root, corpus_dir, profile, corpus = env
    # a static SP=1 layout with 128 tokens per worker cannot run documents of up to 256 tokens
    cfg = train_config(corpus_dir, root / "inf", profile, workers=2, plan={"mode": "static-ulysses-1", **_TPW128})
    with pytest.raises(InfeasibleBatchError, match="on_infeasible"):
        _run(cfg, corpus)
    skip = dataclasses.replace(
        cfg, run_dir=str(root / "skip"), plan=dataclasses.replace(cfg.plan, on_infeasible="skip")
    )
    records, _ = _run(skip, corpus)
    skipped = [r for r in records if r["skipped"]]
    assert skipped and all(r["reason"] and r["doc_ids"] for r in skipped)
    assert all(max(r["seq_lengths"]) > 128 for r in skipped)
    assert all(max(r["seq_lengths"]) <= 128 for r in records if not r["skipped"])


def test_a_bad_corpus_fails_before_any_worker_starts(env, tmp_path):
    # (the configuration's own errors need no Ray: tests/unit/test_config.py)
    root, corpus_dir, profile, _ = env
    empty = tmp_path / "empty"
    empty.mkdir()
    cfg = train_config(empty, tmp_path / "run", profile)
    driver = TrainingDriver(cfg)
    with pytest.raises(DataError):
        driver.setup()
    driver.shutdown()
    assert driver.workers is None, "a bad corpus fails before any worker starts"


def test_flexorch_profile_calibrates_on_the_workers(env, tmp_path):
    import io

    from flexorch.cli.train import run_profile
    from flexorch.control.calibration_probes import calibration_probes
    from flexorch.solver.profiles import get_profile

    root, corpus_dir, profile, _ = env
    compute, groups = calibration_probes(64, 2, ("ulysses", "ring"))
    assert all(sum(p.lengths) <= 64 for p in compute), "compute probes fit one worker's budget"
    assert {(p.degree, p.kind) for p in groups} == {(2, "ulysses"), (2, "ring")}
    cfg = train_config(corpus_dir, tmp_path / "run", profile, workers=2, data=CorpusConfig(max_context=128))
    out = io.StringIO()
    report = run_profile(cfg, tmp_path / "measured.json", out=out)
    measured = get_profile(str(tmp_path / "measured.json"))
    # a non-negative fit; on two busy cores the <= 64-token probes cannot always show a per-token cost (CI got
    # a2 = 0 once and a1 = a2 = 0 once): then the user is warned that the profile prices tokens at zero
    assert measured.a1_ms >= 0 and measured.a2_ms >= 0 and measured.b1_ms > 0
    flat = measured.a1_ms + measured.a2_ms == 0
    assert ("warning: compute: time did not grow with tokens" in out.getvalue()) == flat
    assert measured.num_layers == cfg.model.num_layers and measured.num_heads == 4
    assert set(measured.a2a_latency_ms) == {2} and set(measured.p2p_latency_ms) == {2}
    assert 1_000 < measured.act_bytes_per_token < 100_000
    assert len(report["probes"]) == len(compute) + len(groups)
    assert 0 <= report["median_rel_error"] <= report["max_rel_error"]
    assert "calibrated on 2 workers" in out.getvalue() and "profile written to" in out.getvalue()


def test_a_worker_error_fails_the_run_fast_with_that_error(env):
    """A worker raising (a bug, not a lost worker) is not retried: the run stops with its message, fast, even
    though its peers may be blocked in a collective with it (they get a short grace, then are killed)."""
    import time

    from flexorch.control.elastic import ElasticError

    root, corpus_dir, profile, corpus = env
    cfg = train_config(corpus_dir, root / "raises", profile)
    driver = TrainingDriver(cfg, corpus=corpus)
    try:
        driver.setup()
        driver.step()
        driver.workers.actor(2).add_probe.remote(WorkerFault("micro_batch", 1, 1, "raise"))
        t0 = time.monotonic()
        with pytest.raises(ElasticError, match="worker 2 failed.*injected fault at micro_batch of step 1"):
            driver.step()
        assert time.monotonic() - t0 < 30, "the driver must not wait for the survivors' collective timeout"
    finally:
        driver.shutdown()


def test_a_stuck_planner_is_replaced_and_the_step_runs_a_heuristic_plan(env):
    """A plan that never comes back (CBC stuck) costs plan.timeout_s once, then the run goes on, math unchanged."""
    import time

    from tests.train_helpers import assert_params_close, reference_losses_and_params

    root, corpus_dir, profile, corpus = env
    cfg = train_config(corpus_dir, root / "stuck", profile, plan={"timeout_s": 3.0})
    driver = TrainingDriver(cfg, corpus=corpus)
    try:
        driver.setup()
        driver.planner.add_probe(PlannerHang())  # the planner's next call (step 0's plan) hangs
        t0 = time.monotonic()
        records = [driver.step().record for _ in range(cfg.steps)]
        assert time.monotonic() - t0 < 60
        replicas = driver.replica_parameters()
        events = driver.poll(0)[0]
    finally:
        driver.shutdown()
    assert [r["status"] for r in records][0] == "fallback" and records[0]["shape"]
    assert all(r["status"] != "fallback" for r in records[1:]), "the replacement planner plans the next steps"
    assert any(e["event"] == "planner" and "plan.timeout_s=3" in e["message"] for e in events)
    ref_losses, ref_params = reference_losses_and_params(cfg, corpus, records)
    assert [r["loss"] for r in records] == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
    assert_params_close(replicas, ref_params)


@pytest.mark.parametrize("mode", ["replicate", "fsdp"])
def test_auto_recompute_runs_each_group_in_its_own_mode_and_matches_the_reference(env, mode):
    # [sharding] activation_checkpointing = "auto": each group runs the fastest mode whose bytes fit its shard
    # ('none', 'selective' or 'full'), several in one step (under FSDP too: every rank still runs every micro-batch)
    from flexorch.config.sharding import ShardingSettings
    from flexorch.solver.recompute import choose_modes
    from tests.train_helpers import check_against_reference

    root, corpus_dir, profile, corpus = env
    cfg = train_config(
        corpus_dir, root / f"auto-recompute-{mode}", profile, steps=3,
        sharding=ShardingSettings(mode=mode, activation_checkpointing="auto"),
    )  # fmt: skip
    driver = TrainingDriver(cfg, corpus=corpus)
    try:
        driver.setup()
        events = driver.poll(0)[0]
        measured = driver.profile
        # pinned here (as if measured): the time ratios measured on 2 shared cores decide which packing wins, and
        # the bytes measured on this tiny model (~8x full recompute's without it) leave room at 64 tokens a worker
        # for a shard of ~7 tokens without recompute, so whether a step ran a 'none' group hung on how the batch
        # packed (CI, 2026-11-29: every group 'full' in all 3 steps). At 1.25x a group 'none' fits up to ~51 tokens
        pinned = dict(none_time_ratio=0.75, selective_time_ratio=0.9, none_act_ratio=1.25, selective_act_ratio=1.1)
        planned = measured.with_overrides(**pinned)
        driver.revisions.replace(planned)
        records = [driver.step().record for _ in range(cfg.steps)]
        replicas = driver.replica_parameters()
    finally:
        driver.shutdown()
    # the workers measured what the planner prices a group without recompute, and with selective recompute, at
    assert measured.none_act_ratio > measured.selective_act_ratio > 1
    assert 0 < measured.none_time_ratio <= 1 and 0 < measured.selective_time_ratio <= 1
    assert any("recompute 'auto'" in e.get("message", "") for e in events)
    modes = [m for r in records for row in r["recompute"] for m in row]
    packings = [r.get("recompute_packing") for r in records]
    assert "none" in modes and len(set(modes)) >= 2 and set(modes) <= {"none", "selective", "full"}, (modes, packings)
    for r in records:  # one mode per group, in the plan's order
        assert [len(row) for row in r["recompute"]] == [len(mb) for mb in r["plan"]["micro_batches"]]
        packing = r.get("recompute_packing")
        if packing is not None:  # the planner's own plan (not a fallback): the faster packing, its time predicted
            assert packing["packing"] in ("full", "none", "selective")
            assert r["predicted_ms"] == pytest.approx(packing[f"{packing['packing']}_ms"])
            # and each group ran the fastest mode whose bytes fit its shard: what the planner chose is what ran
            assert [list(row) for row in choose_modes(_plan_of(r, planned), planned)] == r["recompute"]
    assert any(r.get("recompute_packing") for r in records)
    check_against_reference(cfg, corpus, records, replicas)


def _plan_of(record, profile):
    """The solver's Plan of a step record's ``plan``."""
    from flexorch.solver.plan import Group, MicroBatch, Plan

    mbs = [
        MicroBatch(tuple(Group(g["degree"], g["kind"], tuple(g["ranks"]), tuple(g["seq_ids"])) for g in mb))
        for mb in record["plan"]["micro_batches"]
    ]
    return Plan.for_profile(
        num_devices=record["plan"]["num_devices"], seq_lengths=record["seq_lengths"], micro_batches=mbs, profile=profile
    )


def test_a_calibrated_fsdp_run_trains_what_the_reference_trains(env):
    # calibration measures activation memory with a forward that has no backward; on an FSDP2 model that left the
    # root unit's gathered parameters in place, and from the second step on the run trained with the root's
    # parameters of one update before (found 2026-11-26: second loss 6e-6 off the reference, third 5e-3)
    from flexorch.config.sharding import ShardingSettings
    from tests.train_helpers import run_driver

    root, corpus_dir, _, corpus = env
    cfg = train_config(
        corpus_dir, root / "calibrated-fsdp", "auto", workers=2, steps=3, plan={"tokens_per_worker": 128},
        sharding=ShardingSettings(mode="fsdp"),
    )  # fmt: skip
    records, replicas = run_driver(cfg, corpus)
    assert (root / "calibrated-fsdp" / "calibration.json").is_file()  # it calibrated
    check_against_reference(cfg, corpus, records, replicas)
