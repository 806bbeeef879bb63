"""How each step is planned: the ``[plan]`` table of a run file."""

from __future__ import annotations

from dataclasses import dataclass

from flexorch.config.errors import ConfigError

__all__ = ["AUTO_CPU_TOKENS", "STATIC_MODES", "PlanSettings"]

AUTO_CPU_TOKENS = 1024
"""``tokens_per_worker = "auto"`` on CPU workers (no device memory to read)."""

STATIC_MODES = ("static-ulysses", "static-ring")


@dataclass(frozen=True, kw_only=True)
class PlanSettings:
    """How each step is planned."""

    mode: str = "adaptive"
    """'adaptive' (the per-step MILP planner) or a forced static layout 'static-ulysses-<d>' / 'static-ring-<d>'."""
    profile: str = "auto"
    """Cost-model profile: 'auto' (calibrate on the workers at start), a built-in name, or a profile JSON file."""
    tokens_per_worker: int | str = "auto"
    """Activation budget of one worker (one device slot) in tokens: a document longer than this must be
    sequence-parallel. The solver's ``Profile.tokens_per_device`` is the same budget in its own words. 'auto' (the
    default): on GPU workers, read from the devices at start: their free memory after the model state, less a
    margin, over the calibrated activation bytes per token (``flexorch.control.memory_budget``); on CPU workers
    1024 (``AUTO_CPU_TOKENS``)."""
    time_limit_s: float = 0.5
    """Planner budget per step, the least it gets (the solve overlaps the previous step; see ``budget``). A
    pipelined step gives it to each checkpointing ILP it solves (one per candidate unit count and per baseline
    schedule, for every layout with 'auto'), so its solve can take several times this (0.2-1.3 s at 0.2 in
    examples/train_pipeline.toml); ``timeout_s`` still bounds it."""
    budget: str = "auto"
    """'step': the next step's plan gets ``budget_share`` of the last measured step time, never less than
    ``time_limit_s`` and at most half of ``timeout_s`` - the time the overlap with the running step gives for free
    on GPU workers (seconds); 'fixed': ``time_limit_s`` always; 'auto' (default): 'step' with ``use_gpu``, else
    'fixed' (CPU workers share the cores with the planner, so a longer solve slows the step it overlaps). Each step
    record says the budget it was planned with (``plan_budget_s``) and the plan's gap to the proven bound
    (``gap``)."""
    budget_share: float = 0.5
    """The share of the last step's measured time a plan may take with ``budget = "step"`` (0 < share <= 1: the
    solve must be back before the step it overlaps ends, and shares the CPUs with it)."""
    refit: str = "auto"
    """Refit the cost model's time terms during the run from the groups the workers ran
    (``flexorch.solver.refit``): 'on', 'off', or 'auto' (default: on when ``profile = "auto"`` calibrated it at
    the start; a named or file profile is kept as given). Memory terms are never refitted."""
    refit_every: int = 4
    """Steps between refits (each uses the most recent groups of every type)."""
    kinds: tuple[str, ...] = ("ulysses", "ring")
    """Attention methods the planner may use."""
    topology: str = "aware"
    """'aware' (default): the planner knows which node each worker is on (live workers per node, ranks contiguous
    per node: ``flexorch.solver.topology``), prices a group that spans nodes with the profile's inter-node figures,
    places groups inside nodes where they fit and may run hybrid groups across nodes; 'blind': plans as if all
    workers shared one node (ranks in membership order), kept for comparison
    (``benchmarks/sim/topology.py``)."""
    speeds: str = "aware"
    """'aware' (default): each worker's speed is estimated every step from its measured micro-batch times against
    the cost model's (``flexorch.solver.worker_speeds``; seeded from the accelerator kind where GPU nodes mix kinds)
    and the planner prices a group at its slowest member's speed, so a throttled GPU or a busy host gets less or
    shorter work, or sits a micro-batch out, and its full share again once it recovers; 'blind': every worker is
    planned at one speed, kept for comparison (``benchmarks/measured/stragglers.py``). Both record each rank's speed,
    say on the console when a worker drops below 0.8x the others and when it recovers, and export the metric
    ``flexorch_worker_speed`` (``flexorch.control.speed_watch``). Pipelined steps are planned at one speed."""
    hybrid: bool = True
    """With ``topology = "aware"`` on several nodes: the planner may choose hybrid groups where a group spans nodes
    (Ulysses inside each node x ring across them); false: Ulysses and ring groups only."""
    solver: str = "highs"
    """MILP backend: 'highs' (default, chosen by ``benchmarks/sim/solver_backends.py``) or 'cbc'."""
    on_infeasible: str = "error"
    """A batch no plan can run: 'error' (stop with the reason) or 'skip' (record and count it, train on)."""
    timeout_s: float = 15.0
    """A plan not back after this long (a stuck solver) is abandoned: the planner is restarted and the step runs
    the BatchAda heuristic plan, or with pipeline stages a fully checkpointed one (recorded with status
    'fallback')."""

    tasks: str = "spindle"
    """How a step of several ``[[tasks]]`` is planned: 'spindle' (devices allocated per task per step by Spindle's
    malleable allocation and wavefront schedule, arXiv 2409.03365; ``flexorch.solver.multitask``) or 'in_turn'
    (the tasks one after another on every worker: the baseline Spindle is measured against)."""

    def __post_init__(self) -> None:
        if self.tasks not in ("spindle", "in_turn"):
            raise ConfigError(f"plan.tasks must be 'spindle' or 'in_turn', got {self.tasks!r}")
        if self.mode != "adaptive":
            kind, _, deg = self.mode.rpartition("-")
            if kind not in STATIC_MODES or not deg.isdigit() or int(deg) < 1 or int(deg) & (int(deg) - 1):
                raise ConfigError(
                    f"plan.mode must be 'adaptive' or 'static-ulysses-<d>' / 'static-ring-<d>' with d a power of "
                    f"two, got {self.mode!r}"
                )
        t = self.tokens_per_worker
        if t != "auto" and (not isinstance(t, int) or isinstance(t, bool) or t < 16):
            raise ConfigError(f"plan.tokens_per_worker must be 'auto' or an integer >= 16, got {t!r}")
        if not self.time_limit_s > 0:
            raise ConfigError(f"plan.time_limit_s must be > 0, got {self.time_limit_s!r}")
        if not self.timeout_s > self.time_limit_s:
            raise ConfigError(f"plan.timeout_s must exceed plan.time_limit_s, got {self.timeout_s!r}")
        if self.budget not in ("auto", "step", "fixed"):
            raise ConfigError(f"plan.budget must be 'auto', 'step' or 'fixed', got {self.budget!r}")
        if not (isinstance(self.budget_share, int | float) and 0 < self.budget_share <= 1):
            raise ConfigError(f"plan.budget_share must be in (0, 1], got {self.budget_share!r}")
        if self.refit not in ("auto", "on", "off"):
            raise ConfigError(f"plan.refit must be 'auto', 'on' or 'off', got {self.refit!r}")
        if not isinstance(self.refit_every, int) or isinstance(self.refit_every, bool) or self.refit_every < 1:
            raise ConfigError(f"plan.refit_every must be an integer >= 1, got {self.refit_every!r}")
        bad = [k for k in self.kinds if k not in ("ulysses", "ring")]
        if not self.kinds or bad:
            raise ConfigError(f"plan.kinds must be a non-empty subset of ['ulysses', 'ring'], got {list(self.kinds)}")
        if self.topology not in ("aware", "blind"):
            raise ConfigError(f"plan.topology must be 'aware' or 'blind', got {self.topology!r}")
        if self.speeds not in ("aware", "blind"):
            raise ConfigError(f"plan.speeds must be 'aware' or 'blind', got {self.speeds!r}")
        if not isinstance(self.hybrid, bool):
            raise ConfigError(f"plan.hybrid must be true or false, got {self.hybrid!r}")
        if self.solver not in ("highs", "cbc"):
            raise ConfigError(f"plan.solver must be 'highs' or 'cbc', got {self.solver!r}")
        if self.on_infeasible not in ("error", "skip"):
            raise ConfigError(f"plan.on_infeasible must be 'error' or 'skip', got {self.on_infeasible!r}")

    def budget_for(self, step_ms: float | None, *, use_gpu: bool = False) -> float:
        """Seconds the next plan may take when the last step took ``step_ms`` (None: none measured yet) on GPU
        workers (``use_gpu``) or CPU ones (which 'auto' plans with a fixed budget)."""
        mode = self.budget if self.budget != "auto" else ("step" if use_gpu else "fixed")
        if mode == "fixed" or step_ms is None or not step_ms > 0:
            return self.time_limit_s
        return max(self.time_limit_s, min(self.budget_share * step_ms / 1e3, 0.5 * self.timeout_s))

    @property
    def refits(self) -> bool:
        """The cost model is refitted during the run (``refit``, 'auto' resolved)."""
        return self.refit == "on" or (self.refit == "auto" and self.profile == "auto")

    @property
    def static(self) -> tuple[str, int] | None:
        """(kind, degree) of a forced static layout, None when adaptive."""
        if self.mode == "adaptive":
            return None
        kind, _, deg = self.mode.rpartition("-")
        return kind.removeprefix("static-"), int(deg)
