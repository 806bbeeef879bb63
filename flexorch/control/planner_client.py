"""The driver's planner: a :class:`~flexorch.solver.step_planner.StepPlanner` behind a small client that solves the
next batch while the current step runs, bounds the wait for a plan and falls back to a MILP-free plan.

* :class:`PlannerClient` is the seam the driver plans through (``TrainingDriver(cfg, planner=...)`` takes a factory
  ``(PlannerSpec, publish) -> PlannerClient``).
* :class:`RayPlannerClient` (the default) runs the planner in :data:`StepPlannerActor`, beside the driver, so a
  solve overlaps the step on another process; :class:`LocalPlannerClient` runs the same planner in a daemon thread
  of this process (real MILP solves, no Ray: tests and benchmarks that step the driver in-process).

Both share :class:`_PrefetchingClient`: a plan solved ahead is used only when it was solved for the same stream step and
the same number of workers (a membership change in between makes it stale). A step that cannot get the planner's plan
runs :func:`~flexorch.solver.step_planner.heuristic_plan` (status 'fallback', ``PlannedStep.heuristic``) and says why in
``PlannedStep.fallback_reason``: 'timeout' (not back within ``timeout_s``: the planner is abandoned and replaced),
'crash' (the planner process died: replaced) or 'error' (the planner raised: the message is kept). The planner's own
solves run in a solver process of its own (``solver.planner``), so a native MILP crash normally costs one solve and
never reaches this client.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import ray

from flexorch.solver.planned_step import PlannedStep
from flexorch.solver.planner import PlannerConfig
from flexorch.solver.profiles import Profile
from flexorch.solver.step_planner import StepPlanner, heuristic_plan
from flexorch.solver.topology import Topology

__all__ = [
    "LocalPlannerClient",
    "PlannerClient",
    "PlannerSpec",
    "RayPlannerClient",
    "StepPlannerActor",
]


class _PlannerProcess(StepPlanner):
    """:class:`StepPlanner` as the planner actor runs it, plus its process id (a test kills it)."""

    def pid(self) -> int:
        return os.getpid()


StepPlannerActor = ray.remote(num_cpus=0, max_restarts=0)(_PlannerProcess)
"""``StepPlanner`` in its own worker process (no CPU reserved: it sleeps while the step runs). Not restarted by Ray:
when it dies the client sees it at once, counts a 'crash' fallback and starts a new one (a Ray restart and retry
would spend the step's wait in silence)."""


@dataclass(frozen=True, kw_only=True)
class PlannerSpec:
    """What a planner client needs to build its :class:`StepPlanner` and its fallback. Built with keywords only."""

    profile: Profile
    config: PlannerConfig
    static: tuple[str, int] | None
    """(kind, degree) of a forced static layout (``plan.mode``), None when adaptive."""
    pipeline_stages: int | str
    pipeline_params: str
    timeout_s: float
    """How long a step waits for its plan before the fallback (``plan.timeout_s``)."""
    adapter_ranks: tuple[int, ...] = ()
    """``[[tasks]]``: each task's LoRA rank (0: none); a step's ``task_of`` then gets Spindle's multi-task plan
    (``flexorch.solver.multitask.execute``). Empty: one task."""
    task_method: str = "spindle"
    """How a multi-task step is planned: 'spindle' or 'in_turn' (the tasks one after another on every worker)."""
    task_barrier: bool = False
    """The workers meet at every micro-batch: true with sharded model state (every rank runs every micro-batch), so
    a multi-task plan is timed against the tasks in turn with barriers; replicated workers run without one."""
    niceness: int = 0
    """Added to the planner process's niceness (a separate process only). A run's planner gets none: its solve is a
    few per cent of a step's CPU, and niced beside busy CPU workers it runs out of time (docs/guide/planner.md)."""
    pipeline_recompute: str = "auto"
    """With pipeline stages: what they recompute (``flexorch.solver.pipeline.stage_model.StageModel.recompute``)."""

    @classmethod
    def for_run(cls, cfg, profile: Profile) -> PlannerSpec:
        """The spec of a ``TrainConfig``'s run planned with ``profile``."""
        config = PlannerConfig(
            time_limit_s=cfg.plan.time_limit_s,
            kinds=tuple(cfg.plan.kinds),
            solver=cfg.plan.solver,
            hybrid=cfg.plan.hybrid,
        )
        return cls(
            profile=profile,
            config=config,
            static=cfg.plan.static,
            pipeline_stages=cfg.pipeline.stages,
            pipeline_params=cfg.pipeline.params,
            timeout_s=cfg.plan.timeout_s,
            adapter_ranks=tuple(t.lora_rank for t in cfg.tasks),
            task_method=cfg.plan.tasks,
            task_barrier=cfg.sharding_mode != "replicate",  # sharded state: a barrier at every micro-batch
            pipeline_recompute=cfg.recompute if cfg.pipelined else "auto",
        )

    def planner_args(self, niceness: int) -> tuple:
        return (
            self.profile, self.config, self.static, niceness, self.pipeline_stages, self.pipeline_params,
            self.pipeline_recompute,
        )  # fmt: skip

    def fallback(self, lengths: list[int], n: int, task_of=None) -> PlannedStep:
        if task_of is not None:
            planned = heuristic_plan(
                self.profile, lengths, n, self.static, self.pipeline_stages, self.pipeline_params,
                task_of=task_of, adapter_ranks=self.adapter_ranks, task_method=self.task_method,
            )  # fmt: skip
        else:
            planned = heuristic_plan(
                self.profile, lengths, n, self.static, self.pipeline_stages, self.pipeline_params,
                pipeline_recompute=self.pipeline_recompute,
            )  # fmt: skip
        return dataclasses.replace(planned, profile_revision=self.profile.revision)

    def task_kwargs(self, task_of) -> dict:
        """The multi-task arguments of ``StepPlanner.plan`` for a step's ``task_of`` (none for one task)."""
        if task_of is None:
            return {}
        return {
            "task_of": list(task_of),
            "adapter_ranks": self.adapter_ranks,
            "task_method": self.task_method,
            "task_barrier": self.task_barrier,
        }


class PlannerClient(Protocol):
    """How the driver gets plans: ``plan_ahead`` while a step runs, ``plan`` when the next step starts."""

    def plan(
        self,
        stream_step: int,
        lengths: list[int],
        n: int,
        budget_s: float | None = None,
        task_of=None,
        topology: Topology | None = None,
    ) -> PlannedStep:
        """The plan of stream step ``stream_step`` (its documents' ``lengths``; ``task_of``: each document's
        ``[[tasks]]`` task, None for one task) for ``n`` workers on ``topology`` (their nodes; None: planned as one
        node), solved within ``budget_s`` (default: the planner's ``time_limit_s``) when it was not solved ahead."""
        ...

    def plan_ahead(
        self,
        stream_step: int,
        lengths: list[int],
        n: int,
        budget_s: float | None = None,
        task_of=None,
        also: bool = False,
        topology: Topology | None = None,
    ) -> None:
        """Start solving that plan now, within ``budget_s``; a later :meth:`plan` with the same step, ``n`` and
        ``topology`` takes it. A solve of the same step and ``n`` already under way is kept. ``also``: keep the
        solves ahead of this step for other worker counts too (a drain seen mid-step: the world after it); otherwise
        they are dropped. Callable from another thread than :meth:`plan`'s."""
        ...

    def forget(self) -> None:
        """Drop a plan solved ahead (the stream went back: a roll-back)."""
        ...

    def set_profile(self, profile: Profile) -> None:
        """Plan the solves started from now on (and the fallback) with ``profile`` (a refit cost model)."""
        ...

    def add_probe(self, probe) -> None:
        """Add a probe to the planner (``StepPlanner.add_probe``; tests: ``flexorch.testing.faults.PlannerHang``)."""
        ...

    def close(self) -> None: ...


PlannerFactory = Callable[[PlannerSpec, Callable[[dict], None]], PlannerClient]
"""Builds the run's planner client once the profile is known (``RayPlannerClient`` or ``LocalPlannerClient``)."""


class _PrefetchingClient:
    """Prefetch, timeout and fallback over a planner handle; subclasses say how a solve is started and awaited.

    Thread safety: the run loop's thread calls :meth:`plan`, :meth:`plan_ahead`, :meth:`forget` and
    :meth:`set_profile`, and the drain watch's thread calls ``plan_ahead(..., also=True)`` at the same time. All the
    client's mutable state (``spec``, the solves ahead in ``_pending``, the planner handle that ``_start`` makes and
    ``_submit`` sends to, and a subclass's profile handed to the next solve) is read and written only under
    ``_state_lock``, so a solve is always submitted to the planner in place and a restart drops the solves ahead that
    went to the planner it replaced. Waiting for a solve (``_wait``) happens outside the lock."""

    def __init__(self, spec: PlannerSpec, publish: Callable[[dict], None]):
        self.spec = spec
        self.publish = publish
        self._pending: dict[tuple, object] = {}  # (stream step, workers, topology) -> solve handle
        self._state_lock = threading.RLock()
        with self._state_lock:
            self._start()

    def _start(self) -> None:
        raise NotImplementedError

    def _submit(self, lengths: list[int], n: int, budget_s: float | None = None, task_of=None, topology=None):
        raise NotImplementedError

    def _wait(self, handle, timeout_s: float) -> PlannedStep:
        """The solve's result; raises TimeoutError when it is not back in time."""
        raise NotImplementedError

    def _abandon(self) -> None:
        """Drop the stuck planner (a fresh one is started after)."""

    def _restart(self) -> None:
        """A fresh planner in place of a stuck or dead one; the solves ahead sent to the old one are dropped."""
        with self._state_lock:
            self._abandon()
            self._pending = {}
            self._start()

    def _died(self, error: BaseException) -> bool:
        """True when ``error`` means the planner process is gone (it crashed or was killed)."""
        return False

    def plan(
        self,
        stream_step: int,
        lengths: list[int],
        n: int,
        budget_s: float | None = None,
        task_of=None,
        topology: Topology | None = None,
    ) -> PlannedStep:
        if n < 1:
            raise ValueError(f"stream step {stream_step}: no worker is left to plan for (n={n})")
        with self._state_lock:
            handle = self._pending.pop((stream_step, n, topology), None)
            self._pending = {}
            if handle is None:
                handle = self._submit(lengths, n, budget_s, task_of, topology)
            timeout_s = self.spec.timeout_s
        try:
            return self._wait(handle, timeout_s)
        except TimeoutError:
            self._restart()
            why = (
                f"the planner gave no plan within plan.timeout_s={self.spec.timeout_s:g} s (restarted it); raise "
                "plan.timeout_s if the machine is busy"
            )
            return self._fallback(stream_step, lengths, n, "timeout", why, task_of)
        except Exception as e:  # noqa: BLE001 - any planner failure costs this step's plan, never the run
            if self._died(e):
                self._restart()
                why = f"the planner process died ({type(e).__name__}; restarted it)"
                return self._fallback(stream_step, lengths, n, "crash", why, task_of)
            cause = getattr(e, "cause", None) or e  # optional: Ray's RayTaskError holds the planner's error as .cause
            why = f"the planner raised {type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}"
            return self._fallback(stream_step, lengths, n, "error", why, task_of)

    def _fallback(
        self, stream_step: int, lengths: list[int], n: int, reason: str, why: str, task_of=None
    ) -> PlannedStep:
        self.publish(
            {"event": "planner", "message": f"stream step {stream_step}: {why}; this step runs the heuristic plan"}
        )
        with self._state_lock:
            spec = self.spec
        planned = spec.fallback(lengths, n, task_of)
        return dataclasses.replace(planned, fallback_reason=reason, fallback_message=why)

    def plan_ahead(
        self,
        stream_step: int,
        lengths: list[int],
        n: int,
        budget_s: float | None = None,
        task_of=None,
        also: bool = False,
        topology: Topology | None = None,
    ) -> None:
        key = (stream_step, n, topology)
        with self._state_lock:
            kept = {k: h for k, h in self._pending.items() if k[0] == stream_step and (also or k[1:] == key[1:])}
            if key not in kept:
                kept[key] = self._submit(lengths, n, budget_s, task_of, topology)
            self._pending = kept

    def forget(self) -> None:
        with self._state_lock:
            self._pending = {}

    def set_profile(self, profile: Profile) -> None:
        with self._state_lock:
            self.spec = dataclasses.replace(self.spec, profile=profile)  # a restarted planner and the fallback too
            self._push_profile(profile)

    def _push_profile(self, profile: Profile) -> None:
        raise NotImplementedError


class RayPlannerClient(_PrefetchingClient):
    """The planner in :data:`StepPlannerActor` on the driver's node (it survives the loss of a worker node).

    Thread safety: as :class:`_PrefetchingClient`'s; the actor handle is replaced and submitted to under the client's
    ``_state_lock``, and the actor runs one caller's calls in order."""

    def _start(self) -> None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        # strict: the driver's node is alive while the driver runs, and a planner elsewhere would die with that node
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        args = self.spec.planner_args(self.spec.niceness)
        self.actor = StepPlannerActor.options(scheduling_strategy=here).remote(*args)

    def _submit(self, lengths, n, budget_s=None, task_of=None, topology=None):
        kwargs = self.spec.task_kwargs(task_of)
        return self.actor.plan.remote(lengths, n, time_limit_s=budget_s, topology=topology, **kwargs)

    def _push_profile(self, profile):
        self.actor.set_profile.remote(profile)  # an actor runs one caller's calls in order: before the next solve

    def _wait(self, handle, timeout_s):
        try:
            return ray.get(handle, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError from None

    def _died(self, error: BaseException) -> bool:
        return isinstance(error, ray.exceptions.RayActorError)

    def _abandon(self) -> None:
        ray.kill(self.actor, no_restart=True)

    def inject_crash(self) -> None:
        """Test seam: the planner process dies now (a native crash outside a solve)."""
        with self._state_lock:
            actor = self.actor
        os.kill(ray.get(actor.pid.remote()), signal.SIGKILL)

    def add_probe(self, probe) -> None:
        with self._state_lock:
            done = self.actor.add_probe.remote(probe)
        ray.get(done)

    def close(self) -> None:
        # let the planner close its solver processes first (at most a solve's wait): killed with them still up, its
        # finalizers ran under Ray's SIGTERM handler and printed a traceback into the run's console output
        with self._state_lock:
            actor = self.actor
        try:
            ray.get(actor.close.remote(), timeout=_CLOSE_WAIT_S)
        except Exception:  # noqa: BLE001 - stuck, dead or busy past the wait: it is killed all the same
            pass
        ray.kill(actor)


_CLOSE_WAIT_S = 3.0


class LocalPlannerClient(_PrefetchingClient):
    """The planner in this process: each solve runs in a daemon thread, one at a time (as the actor runs its calls),
    so a solve ahead overlaps the step and a stuck one is abandoned without blocking the process's exit.

    Thread safety: as :class:`_PrefetchingClient`'s; the planner, its solve lock and the refit handed to the next
    solve are replaced and read under the client's ``_state_lock``, and the solves themselves take the planner's
    ``_solve_lock`` (a ``StepPlanner`` plans one batch at a time)."""

    def _start(self) -> None:
        self.planner = StepPlanner(*self.spec.planner_args(0))  # never renice the caller's own process
        self._solve_lock = threading.Lock()
        self._profile: Profile | None = None  # a refit the next solve takes up (a solve in flight holds the lock)

    def _push_profile(self, profile):
        self._profile = profile

    def _submit(self, lengths, n, budget_s=None, task_of=None, topology=None):
        future: concurrent.futures.Future = concurrent.futures.Future()
        kwargs = self.spec.task_kwargs(task_of)
        planner, lock, profile, self._profile = self.planner, self._solve_lock, self._profile, None

        def solve() -> None:
            with lock:
                if profile is not None:
                    planner.set_profile(profile)
                try:
                    future.set_result(planner.plan(lengths, n, time_limit_s=budget_s, topology=topology, **kwargs))
                except BaseException as e:  # noqa: BLE001 - handed to the waiting step
                    future.set_exception(e)

        threading.Thread(target=solve, name="flexorch-plan", daemon=True).start()
        return future

    def _wait(self, handle, timeout_s):
        return handle.result(timeout=timeout_s)  # concurrent.futures.TimeoutError is TimeoutError (3.11)

    def add_probe(self, probe) -> None:
        with self._state_lock:
            self.planner.add_probe(probe)

    def close(self) -> None:
        with self._state_lock:
            planner = self.planner
        planner.close()
