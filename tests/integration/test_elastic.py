"""Elastic membership on one Ray node: workers die (or hang) mid-step, the run shrinks in place and goes on.

Real worker actors over gloo; a fault is injected into a worker (``flexorch.testing.faults.WorkerFault``: the
process exits at a chosen point of a chosen step, as on a node loss) so the failure lands at a known place. Every
run is checked against the single-process reference on the same batches (losses and parameters), and the document ledger
against the stream: every document of every step exactly once, in the order of a fault-free run.
"""

from __future__ import annotations

import time

import pytest

from flexorch.cli.train_console import format_membership
from flexorch.config.sharding import ShardingSettings
from flexorch.control.driver import TrainingDriver
from flexorch.control.elastic import ElasticError
from flexorch.records.writer import read_records
from flexorch.testing.faults import WorkerFault
from tests.train_helpers import check_against_reference, run_driver, train_config, training_env

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    yield from training_env(tmp_path_factory, "elastic")


def _cfg(env, name, **kw):
    root, corpus_dir, profile, _ = env
    plan = {"tokens_per_worker": 128, **kw.pop("plan", {})}  # min_workers resolves to 2 (256-token documents)
    return train_config(corpus_dir, root / name, profile, steps=4, plan=plan, **kw)


def _check_against_reference(cfg, corpus, records, replicas):
    check_against_reference(cfg, corpus, records, replicas)
    assert [r["step"] for r in records] == list(range(len(records)))
    on_disk = read_records(cfg.run_dir + "/steps.jsonl", validate=True)
    assert [(r["step"], r["doc_ids"], r["recoveries"]) for r in on_disk] == [
        (r["step"], r["doc_ids"], r["recoveries"]) for r in records
    ]


def test_worker_killed_mid_step_shrinks_in_place_and_matches_the_reference(env):
    cfg = _cfg(env, "kill")
    records, replicas = run_driver(cfg, env[3], faults=[(2, "micro_batch", 1, 1, "exit")])
    assert [r["world_size"] for r in records[:2]] == [4, 3]
    rec = records[1]["recoveries"][0]
    assert rec["lost"] == [2] and rec["decisions"] == ["Shrink"] and not rec["step_completed"]
    assert rec["world_before"] == [0, 1, 2, 3] and rec["world_after"] == [0, 1, 3]
    assert records[1]["worker_ids"] == [0, 1, 3], "stable worker ids, ranks re-assigned"
    ranks = {r for mb in records[1]["plan"]["micro_batches"] for g in mb for r in g["ranks"]}
    assert ranks <= {0, 1, 2}, "the step was re-planned for three workers"
    assert rec["recovery_ms"] < 10_000
    line = format_membership({"event": "membership", **rec})
    assert line.startswith("membership: run step 1: workers [2] died or hung") and "Shrink, world 4 -> 3" in line
    assert line.endswith("re-running the step"), line
    _check_against_reference(cfg, env[3], records, replicas)


@pytest.mark.parametrize("mode", ["replicate", "fsdp"])
def test_a_worker_out_of_memory_replans_the_step_for_less_memory_and_matches_the_reference(env, mode):
    # worker 1's device runs out of memory in step 1 (torch.OutOfMemoryError, injected): not a crash of the run;
    # the activation budget is cut, the same batch is planned again for the same four workers and run; under FSDP
    # the half-done backward's gradients are dropped and the world re-formed from the shards every worker holds
    cfg = _cfg(env, f"oom-{mode}", sharding=ShardingSettings(mode=mode))
    records, replicas = run_driver(cfg, env[3], faults=[(1, "micro_batch", 1, 1, "oom")])
    rec = records[1]["recoveries"][0]
    assert rec["decisions"] == ["Retry"] and rec["lost"] == [] and not rec["step_completed"], rec
    assert "workers [1] ran out of device memory" in rec["reason"]
    oom = rec["out_of_memory"]
    assert oom["workers"] == [1]
    said = "worker 1 ran out of device memory: injected: CUDA out of memory at micro_batch of step 1"
    assert oom["errors"] == [[1, said]]
    assert oom["activation_bytes_after"] == pytest.approx(0.8 * oom["activation_bytes_before"])
    assert oom["tokens_per_worker_after"] < oom["tokens_per_worker_before"]
    assert [r["world_size"] for r in records] == [4, 4, 4, 4]
    line = format_membership({"event": "membership", **rec})
    assert "ran out of device memory: re-plan the step with a smaller memory budget" in line, line
    _check_against_reference(cfg, env[3], records, replicas)


def test_death_after_the_update_keeps_the_step_and_syncs_state(env):
    # worker 1 dies after the gradient all-reduce: the survivors finish the optimizer step; it must not run twice
    cfg = _cfg(env, "after")
    records, replicas = run_driver(cfg, env[3], faults=[(1, "after_sync", 2, 1, "exit")])
    rec = records[2]["recoveries"][0]
    assert rec["lost"] == [1] and rec["step_completed"], rec
    assert records[3]["world_size"] == 3
    _check_against_reference(cfg, env[3], records, replicas)


def test_two_failures_in_one_step_and_a_failure_while_the_world_forms(env):
    # step 1: worker 0 dies mid-step; while the survivors form the new world (epoch 2) worker 3 dies too; the
    # re-run on {1, 2} then loses nobody. Step 2: worker 1 dies before the all-reduce, first attempt.
    cfg = _cfg(env, "two")
    faults = [(0, "micro_batch", 1, 1, "exit"), (3, "join", 2, 1, "exit")]
    records, replicas = run_driver(cfg, env[3], faults=faults)
    recs = records[1]["recoveries"]
    lost = sorted(w for r in recs for w in r["lost"])
    assert lost == [0, 3] and records[1]["world_size"] == 2 and records[1]["worker_ids"] == [1, 2]
    _check_against_reference(cfg, env[3], records, replicas)


def test_a_hung_worker_is_declared_lost_after_the_collective_timeout(env):
    cfg = _cfg(env, "hang", elastic={"collective_timeout_s": 4.0})
    records, replicas = run_driver(cfg, env[3], faults=[(3, "before_sync", 1, 1, "hang")])
    rec = records[1]["recoveries"][0]
    assert rec["lost"] == [3] and records[1]["world_size"] == 3
    assert rec["recovery_ms"] < 30_000
    _check_against_reference(cfg, env[3], records, replicas)


def test_a_stopped_worker_is_found_by_its_heartbeat_not_the_collective_timeout(env):
    # SIGSTOP (a frozen process: its sockets stay open, so its peers' collectives just wait) between steps 0 and 1;
    # its heartbeat stops, the driver kills it after heartbeat_timeout_s and its peers' collectives fail at once,
    # long before the default 120 s collective timeout
    import os
    import signal

    cfg = _cfg(env, "sigstop", elastic={"heartbeat_timeout_s": 3.0})
    driver = TrainingDriver(cfg, corpus=env[3])
    records = []
    try:
        driver.setup()
        pid = driver.workers.call("info")[2]["pid"]
        records.append(driver.step().record)
        os.kill(pid, signal.SIGSTOP)
        while not driver.finished:
            records.append(driver.step().record)
        replicas = driver.replica_parameters()
    finally:
        driver.shutdown()
    rec = records[1]["recoveries"][0]
    assert rec["lost"] == [2] and rec["detected_by"] == "heartbeat", rec
    assert 3_000 <= rec["detect_ms"] < cfg.elastic.collective_timeout_s * 1e3, rec
    assert rec["total_ms"] == pytest.approx(rec["detect_ms"] + rec["recovery_ms"] + rec["rerun_ms"])
    line = format_membership({"event": "membership", **rec})
    assert "after its last heartbeat: its heartbeat stopped" in line, line
    _check_against_reference(cfg, env[3], records, replicas)


def test_a_worker_that_gets_sigterm_leaves_at_the_next_boundary_and_nothing_is_rerun(env):
    # SIGTERM to one worker's process (Slurm's preemption and `scancel` send it to every process of a job, then
    # SIGKILL after the grace time): the worker does not exit (Ray's handler would), its heartbeat announces the
    # notice, and the driver takes it out at the next step boundary as a planned leave, nothing re-run
    import os
    import signal

    cfg = _cfg(env, "sigterm", elastic={"sigterm_grace_s": 45.0})
    driver = TrainingDriver(cfg, corpus=env[3])
    records = []
    try:
        driver.setup()
        records.append(driver.step().record)
        since = len(driver.events.poll(0)[0])
        pid = driver.workers.call("info")[3]["pid"]
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        seen = []
        while not seen and time.monotonic() < deadline:  # its heartbeat announces it within about a second
            time.sleep(0.05)
            seen = [e for e in driver.events.poll(since)[0] if e["event"] == "drain_seen"]
        assert seen and seen[0]["workers"] == [3] and seen[0]["reason"] == "sigterm", seen
        while not driver.finished:
            records.append(driver.step().record)
        replicas = driver.replica_parameters()
    finally:
        driver.shutdown()
    rec = records[1]["recoveries"][0]
    assert rec["what"] == "drain" and rec["reason"] == "sigterm" and rec["left"] == [3] and rec["fallback"] is None
    assert rec["after_step"] == 0 and not rec["rerun"] and 40 < rec["deadline_left_s"] <= 45, rec
    assert [r["world_size"] for r in records] == [4, 3, 3, 3]
    assert [len(r["recoveries"]) for r in records] == [0, 1, 0, 0], "no loss, no re-run"
    line = format_membership({"event": "membership", **rec})
    assert "SIGTERM on node" in line and "workers [3] left after step 0" in line and "nothing re-run" in line, line
    _check_against_reference(cfg, env[3], records, replicas)


def test_all_workers_lost_is_a_clear_error_and_the_checkpoint_is_intact(env):
    from flexorch.control.checkpoint import latest_checkpoint, load_checkpoint

    cfg = _cfg(env, "all", checkpoint_every=1)
    driver = TrainingDriver(cfg, corpus=env[3])
    try:
        driver.setup()
        driver.step()
        driver.step()
        for wid in range(4):
            driver.workers.actor(wid).add_probe.remote(WorkerFault("micro_batch", 2, 1, "exit"))
        with pytest.raises(ElasticError, match=r"all 4 workers were lost.*checkpoint_000002.*--resume"):
            driver.step()
    finally:
        driver.shutdown()
    ckpt = latest_checkpoint(cfg.run_dir)
    state, dstate = load_checkpoint(ckpt)
    assert dstate["step"] == 2 and "model" in state
    assert [r["step"] for r in read_records(cfg.run_dir + "/steps.jsonl")] == [0, 1]
