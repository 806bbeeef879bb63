"""A node being drained (a preemption notice, ``ray drain-node``) becomes a planned leave at the next step boundary.

Without Ray: the policy's decision on a drain (``ElasticPolicy.on_drain``), the drain watch (``control.drains``),
what a handoff must move (``tasks.placement.handoff_needs``), and the real ``TrainingDriver`` stepped over the
in-process fake worker group (``tests.fake_cluster``) with a node drained between steps: who leaves, the record's
``drain`` recovery, the console line, nothing re-run, and the parameters against the single-process reference. The
short-deadline fallback and a node that goes mid-handoff take the lost-node path, and their records say so. A real
multi-node Ray drain is ``tests/cluster/test_drain_cluster.py``.
"""

from __future__ import annotations

import time

import pytest

from flexorch.cli.train_console import format_membership
from flexorch.control.drains import DrainWatch, NodeDrain
from flexorch.control.membership import ElasticPolicy, Leave, Stay
from flexorch.control.transitions import Ran
from flexorch.records.writer import read_records
from flexorch.work.placement import ALL, handoff_needs, model_parts
from tests.fake_cluster import Fault, fake_driver
from tests.unit import test_driver_transitions as transitions
from tests.unit.test_driver_transitions import STATIC, _batches, _cfg, _check_params

corpus, profile = transitions.corpus, transitions.profile  # the fake group's corpus and profile fixtures


# ---------------------------------------------------------------- the policy, the watch, the handoff's moves
def test_the_policy_leaves_when_there_is_time_and_stays_when_not():
    policy = ElasticPolicy(min_workers=2, max_workers=4)
    assert policy.on_drain([0, 1, 2, 3], [3, 2], 45.0, 5.0) == Leave((2, 3), (0, 1))
    assert policy.on_drain([0, 1, 2, 3], [2, 3], None, 5.0) == Leave((2, 3), (0, 1)), "no deadline: leave now"
    short = policy.on_drain([0, 1, 2, 3], [2, 3], 1.0, 5.0)
    assert isinstance(short, Stay) and "1.0 s away and a handoff needs about 5.0 s" in short.reason
    few = policy.on_drain([0, 1, 2], [1, 2], 60.0, 5.0)
    assert isinstance(few, Stay) and "1 workers would be left, below min_workers=2" in few.reason
    every = policy.on_drain([0, 1], [0, 1], 60.0, 5.0)
    assert isinstance(every, Stay) and "no one is left" in every.reason
    with pytest.raises(ValueError, match=r"workers \[5\] are leaving but not members"):
        policy.on_drain([0, 1], [5], 60.0, 5.0)


def test_the_watch_stamps_each_drain_once_and_hands_out_only_those_of_members_nodes():
    drains = {"b": NodeDrain("b", time.time() + 30, ip="10.0.0.8")}
    members = {0: "a", 1: "a", 2: "b", 3: "b"}
    events = []
    watch = DrainWatch(lambda: list(drains.values()), lambda: members, events.append, interval_s=0.01)
    t0 = time.time()
    watch.start()
    deadline = time.monotonic() + 5
    while not events and time.monotonic() < deadline:
        time.sleep(0.01)
    watch.close()
    (ev,) = events
    assert ev["event"] == "drain_seen" and ev["workers"] == [2, 3] and ev["node_ip"] == "10.0.0.8"
    assert ev["reason"] == "preemption", "a node holding busy workers accepts no other drain"
    assert t0 <= ev["seen_at"] <= time.time() and 25 < ev["left_s"] <= 30
    drains["c"] = NodeDrain("c", None)  # a node of no member: seen, never handed out, not announced
    drains["a"] = NodeDrain("a", time.time() + 10)
    taken = watch.take(members)
    assert [(d.node_id, on) for d, on in taken] == [("a", [0, 1]), ("b", [2, 3])], "soonest deadline first"
    assert taken[1][0].seen_at == ev["seen_at"], "the time it was first seen"
    assert watch.take(members) == [] and len(events) == 2
    members[4] = "b"  # a worker that joined on node b after its drain was handed out
    assert [(d.node_id, on) for d, on in watch.take(members)] == [("b", [4])]
    assert watch.draining("c").deadline is None and watch.draining("c").reason == "unknown"
    assert watch.draining("z") is None
    own = []
    driver_node = DrainWatch(lambda: [NodeDrain("d", time.time() + 20, ip="10.0.0.9")], dict, own.append, own_node="d")
    driver_node.poll()
    assert own[0]["event"] == "progress" and own[0]["message"].startswith(
        "node 10.0.0.9, which runs the driver, is draining (unknown, 2"
    )

    def broken():
        raise ConnectionError("GCS unreachable")

    flaky = DrainWatch(broken, lambda: members, events.append)
    assert flaky.take(members) == [] and flaky.errors == 1


def test_a_worker_s_sigterm_is_a_drain_that_only_it_leaves_by():
    members = {0: "a", 1: "a", 2: "b", 3: "b"}
    signalled, events = {}, []
    watch = DrainWatch(lambda: [], lambda: members, events.append, notices=lambda: signalled, grace_s=30.0)
    assert watch.take(members) == [] and events == []
    at = time.time() - 2.0  # worker 3 got SIGTERM 2 s ago; worker 2 on the same node did not
    signalled[3] = at
    taken = watch.take(members)
    assert [(d.node_id, on, d.reason) for d, on in taken] == [("b", [3], "sigterm")]
    assert taken[0][0].deadline == pytest.approx(at + 30.0) and taken[0][0].seen_at >= at
    (ev,) = events
    assert ev["event"] == "drain_seen" and ev["workers"] == [3] and 27 < ev["left_s"] <= 28.5
    line = format_membership(ev)
    assert line.startswith("membership: SIGTERM on node b (2") and "s of grace left): workers [3] leave" in line
    assert watch.take(members) == [] and len(events) == 1, "announced and handed out once"
    signalled[7] = at  # a worker that is no member (it left already): ignored
    assert watch.take(members) == [] and len(events) == 1
    assert ElasticPolicy(1, 4).on_drain([0, 1, 2, 3], [3], 28.0, 1.0) == Leave((3,), (0, 1, 2))


def test_a_handoff_moves_the_parts_only_the_leaving_hold():
    parts = model_parts(4)
    stage0, stage1 = frozenset(parts[:3]), frozenset(parts[3:])
    held = {0: stage0, 1: stage0, 2: stage1, 3: stage1}
    needed = handoff_needs(held, [0, 1, 2, 3], [2, 3], parts)
    assert needed[2:] == [stage1, stage1], "the leaving keep theirs until they go"
    assert needed[0] | needed[1] == frozenset(parts) and needed[0] >= stage0 and needed[1] >= stage0
    assert handoff_needs(held, [0, 1, 2, 3], [1, 3], parts) is None, "a stayer holds every part of the leaving"
    assert handoff_needs({0: ALL, 1: ALL}, [0, 1], [1], parts) is None, "replicas"


# ---------------------------------------------------------------- the driver over the fake group
def _drain_after(driver, group, steps: int, node: str, deadline_s: float | None):
    """Train ``steps`` steps, then start draining ``node``."""
    out = [driver.step() for _ in range(steps)]
    group.drain(node, deadline_s)
    return out


def test_a_drained_node_leaves_at_the_next_boundary_and_nothing_is_rerun(tmp_path, profile, corpus):
    cfg = _cfg(tmp_path, profile, steps=4)
    batches = _batches(cfg, 4)
    driver, group = fake_driver(cfg, corpus)
    events, asked = [], []
    ahead = driver.planner.plan_ahead
    driver.planner.plan_ahead = lambda step, lengths, n, *a, **k: (
        asked.append((step, n)),
        ahead(step, lengths, n, *a, **k),
    )
    try:
        _drain_after(driver, group, 2, "node-1", 45.0)  # workers 2 and 3
        t = driver.step()
        # the plan of the step after the drain was started for the smaller world when the drain was seen (here at
        # the boundary's poll), asked again when the leave was decided (the solve under way is kept), then the next
        # one while that step ran
        assert asked == [(1, 4), (2, 4), (2, 2), (2, 2), (3, 2)], asked
        assert (t.ran, t.step, t.decisions) == (Ran.TRAINED, 2, ()), "no failure, no decision after one"
        (rec,) = t.recoveries
        assert rec["what"] == "drain" and rec["left"] == [2, 3] and rec["workers"] == [2, 3]
        assert (rec["world_before"], rec["world_after"]) == ([0, 1, 2, 3], [0, 1]) and rec["after_step"] == 1
        assert rec["reason"] == "preemption" and rec["node_ip"] == "10.0.0.7" and rec["fallback"] is None
        assert 40 < rec["deadline_left_s"] <= 45 and rec["seen_at"] <= time.time() and not rec["rerun"]
        assert rec["recovery_ms"] >= rec["reform_ms"] >= 0 and rec["handoff_bytes"] == 0
        assert t.record["world_size"] == 2 and t.record["worker_ids"] == [0, 1]
        assert t.record["doc_ids"] == batches[2], "the step after the drain trains the next batch, once"
        assert group.worlds[-1] == (0, 1) and group.free_slots() == 0, "the drained node's slots went with it"
        assert group.retired == [2, 3], "the leaving were told to retire (freeze their objects) before the kill"
        line = format_membership({"event": "membership", **rec})
        assert line.startswith("membership: node 10.0.0.7 draining (preemption, 4"), line
        assert "s): workers [2, 3] left after step 1 in " in line and "nothing re-run" in line, line
        assert line.endswith("world 4 -> 2"), line
        events = driver.events.poll(0)[0]
        t = driver.step()
        assert t.recoveries == () and t.record["world_size"] == 2
        _check_params(driver, corpus, cfg, batches)
    finally:
        driver.shutdown()
    seen = [e for e in events if e["event"] == "drain_seen"]
    assert len(seen) == 1 and seen[0]["workers"] == [2, 3], "announced once, when first seen"
    assert format_membership(seen[0]).endswith("workers [2, 3] leave at the next step boundary")
    recs = read_records(cfg.run_dir + "/steps.jsonl", validate=True)
    assert [r["step"] for r in recs] == [0, 1, 2, 3] and [len(r["recoveries"]) for r in recs] == [0, 0, 1, 0]


def test_a_drain_seen_mid_step_starts_the_smaller_worlds_plan_which_the_step_after_takes(tmp_path, profile, corpus):
    cfg = _cfg(tmp_path, profile, steps=3)
    driver, group = fake_driver(cfg, corpus)
    solves = []
    submit = driver.planner._submit
    driver.planner._submit = lambda lengths, n, *a, **k: (solves.append(n), submit(lengths, n, *a, **k))[1]
    try:
        driver.step()
        driver.step()  # step 2's plan for 4 workers is being solved "beside" it
        group.drain("node-1", 45.0)  # workers 2 and 3
        driver.elastic.drains.poll()  # what the watch's thread does within half a second, mid-step
        assert solves == [4, 4, 4, 2], "the smaller world's plan is solved as soon as the drain is seen"
        kept = {key[:2] for key in driver.planner._pending}  # (stream step, workers); the nodes are the third
        assert kept == {(2, 4), (2, 2)}, "the full world's is kept: the leave may not happen"
        t = driver.step()
        (rec,) = t.recoveries
        assert rec["left"] == [2, 3] and t.record["world_size"] == 2
        assert solves == [4, 4, 4, 2], "the step after the leave took that plan: nothing was solved again"
    finally:
        driver.shutdown()


def test_a_deadline_too_short_for_a_handoff_stays_and_the_loss_takes_the_lost_node_path(tmp_path, profile, corpus):
    cfg = _cfg(tmp_path, profile, steps=4, plan=STATIC)
    batches = _batches(cfg, 4)
    driver, group = fake_driver(cfg, corpus)
    try:
        _drain_after(driver, group, 1, "node-1", 1.0)
        t = driver.step()
        (rec,) = t.recoveries
        assert rec["what"] == "drain" and rec["left"] == [] and rec["world_after"] == [0, 1, 2, 3]
        assert "a handoff needs about 5.0 s" in rec["fallback"] and "lost-node path" in rec["fallback"]
        assert t.record["world_size"] == 4
        line = format_membership({"event": "membership", **rec})
        assert line.startswith("membership: node 10.0.0.7 draining (preemption, 1 s): workers [2, 3] stay: "), line
        group.inject(Fault(2, "step", 2), Fault(3, "step", 2))  # the deadline passes: the node goes mid-step
        t = driver.step()
        assert t.decisions == ("Shrink",) and t.record["world_size"] == 2
        (lost,) = t.recoveries
        assert lost["lost"] == [2, 3] and lost["drain"]["node"] == "node-1"
        assert lost["drain"]["fallback"] == "the node went before its workers left at a step boundary"
        assert "node 10.0.0.7 was draining" in format_membership({"event": "membership", **lost})
        driver.step()
        _check_params(driver, corpus, cfg, batches)
    finally:
        driver.shutdown()
    assert [r["step"] for r in read_records(cfg.run_dir + "/steps.jsonl", validate=True)] == [0, 1, 2, 3]


def test_a_node_that_goes_during_the_handoff_falls_back_and_the_record_says_so(tmp_path, profile, corpus):
    cfg = _cfg(tmp_path, profile, steps=3, plan=STATIC)
    batches = _batches(cfg, 3)
    driver, group = fake_driver(cfg, corpus)
    try:
        _drain_after(driver, group, 1, "node-1", 60.0)
        group.inject(Fault(2, "handoff", group.membership.epoch), Fault(3, "handoff", group.membership.epoch))
        t = driver.step()
        (rec,) = t.recoveries
        assert rec["decisions"] == ["Shrink"] and rec["lost"] == [2, 3] and not rec["step_completed"]
        assert rec["drain"]["fallback"] == "the handoff did not finish before the node went"
        assert t.record["world_size"] == 2 and t.record["doc_ids"] == batches[1]
        driver.step()
        _check_params(driver, corpus, cfg, batches)
    finally:
        driver.shutdown()


def test_stage_parameters_only_the_drained_node_holds_are_handed_off_not_rolled_back(tmp_path, profile, corpus):
    # 2 stages x 2 workers, stage-local parameters and no checkpoint: node-1 holds workers 2 and 3, all of stage 1,
    # so losing it would end the run (no other holder, nothing to roll back to); drained, they hand stage 1's parts
    # to the stayers and leave, and the run goes on as 2 stages x 1 worker
    cfg = _cfg(tmp_path, profile, steps=3, pipeline={"stages": 2})
    batches = _batches(cfg, 3)
    driver, group = fake_driver(cfg, corpus)
    try:
        (t,) = _drain_after(driver, group, 1, "node-1", 60.0)
        assert t.record["pipeline"]["stage_ranks"] == [[0, 1], [2, 3]]
        t = driver.step()
        (rec,) = t.recoveries
        assert rec["left"] == [2, 3] and rec["fallback"] is None and group.handed_parts > 0
        assert t.ran is Ran.TRAINED and t.record["pipeline"]["stage_ranks"] == [[0], [1]]
        assert t.record["doc_ids"] == batches[1]
        driver.step()
        _check_params(driver, corpus, cfg, batches)
    finally:
        driver.shutdown()


def test_a_drain_of_the_driver_s_node_writes_a_checkpoint_at_the_next_boundary(tmp_path, profile, corpus):
    # the driver does not move: it checkpoints, so the new driver `flexorch train` starts when the node goes
    # re-runs nothing; its workers (on other nodes) stay
    cfg = _cfg(tmp_path, profile, steps=3, plan=STATIC)
    driver, group = fake_driver(cfg, corpus)
    driver.elastic.drains.own_node = "node-9"
    try:
        _drain_after(driver, group, 1, "node-9", 30.0)
        t = driver.step()
        assert t.recoveries == () and t.record["world_size"] == 4
        driver.step()
        events = driver.events.poll(0)[0]
    finally:
        driver.shutdown()
    saved = [e["step"] for e in events if e["event"] == "checkpoint"]
    assert saved == [1], "once, at the boundary after the drain was seen"
    (note,) = [e["message"] for e in events if e["event"] == "progress" and "runs the driver" in e["message"]]
    assert note.startswith("node 10.0.0.7, which runs the driver, is draining (unknown, 3") and "checkpoint" in note


def test_the_schema_checks_drain_recoveries(tmp_path, profile, corpus):
    from flexorch.records.schema import RecordError, validate_record

    cfg = _cfg(tmp_path, profile, steps=2, plan=STATIC)
    driver, group = fake_driver(cfg, corpus)
    try:
        _drain_after(driver, group, 1, "node-1", 45.0)
        rec = driver.step().record
    finally:
        driver.shutdown()
    (stored,) = read_records(cfg.run_dir + "/steps.jsonl", validate=True)[1:]
    drain = stored["recoveries"][0]
    assert drain["what"] == "drain" and drain == {**rec["recoveries"][0], **drain}
    for broken, match in [
        ({k: v for k, v in drain.items() if k != "seen_at"}, "a drain lacks seen_at"),
        ({**drain, "deadline": "soon"}, "drain 'deadline' must be null or unix seconds"),
        ({**drain, "handoff_ms": -1.0}, "a drain its workers left needs 'left' and handoff_ms"),
        ({**drain, "fallback": "too short"}, "a drain's 'fallback' says why its workers stayed"),
        ({**drain, "left": None}, "a drain needs 'workers' and 'left'"),
    ]:
        with pytest.raises(RecordError, match=match):
            validate_record({**stored, "recoveries": [broken]})
    lost = {"what": "run step 3", "lost": [2], "drain": {k: drain[k] for k in ("node", "reason", "deadline")}}
    with pytest.raises(RecordError, match="a drain lacks seen_at, fallback"):
        validate_record({**stored, "recoveries": [lost]})


def test_a_drained_node_lost_before_it_left_rolls_back_and_the_roll_back_says_so(tmp_path, profile, corpus):
    # stage-local parameters, node-1 holds all of stage 1 and its deadline is too near for a handoff: when it goes
    # mid-step the run rolls back to its checkpoint (today's path), and the roll-back's record names the drain
    cfg = _cfg(tmp_path, profile, steps=4, checkpoint_every=1, pipeline={"stages": 2})
    batches = _batches(cfg, 4)
    driver, group = fake_driver(cfg, corpus, slots=6)
    try:
        _drain_after(driver, group, 2, "node-1", 1.0)
        group.inject(Fault(2, "step", 2), Fault(3, "step", 2))
        t = driver.step()
        assert t.ran is Ran.ROLLED_BACK and [r["what"] for r in t.recoveries] == ["drain", "run step 2"]
        assert t.recoveries[0]["fallback"] and t.recoveries[-1]["rollback"]
        assert t.recoveries[-1]["drain"]["fallback"] == "the node went before its workers left at a step boundary"
        line = format_membership({"event": "membership", **t.recoveries[-1]})
        assert "back to the checkpoint of step 2" in line and "node 10.0.0.7 was draining" in line, line
        while not driver.finished:
            driver.step()
        _check_params(driver, corpus, cfg, batches)
    finally:
        driver.shutdown()
    assert [r["step"] for r in read_records(cfg.run_dir + "/steps.jsonl", validate=True)] == [0, 1, 2, 3]


def test_a_retiring_worker_freezes_its_objects_so_dying_collects_nothing():
    import gc
    import weakref

    from flexorch.workers.lifecycle import WorkerLifecycle

    class Big:  # objects in cycles: what a collection would have to scan and free
        def __init__(self):
            self.me = self

    keep = [Big() for _ in range(1000)]
    probe = weakref.ref(keep[0])
    try:
        assert WorkerLifecycle(0).freeze_for_exit() >= len(keep)
        del keep
        gc.collect()
        assert probe() is not None, "frozen: no collection scans or frees it (the process is killed next)"
    finally:
        gc.unfreeze()
    gc.collect()
    assert probe() is None, "unfrozen, the same cycle is collected"


def test_a_checkpoint_still_being_written_completes_before_a_drained_node_s_workers_leave(
    tmp_path, profile, corpus, monkeypatch
):
    """With asynchronous saves (the default) the save of step 2 is still being written at the boundary where the
    drained node's workers leave: the boundary waits for it, so the save completes whole, then they leave."""
    import threading

    from flexorch.control import checkpointer as checkpointer_mod

    real, started = checkpointer_mod.write_model_state, threading.Event()

    def slow(ckpt, state):
        started.set()
        time.sleep(0.5)
        return real(ckpt, state)

    monkeypatch.setattr(checkpointer_mod, "write_model_state", slow)
    cfg = _cfg(tmp_path, profile, steps=4, checkpoint_every=2)
    assert cfg.checkpoint.async_
    driver, group = fake_driver(cfg, corpus)
    try:
        _drain_after(driver, group, 2, "node-1", 45.0)  # the save of step 2 began after the second step
        assert started.wait(5) and driver.checkpointer.in_flight == 2
        t = driver.step()
        events = driver.events.poll(0)[0]
    finally:
        driver.shutdown()
    assert t.recoveries[0]["left"] == [2, 3]
    kinds = [
        (e["event"], e.get("step")) for e in events if e["event"] in ("checkpoint", "checkpoint_wait", "membership")
    ]
    assert kinds == [("checkpoint_wait", 2), ("checkpoint", 2), ("membership", None)], kinds
