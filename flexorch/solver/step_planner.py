"""One batch in, one :class:`PlannedStep` out: the single planning path of ``flexorch plan`` and ``flexorch train``.

:class:`StepPlanner` wraps :class:`~flexorch.solver.planner.Planner` (adaptive SP groups, never slower than the
BatchAda floor: ``solver.adaptive_step``), :func:`~flexorch.solver.baselines.static_plan` (a forced static layout,
for comparisons and the invariant tests) or :func:`~flexorch.solver.pipeline.staged.plan_staged` (pipeline stages),
and adds the baselines' predicted step times to every answer, each by adding to the one result type
(``solver.planned_step``). :func:`heuristic_plan` is the MILP-free fallback.
Pure: the control plane runs a :class:`StepPlanner` in its own Ray actor (:mod:`flexorch.control.planner_client`)
so a solve overlaps a step.

A step of several tasks (``task_of``: each sequence's task) is planned by Spindle's schedule with an SP plan per
part (:func:`flexorch.solver.multitask.execute.plan_task_step`; the MILP planner per part in ``solver.task_steps``,
BatchAda in :func:`heuristic_plan`): one ``Plan`` whose every group runs one task's sequences.
"""

from __future__ import annotations

import dataclasses
import os
import time

from flexorch.solver.adaptive_step import plan_adaptive
from flexorch.solver.baselines import baseline_plans, baseline_times_ms, static_plan
from flexorch.solver.cost_model import ULYSSES, kind_allowed
from flexorch.solver.errors import InfeasibleBatchError, PlanningError
from flexorch.solver.multitask.execute import plan_task_step
from flexorch.solver.pipeline.staged import fallback_staged, pipeline_baselines, plan_staged
from flexorch.solver.planned_step import HEURISTIC, PlannedStep
from flexorch.solver.planner import Planner, PlannerConfig
from flexorch.solver.profiles import Profile
from flexorch.solver.recompute import with_chosen_modes
from flexorch.solver.simulator import step_time_ms
from flexorch.solver.task_steps import check_task_mode, plan_tasks
from flexorch.solver.validation import check_num_devices

__all__ = ["PlannedStep", "StepPlanner", "heuristic_plan", "planner_profile", "stage_memory_profile"]


def planner_profile(
    profile: Profile,
    *,
    num_heads: int,
    num_kv_heads: int,
    tokens_per_worker: int,
    head_size: int = 0,
    attention_window: int = 0,
    window_fraction: float = 0.0,
    num_layers: int | None = None,
    vocab_size: int | None = None,
    stage_bytes: tuple[float, float] | None = None,
    model_state_bytes: float | None = None,
    activation_budget_bytes: float | None = None,
) -> Profile:
    """``profile`` with the model's heads (and layers: pipeline stages split them), a memory budget of
    ``tokens_per_worker`` activation tokens on a worker of any group (a Ulysses group's all-to-all copies make its
    tokens the costliest, ``Profile.act_bytes_per_local_token``: one device and ring groups then hold a few per cent
    more), and (with ``vocab_size``) the LM head's share of the activations, held
    by the last pipeline stage: the fp32 log-softmax the loss keeps (``vocab * 4`` bytes per token) and the final
    norm's and the head's inputs (about 4 hidden-size vectors, docs/guide/planner.md), at most half of
    all. ``stage_bytes`` (per layer, head), measured on real stages
    (``flexorch.workers.calibrate.stage_activation_bytes``), replace the activation bytes and the head's share
    (pipelined runs: the budget is then in stage-measured bytes). ``model_state_bytes``: what the executor holds
    per worker in the run's sharding mode (``flexorch.solver.model_state``), replacing the profile's assumption.
    ``activation_budget_bytes``: the bytes a worker has for activations, measured from its device
    (``flexorch.control.memory_budget``), the budget's activation part as it is instead of ``tokens_per_worker``
    tokens of the costliest group."""
    extra: dict = {"num_layers": num_layers} if num_layers is not None else {}
    if model_state_bytes is not None:
        profile = profile.with_overrides(model_state_bytes=model_state_bytes)
    if stage_bytes is not None:
        per_layer, head = stage_bytes
        layers = num_layers if num_layers is not None else profile.num_layers
        profile = profile.with_overrides(act_bytes_per_token=per_layer * layers + head, head_bytes_per_token=head)
    if stage_bytes is None and vocab_size is not None:
        head = 4.0 * vocab_size + 4.0 * profile.hidden * profile.bytes_per_element
        extra["head_bytes_per_token"] = min(head, 0.5 * profile.act_bytes_per_token)
    profile = profile.with_overrides(
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        attention_window=attention_window,
        window_fraction=window_fraction,
        **extra,
    )
    degrees = [d for d in (2**i for i in range(num_heads.bit_length())) if kind_allowed(ULYSSES, d, profile)]
    costliest = max(profile.act_bytes_per_local_token(ULYSSES, d) for d in degrees)
    act = (tokens_per_worker + 0.5) * costliest if activation_budget_bytes is None else activation_budget_bytes
    return profile.with_overrides(memory_budget_bytes=profile.model_state_bytes + act)


class StepPlanner:
    """Plans steps for one profile; ``static`` = (kind, degree) forces one layout; ``pipeline_stages`` other than 1
    plans pipelines (``flexorch.solver.pipeline.staged``) instead of SP groups."""

    def __init__(
        self,
        profile: Profile,
        config: PlannerConfig,
        static: tuple[str, int] | None = None,
        niceness: int = 0,
        pipeline_stages: int | str = 1,
        pipeline_params: str = "stage",
        pipeline_recompute: str = "auto",
    ):
        if niceness:  # the solve overlaps the step: on shared CPUs it must not take cycles from the workers
            os.nice(niceness)
        self.profile = profile
        self.pipeline_profile = stage_memory_profile(profile, pipeline_params)
        self.static = static
        self.config = config
        self.pipeline_stages = pipeline_stages
        self.pipeline_params = pipeline_params
        self.pipeline_recompute = pipeline_recompute
        """What pipeline stages recompute (``flexorch.solver.pipeline.stage_model.StageModel.recompute``)."""
        self._planner = Planner(profile, config) if static is None and pipeline_stages == 1 else None
        self._probes: list = []  # called at each plan (add_probe); none in a run
        self._calls = 0
        self._baselines_s: float | None = None  # what the baselines took last step: the share kept for them

    def set_profile(self, profile: Profile) -> None:
        """Plan the next steps with ``profile`` (a refit of the time terms: ``flexorch.solver.refit``)."""
        self.profile = profile
        self.pipeline_profile = stage_memory_profile(profile, self.pipeline_params)
        if self._planner is not None:
            self._planner.profile = profile

    def add_probe(self, probe) -> None:
        """Call ``probe.at("plan", n)`` as the ``n``-th plan call starts, and ``probe.at("solve", job)`` as each MILP
        solve's job is made (``solver.split_solver``); tests add ``flexorch.testing.faults`` probes (a stuck solve,
        a native crash of the MILP library)."""
        self._probes.append(probe)
        if self._planner is not None:
            self._planner.add_probe(probe)

    def plan(
        self,
        lengths,
        num_devices: int,
        with_baselines: bool = True,
        time_limit_s: float | None = None,
        *,
        task_of=None,
        adapter_ranks=None,
        task_method: str = "spindle",
        task_barrier: bool = False,
        topology=None,
    ) -> PlannedStep:
        """Plan one batch within ``time_limit_s`` (default ``config.time_limit_s``) of wall time, everything included
        (the MILP planner, the BatchAda floor, the baselines' predictions); the answer says the budget it had.
        ``topology`` (``solver.topology.Topology``): SP groups placed and priced by node (None: one node).

        ``task_of`` (each sequence's task 0..T-1) makes it a step of several tasks, ``adapter_ranks[t]`` task t's
        LoRA rank: planned by ``task_method`` ('spindle', 'in_turn' or 'fixed_split'; see
        :func:`flexorch.solver.task_steps.plan_tasks`)."""
        limit = self.config.time_limit_s if time_limit_s is None else float(time_limit_s)
        if not limit > 0:
            raise ValueError(f"time_limit_s must be > 0 seconds, got {time_limit_s!r}")
        tasks = None
        if task_of is not None:
            check_task_mode(self.static, self.pipeline_stages)
            tasks = (task_of, adapter_ranks, task_method, task_barrier)
        return dataclasses.replace(
            self._plan(lengths, num_devices, with_baselines, limit, tasks, topology),
            budget_s=limit,
            profile_revision=self.profile.revision,
        )

    def _plan(self, lengths, num_devices: int, with_baselines: bool, limit: float, tasks=None, topology=None):
        """Several tasks, a pipeline, adaptive SP groups or a static layout, by ``limit`` seconds from now."""
        self._calls += 1
        for probe in self._probes:
            probe.at("plan", self._calls)
        t0 = time.perf_counter()
        start = time.monotonic()
        deadline = start + limit
        used = {"crashes": 0}  # the solver crashes so far, also for an answer that there is no plan
        try:
            check_num_devices(num_devices)
            if tasks is not None:
                return self._plan_tasks(lengths, num_devices, with_baselines, limit, deadline, t0, tasks)
            if self.pipeline_stages != 1:
                return self._plan_pipeline(lengths, num_devices, t0, limit)
            if self.static is None:
                return self._plan_adaptive(lengths, num_devices, limit, start, deadline, t0, used, topology)
            return self._plan_static(lengths, num_devices, with_baselines, deadline, t0, topology)
        except PlanningError as e:
            return PlannedStep(
                None,
                solve_s=time.perf_counter() - t0,
                status="infeasible",
                error=str(e),
                solver_crashes=used["crashes"],
            )

    def _plan_adaptive(self, lengths, num_devices: int, limit: float, start, deadline, t0, used, topology=None):
        """Adaptive SP groups (:func:`flexorch.solver.adaptive_step.plan_adaptive`), the baselines' time measured."""
        try:
            got = plan_adaptive(self._planner, lengths, num_devices, limit, start, deadline, self._baselines_s, used,
                                topology)  # fmt: skip
        finally:  # what the baselines took, kept also where the plan then failed
            self._baselines_s = used.get("baselines_s", self._baselines_s)
        return dataclasses.replace(got, solve_s=time.perf_counter() - t0, solver_crashes=used["crashes"])

    def _plan_static(self, lengths, num_devices: int, with_baselines: bool, deadline: float, t0, topology=None):
        """The forced static layout (``static``), with the baselines' predicted times."""
        kind, d = self.static
        plan = static_plan(lengths, num_devices, self.profile, d, kind, deadline=deadline, topology=topology)
        if plan is None:
            raise InfeasibleBatchError(
                f"the static layout {kind} x{d} cannot run this batch on {num_devices} workers (a document "
                f"needs a larger group than {d} x {self.profile.tokens_per_device} tokens)"
            )
        plan = with_chosen_modes(plan, self.profile)
        predicted, bound, status = step_time_ms(plan, self.profile), 0.0, f"static-{kind}-{d}"
        kw = {"deadline": deadline, "topology": topology}
        baselines = baseline_times_ms(lengths, num_devices, self.profile, **kw) if with_baselines else {}
        return PlannedStep(plan, predicted, bound, time.perf_counter() - t0, status, baselines)

    def _plan_tasks(
        self, lengths, num_devices: int, with_baselines: bool, limit: float, deadline: float, t0: float, tasks
    ) -> PlannedStep:
        """A step of several tasks (:func:`flexorch.solver.task_steps.plan_tasks`): ``bound_ms`` is 0."""
        got = plan_tasks(
            self._planner,
            lengths,
            num_devices,
            tasks,
            with_baselines=with_baselines,
            limit=limit,
            deadline=deadline,
            time_limit_s=self.config.time_limit_s,
        )
        return dataclasses.replace(got, solve_s=time.perf_counter() - t0)

    def _plan_pipeline(self, lengths, num_devices: int, t0: float, limit: float) -> PlannedStep:
        """The elastic pipeline plan, never slower (simulated) than plain 1F1B or Seq1F1B on the same stages: when a
        baseline's schedule is faster it runs instead (status ``pipeline-1f1b`` / ``pipeline-seq1f1b-4``)."""
        profile, stages, recompute = self.pipeline_profile, self.pipeline_stages, self.pipeline_recompute
        staged = plan_staged(lengths, num_devices, profile, stages, time_limit_s=limit, recompute=recompute)
        bases = pipeline_baselines(lengths, staged, profile, time_limit_s=limit, recompute=recompute)
        status = "pipeline"
        for name, p in bases.items():
            if p is not None and p.makespan_ms < staged.makespan_ms:
                staged, status = dataclasses.replace(staged, plan=p), f"pipeline-{name}"
        baselines = {name: None if p is None else p.makespan_ms for name, p in bases.items()}
        return PlannedStep(staged, staged.makespan_ms, 0.0, time.perf_counter() - t0, status, baselines)

    def close(self) -> None:
        if self._planner is not None:
            self._planner.close()

    def __enter__(self) -> StepPlanner:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def stage_memory_profile(profile: Profile, pipeline_params: str) -> Profile:
    """The profile pipeline stages are planned with. 'stage' (stage-local parameters): as is, the stage model takes
    each stage's share of ``model_state_bytes`` out of its budget. 'replicated': every worker keeps the whole model,
    so each stage has the budget less the WHOLE model state."""
    if pipeline_params == "stage":
        return profile
    return profile.with_overrides(
        memory_budget_bytes=profile.memory_budget_bytes - profile.model_state_bytes, model_state_bytes=0.0
    )


def heuristic_plan(
    profile: Profile,
    lengths,
    num_devices: int,
    static: tuple[str, int] | None,
    pipeline_stages: int | str = 1,
    pipeline_params: str = "stage",
    *,
    pipeline_recompute: str = "auto",
    task_of=None,
    adapter_ranks=None,
    task_method: str = "spindle",
    topology=None,
) -> PlannedStep:
    """Without a MILP: the BatchAda plan (or the forced static layout, or a fully checkpointed pipeline), for when
    the planner actor is stuck. With ``task_of`` (several tasks): ``plan_task_step`` with BatchAda per part."""
    t0 = time.perf_counter()
    if task_of is not None:
        check_task_mode(static, pipeline_stages)
    try:
        check_num_devices(num_devices)
        if task_of is not None:
            plan, _ = plan_task_step(
                lengths, task_of, num_devices, profile, adapter_ranks=adapter_ranks, method=task_method
            )
            plan = with_chosen_modes(plan, profile)
            return PlannedStep(
                plan, step_time_ms(plan, profile), 0.0, time.perf_counter() - t0, HEURISTIC, {}, heuristic=True
            )
    except PlanningError as e:
        return PlannedStep(None, solve_s=time.perf_counter() - t0, status="infeasible", error=str(e), heuristic=True)
    if pipeline_stages != 1:
        try:
            staged = fallback_staged(
                lengths, num_devices, stage_memory_profile(profile, pipeline_params), pipeline_stages,
                pipeline_recompute,
            )  # fmt: skip
        except PlanningError as e:
            return PlannedStep(
                None, solve_s=time.perf_counter() - t0, status="infeasible", error=str(e), heuristic=True
            )
        return PlannedStep(staged, staged.makespan_ms, 0.0, time.perf_counter() - t0, HEURISTIC, {}, heuristic=True)
    if static is None:
        plan = baseline_plans(lengths, num_devices, profile, topology=topology)["batchada"]
    else:
        plan = static_plan(lengths, num_devices, profile, static[1], static[0], topology=topology)
    if plan is None:
        error = f"no heuristic plan fits this batch on {num_devices} workers (the planner timed out)"
        return PlannedStep(None, solve_s=time.perf_counter() - t0, status="infeasible", error=error, heuristic=True)
    plan = with_chosen_modes(plan, profile)
    return PlannedStep(plan, step_time_ms(plan, profile), 0.0, time.perf_counter() - t0, HEURISTIC, {}, heuristic=True)
