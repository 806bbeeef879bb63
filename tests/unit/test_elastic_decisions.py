"""Roll-back, out-of-memory re-plan and the recovery record as typed values (``control.membership``), and the
executor handing a roll-back to the driver as the policy's decision (``control.elastic.RollingBack``)."""

from __future__ import annotations

import pytest

from flexorch.control.elastic import Elastic, RollingBack
from flexorch.control.failures import Failure
from flexorch.control.membership import ElasticPolicy, Recovery, ReplanForMemory, RollBack
from tests.fake_cluster import FakeWorkerGroup
from tests.unit.test_driver_transitions import _cfg, profile  # noqa: F401 - the module's profile fixture

POLICY = ElasticPolicy(min_workers=1, max_workers=4)


def test_parts_lost_is_a_roll_back_naming_the_lost_sorted():
    drain = {"node": "node-1", "fallback": "the handoff left a part behind"}
    assert POLICY.on_parts_lost((3, 1), "head lost") == RollBack((1, 3), "head lost")
    got = POLICY.on_parts_lost([2], "why", "leave draining node node-1", drain)
    assert got == RollBack((2,), "why", "leave draining node node-1", drain)


def test_out_of_memory_is_a_replan_whatever_else_was_lost():
    assert POLICY.on_out_of_memory(Failure(frozenset({1}))) is None
    oom = Failure(frozenset(), out_of_memory=frozenset({0, 2}), oom_messages=((0, "tried 2 GiB"), (2, "tried 3 GiB")))
    assert POLICY.on_out_of_memory(oom) == ReplanForMemory(frozenset({0, 2}), ((0, "tried 2 GiB"), (2, "tried 3 GiB")))
    both = Failure(frozenset({3}), out_of_memory=frozenset({1}))  # a worker lost too: still planned for less memory
    assert POLICY.on_out_of_memory(both) == ReplanForMemory(frozenset({1}))


def test_a_recovery_record_has_the_keys_in_the_order_the_records_write_them():
    base = Recovery("run step 3", 1, ("Shrink",), (2,), "workers [2] died or hung", (0, 1, 2), (0, 1), False, 12.5)
    assert list(base.to_record().items()) == [
        ("what", "run step 3"),
        ("attempt", 1),
        ("decisions", ["Shrink"]),
        ("lost", [2]),
        ("reason", "workers [2] died or hung"),
        ("world_before", [0, 1, 2]),
        ("world_after", [0, 1]),
        ("step_completed", False),
        ("recovery_ms", 12.5),
    ]
    full = Recovery(
        "run step 3", 1, ("Shrink",), (2,), "r", (0, 1, 2), (0, 1), True, 12.5, detected_by="heartbeat",
        detect_ms=3.0, drain={"node": "n"}, layout="hsdp: 2 replicas", out_of_memory={"workers": [1]},
    )  # fmt: skip
    rec = full.to_record()
    assert list(rec)[9:] == ["detected_by", "detect_ms", "drain", "layout", "out_of_memory"]
    assert (rec["detected_by"], rec["detect_ms"], rec["step_completed"]) == ("heartbeat", 3.0, True)


def test_recover_returns_a_recovery_and_hands_a_lost_part_to_the_driver_as_a_roll_back(tmp_path, profile):  # noqa: F811
    group = FakeWorkerGroup(_cfg(tmp_path, profile), slots=4)
    group.form_world()
    events: list = []
    elastic = Elastic(group, POLICY, events.append, lambda: "hint")
    got = elastic.recover(Failure(frozenset({3}), completed=frozenset({0})), 0, "run step 0")
    assert isinstance(got, Recovery) and got.step_completed and got.world_after == (0, 1, 2) and got.lost == (3,)
    assert events[-1] == {"event": "membership", **got.to_record()}
    head = [p for p in group.parts if p == "head"]
    group.held = {0: frozenset(set(group.parts) - set(head)), 1: frozenset(set(group.parts) - set(head)),
                  2: frozenset(group.parts)}  # fmt: skip
    with pytest.raises(RollingBack) as e:
        elastic.recover(Failure(frozenset({2})), 0, "run step 1")
    assert e.value.decision == RollBack((2,), str(e.value), None, None) and "head" in e.value.decision.reason
