"""The planner client's spec (built with keywords) and its thread safety: the drain watch's thread calls
``plan_ahead(..., also=True)`` while the run loop's thread calls ``plan`` (``LocalPlannerClient``, real MILP solves in
threads of this process, no Ray)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from flexorch.control.planner_client import LocalPlannerClient, PlannerSpec
from flexorch.solver.planner_config import PlannerConfig
from flexorch.testing.faults import PlannerHang
from tests.solver_helpers import TINY

LENGTHS = [10, 20, 150, 5]


def _spec(timeout_s: float = 1.0) -> PlannerSpec:
    return PlannerSpec(
        profile=TINY,
        config=PlannerConfig(time_limit_s=0.2, isolate=False),
        static=None,
        pipeline_stages=1,
        pipeline_params="stage",
        timeout_s=timeout_s,
    )


def test_planner_spec_takes_keywords_only():
    with pytest.raises(TypeError):
        PlannerSpec(TINY, PlannerConfig(), None, 1, "stage", 1.0)  # type: ignore[misc]


@pytest.mark.parametrize("mode, barrier", [("replicate", False), ("fsdp", True)])
def test_for_run_puts_sharded_state_in_task_barrier(mode, barrier):
    plan = SimpleNamespace(time_limit_s=0.5, kinds=["ulysses"], solver="highs", hybrid=False, static=None,
                           timeout_s=7.0, tasks="spindle")  # fmt: skip
    cfg = SimpleNamespace(plan=plan, pipeline=SimpleNamespace(stages=1, params="stage"), tasks=[],
                          sharding_mode=mode, pipelined=False, recompute="full")  # fmt: skip
    spec = PlannerSpec.for_run(cfg, TINY)
    assert spec.task_barrier is barrier and spec.timeout_s == 7.0 and spec.task_method == "spindle"
    assert spec.pipeline_recompute == "auto" and spec.adapter_ranks == () and spec.static is None


def test_plan_ahead_from_another_thread_never_reaches_a_replaced_planner():
    """The run thread's plan hangs (a stuck solve) and times out, so the client replaces its planner; meanwhile the
    drain watch's thread asks for the next step on fewer workers. That solve went to the stuck planner (queued behind
    the hung solve): the restart must drop it, so the next step gets a fresh solve from the new planner instead of
    waiting out a second timeout on the old one."""
    events: list[dict] = []
    client = LocalPlannerClient(_spec(timeout_s=1.0), events.append)
    try:
        client.add_probe(PlannerHang(calls=1))
        waiting = threading.Event()
        real_wait = client._wait

        def wait(handle, timeout_s):
            waiting.set()
            return real_wait(handle, timeout_s)

        client._wait = wait
        drain = threading.Thread(target=lambda: (waiting.wait(5), client.plan_ahead(1, LENGTHS, 2, also=True)))
        drain.start()
        first = client.plan(0, LENGTHS, 4)
        drain.join(5)
        assert first.fallback_reason == "timeout" and first.heuristic
        t0 = time.monotonic()
        second = client.plan(1, LENGTHS, 2)
        assert second.fallback_reason is None and not second.heuristic, second.fallback_message
        assert time.monotonic() - t0 < 1.0, "the next step waited on the replaced planner"
    finally:
        client.close()


def test_concurrent_plan_ahead_and_plan_keep_the_pending_solves_consistent():
    """plan_ahead(also=True) from a second thread beside the run thread's plan_ahead / plan / forget / set_profile:
    every answer is the planner's own plan, and a refit handed over while both threads submit solves is not lost."""
    client = LocalPlannerClient(_spec(timeout_s=30.0), lambda _: None)
    errors: list[BaseException] = []

    def drain() -> None:
        for _ in range(40):
            try:
                client.plan_ahead(7, LENGTHS, 2, also=True)
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)
            time.sleep(0.005)

    try:
        thread = threading.Thread(target=drain)
        thread.start()
        for step in range(4):
            client.plan_ahead(step, LENGTHS, 4)
            got = client.plan(step, LENGTHS, 4)
            assert got.plan is not None and got.fallback_reason is None, got.fallback_message
            if step == 2:
                client.forget()
        client.set_profile(TINY.with_overrides(name="tiny-refit", b1_ms=6.0))
        thread.join(30)
        assert not errors and not thread.is_alive()
        assert client.plan(9, LENGTHS, 4).plan is not None
        assert client.planner.profile.name == "tiny-refit" and client.spec.profile.name == "tiny-refit"
    finally:
        client.close()
