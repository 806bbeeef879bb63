"""The cost model refitted during a run from the groups the workers really ran (``[plan] refit``).

Why: the start-up calibration (``flexorch.control.calibration``) times probes that are not the run's micro-batches.
Its compute probes run every worker at degree 1 at once, so on shared cores each worker gets a share of them, while
in training the workers of SP groups spend part of their time blocked in collectives and leave the cores to the
others. The probes then price compute too high; the group fit per (kind, degree) absorbs the error for SP groups, so
static layouts of one degree are predicted well while adaptive plans, which mix degree-1 groups in, are not
(``benchmarks/measured/calibration_error.py``; the figures are in docs/design.md).

The fix is the run's own evidence: every trained step's record holds, per rank and micro-batch, how long it took
(``solver.record_samples``). :class:`GroupWindow` keeps the most recent groups (a degree-1 group is pure compute; an
SP group is compute plus its collectives), and :func:`refit_times` fits FlexSP's compute terms (arXiv 2412.01523,
§4.1.2: ``b1 + a1 sum s^2 + a2 sum s``) on the degree-1 groups and each (kind, degree)'s latency and bandwidth on
its groups (``solver.calibration.fit_group_comm``), keeping a term's old value when the window cannot identify it,
and the whole refit only when it predicts the window's groups better than the profile in force *and* its steps at
least as well. The steps are what the planner plans with: a step is predicted as the barrier schedule of its
micro-batches (each as long as its slowest group, ``solver.simulator``) and measured as the slowest rank's compute
(the record's ``compute_ms``). Groups alone are not enough: a refit fitted on the window's many small groups can
predict them better while pricing the few slow groups that set each micro-batch's length far too fast, and then
every step it plans is mispredicted (docs/design.md has a run where it happened). Only times change: memory (the
activation bytes, the budget) is the calibrated one, so a plan's feasibility never depends on a refit.
"""

from __future__ import annotations

import dataclasses
from collections import deque

import numpy as np

from flexorch.solver.calibration import (
    ComputeSample,
    GroupSample,
    fit_compute_terms,
    fit_group_comm,
    prediction_errors,
)
from flexorch.solver.errors import ProfileError
from flexorch.solver.profiles import DEGREE_TABLES, Profile
from flexorch.solver.record_samples import StepSample
from flexorch.solver.step_level import LEVEL_STEPS

__all__ = ["GroupWindow", "RefitReport", "refit_times", "with_time_terms"]

MIN_COMPUTE = 6
"""Degree-1 groups needed before the compute terms are refitted (two per unknown)."""
MIN_GROUP = 4
"""Groups of one (kind, degree) needed before its latency and bandwidth are refitted."""
MIN_STEPS = 2
"""Steps needed before the step's fixed costs (``Profile.step_ms``) are refitted."""


class GroupWindow:
    """The most recent ``size`` samples of each group type (degree 1; each SP kind and degree) and the most recent
    ``steps`` steps they came from."""

    def __init__(self, size: int = 64, steps: int = 16) -> None:
        self.size = size
        self._by_type: dict[tuple[str, int, bool], deque] = {}
        self._steps: deque[StepSample] = deque(maxlen=steps)

    def add(self, samples) -> None:
        """Groups (``ComputeSample``, ``GroupSample``) and steps (``StepSample``) in any order."""
        for s in samples:
            if isinstance(s, StepSample):
                self._steps.append(s)
                continue
            key = ("compute", 1, False) if isinstance(s, ComputeSample) else (s.kind, s.degree, s.spans)
            self._by_type.setdefault(key, deque(maxlen=self.size)).append(s)

    def copy(self) -> GroupWindow:
        """A snapshot (a refit in another thread reads it while the run adds groups)."""
        out = GroupWindow(self.size, self._steps.maxlen)
        out._by_type = {k: deque(v, maxlen=self.size) for k, v in self._by_type.items()}
        out._steps = deque(self._steps, maxlen=self._steps.maxlen)
        return out

    def steps(self) -> list[StepSample]:
        return list(self._steps)

    def compute(self) -> list[ComputeSample]:
        return list(self._by_type.get(("compute", 1, False), ()))

    def groups(self) -> dict[tuple[str, int, bool], list[GroupSample]]:
        """Each (kind, degree, spans nodes)'s samples."""
        return {k: list(v) for k, v in self._by_type.items() if k[0] != "compute"}

    def __len__(self) -> int:
        """Groups held (steps not counted)."""
        return sum(len(v) for v in self._by_type.values())


@dataclasses.dataclass(frozen=True)
class RefitReport:
    """What a refit changed and how well the old and new profiles predict the window (median |relative error|) of
    groups and of steps. ``error_after``/``step_error_after`` are the refit's own figures, kept or not."""

    samples: int
    error_before: float
    error_after: float
    accepted: bool
    refitted: tuple[str, ...]
    """The terms refitted: 'compute' and/or '<kind>-<degree>' ('<kind>-<degree>-across': its groups across nodes)."""
    steps: int = 0
    step_error_before: float = 0.0
    step_error_after: float = 0.0

    @property
    def verdict(self) -> str:
        if self.accepted:  # the driver plans with it and judges it on the next steps (``control.refitting``)
            return "on trial"
        if self.error_after > self.error_before:
            return "rejected (groups predicted worse)"
        if self.step_error_after > self.step_error_before:
            return "rejected (steps predicted worse)"
        return "rejected (no better)"

    def message(self, profile: Profile) -> str:
        """One console line; ``profile`` is the one in force after the refit."""
        what = ", ".join(self.refitted) or "nothing"
        steps = (
            f", on the last {self.steps} steps {100 * self.step_error_before:.1f} % -> "
            f"{100 * self.step_error_after:.1f} %"
            if self.steps
            else ""
        )
        return (
            f"cost model refitted on the last {self.samples} groups ({what}): median error "
            f"{100 * self.error_before:.1f} % -> {100 * self.error_after:.1f} %{steps}, {self.verdict}; "
            f"b1={profile.b1_ms:.3g} ms a1={profile.a1_ms:.3g} ms/tok^2 a2={profile.a2_ms:.3g} ms/tok"
            + (f" step={profile.step_ms:.3g} ms" if profile.step_ms else "")
        )


def _median_abs(profile: Profile, samples) -> float:
    return float(np.median(np.abs(prediction_errors(profile, samples)))) if samples else 0.0


def _step_error(profile: Profile, steps: list[StepSample]) -> float:
    """Median |relative error| of the steps' predictions (0 without steps)."""
    if not steps:
        return 0.0
    return float(np.median([abs(s.predict_ms(profile) - s.ms) / s.ms for s in steps]))


def _scaled(profile: Profile, x: float) -> Profile:
    return dataclasses.replace(profile, b1_ms=profile.b1_ms * x, a1_ms=profile.a1_ms * x, a2_ms=profile.a2_ms * x)


COMM_SAMPLES = 16
"""The most recent groups of a (kind, degree) its collectives are refitted on, on a log grid of COMM_GRID
bandwidths: ``fit_group_comm`` prices every group at every grid point, so its time grows with both."""
COMM_GRID = 61


def _pinned(profile: Profile, degrees, inter: bool = False) -> Profile:
    """``profile`` with its collective tables written out for every power-of-two degree up to the largest it or
    ``degrees`` has: a ring group reads the all-to-all tables where its own are empty, and a degree not in a table
    the nearest larger one, so refitting one (kind, degree) would otherwise move the price of others it never saw.
    The inter-node tables too when ``inter`` (a group across nodes is refitted) or the profile has them: an empty
    inter table reads the intra one, which a refit of a group inside a node would otherwise move."""
    top = max([*degrees, *(d for t in DEGREE_TABLES for d in getattr(profile, t))])
    ds = [2**i for i in range(1, top.bit_length())]
    tables = {
        "a2a_gbps": {d: profile.bandwidth_gbps(d) for d in ds},
        "p2p_gbps": {d: profile.bandwidth_gbps(d, ring=True) for d in ds},
        "a2a_latency_ms": {d: profile.latency_ms(d) for d in ds},
        "p2p_latency_ms": {d: profile.latency_ms(d, ring=True) for d in ds},
    }
    if inter or profile.has_inter_tables:
        tables |= {
            "inter_a2a_gbps": {d: profile.bandwidth_gbps(d, inter=True) for d in ds},
            "inter_p2p_gbps": {d: profile.bandwidth_gbps(d, ring=True, inter=True) for d in ds},
            "inter_a2a_latency_ms": {d: profile.latency_ms(d, inter=True) for d in ds},
            "inter_p2p_latency_ms": {d: profile.latency_ms(d, ring=True, inter=True) for d in ds},
        }
    return dataclasses.replace(profile, **tables)


def _times_scaled(profile: Profile, k: float) -> Profile:
    """``profile`` with every group's time scaled by ``k``: compute terms and latencies times k, bandwidths over k
    (a ring's exposed transfer, max(transfer - compute, 0), scales with both)."""
    return dataclasses.replace(
        _scaled(profile, k),
        **{
            t: {d: v / k if t.endswith("gbps") else v * k for d, v in getattr(profile, t).items()}
            for t in DEGREE_TABLES
        },
    )


def _leveled(profile: Profile, steps: list[StepSample]) -> Profile:
    """``profile`` at the level the most recent steps show: ``step_ms`` their median time outside the micro-batches
    (sync, optimizer, dispatch), and every group's time scaled by the median of measured over predicted compute.
    Relative prices do not move (no plan changes rank), only the level: on a shared machine it drifts while the
    groups' shapes stay (the demo's calibration priced its first steps 24-35 % fast). Unchanged below ``MIN_STEPS``
    steps."""
    recent = [s for s in steps[-LEVEL_STEPS:] if s.compute_ms > 0]
    if len(recent) < MIN_STEPS:
        return profile
    step_ms = float(np.median([max(0.0, s.ms - s.compute_ms) for s in recent]))
    k = float(np.median([s.compute_ms / max(s.predict_ms(profile) - profile.step_ms, 1e-9) for s in recent]))
    leveled = dataclasses.replace(profile, step_ms=step_ms)
    return leveled if abs(k - 1.0) < 1e-9 else _times_scaled(leveled, k)


def _with_comm(profile: Profile, groups: dict) -> Profile:
    if groups:
        profile = _pinned(profile, [d for _, d, _ in groups], inter=any(spans for _, _, spans in groups))
    for (kind, degree, spans), samples in sorted(groups.items()):
        profile, _err = fit_group_comm(profile, samples[-COMM_SAMPLES:], kind, degree, grid=COMM_GRID, spans=spans)
    return profile


TIME_TERMS = ("a1_ms", "a2_ms", "b1_ms", "step_ms", *DEGREE_TABLES)
"""The fields a refit changes (and a roll-back restores); memory and recompute terms are never refitted."""


def with_time_terms(profile: Profile, source: Profile) -> Profile:
    """``profile`` (its memory terms, e.g. lowered after an out-of-memory step) with ``source``'s time terms."""
    return dataclasses.replace(profile, **{f: getattr(source, f) for f in TIME_TERMS})


def refit_times(profile: Profile, window: GroupWindow, static: bool = False) -> tuple[Profile, RefitReport]:
    """``profile`` with its time terms refitted on ``window``; the input profile when the refit is no better.

    Collectives are refitted only for the (kind, degree) the window shows; the tables are written out first so that
    no other type's price moves with them (``_pinned``). ``static``: the run plans one layout (how the compute factor
    is fitted without degree-1 groups, below)."""
    compute, groups = window.compute(), window.groups()
    every = [*compute, *(s for v in groups.values() for s in v)]
    refitted: list[str] = []
    new = _refit_compute(profile, compute, refitted)
    new = _refit_groups(profile, new, groups, refitted, static)
    steps = window.steps()
    before, after = _median_abs(profile, every), _median_abs(new, every)
    # the groups' refit stands only when it explains the groups better and, each at the level the steps show, the
    # steps at least as well (a refit can explain the groups better yet price the slow groups that set each
    # micro-batch's length far too fast)
    candidate_steps = _step_error(_leveled(new, steps), steps)
    groups_kept = bool(refitted) and after < before and candidate_steps <= _step_error(_leveled(profile, steps), steps)
    if not groups_kept:
        new, refitted = profile, []
    final = _leveled(new, steps)
    if final.step_ms != new.step_ms:
        refitted.append("step")
    if final.b1_ms != new.b1_ms:
        refitted.append("level")
    step_before, step_after = _step_error(profile, steps), _step_error(final, steps)
    accepted = bool(refitted) and (step_after < step_before or (groups_kept and step_after <= step_before))
    report = RefitReport(
        len(every),
        before,
        after,
        accepted,
        tuple(refitted),
        len(steps),
        step_before,
        step_after if groups_kept or refitted else candidate_steps,
    )
    new = final
    return (new if accepted else profile), report


def _refit_compute(profile: Profile, compute, refitted: list[str]) -> Profile:
    """``profile`` with b1, a1, a2 refitted on the window's degree-1 groups where they show them ("compute")."""
    if len(compute) >= MIN_COMPUTE:
        try:
            b1, a1, a2 = fit_compute_terms(compute, "refit", profile)
        except ProfileError:  # the window does not separate b1, a1, a2 (e.g. every group the same size)
            pass
        else:
            if a1 > 0 or a2 > 0:
                refitted.append("compute")
                return dataclasses.replace(profile, b1_ms=b1, a1_ms=a1, a2_ms=a2)
    return profile


def _refit_groups(profile: Profile, new: Profile, groups: dict, refitted: list[str], static: bool) -> Profile:
    """``new`` with the collectives of each (kind, degree) the window shows refitted, and without a compute refit
    its compute terms scaled by one factor from the SP groups ("compute-scale")."""
    enough = {k: v for k, v in groups.items() if len(v) >= MIN_GROUP}
    # latency and bandwidth need groups of at least two sizes to be told apart
    fit = {k: v for k, v in enough.items() if len({sum(s.seq_lengths) for s in v}) >= 2}
    if enough and "compute" not in refitted:
        # no degree-1 groups to price compute (a static SP layout, or every sequence needing SP): scale the compute
        # terms by one factor from the SP groups. A static layout's planner plans only the type it sees: the factor
        # is the one that, with each (kind, degree)'s collectives refitted, predicts its groups best. An adaptive
        # planner also plans types the window has no sample of: there the factor is fitted with the collectives as
        # they are (one unknown, identified), then the seen types' collectives are refitted at it. Fitted jointly,
        # factor and collectives trade off freely: a window of one type's groups can fit a small factor and a large
        # latency that price the types it has no sample of far too cheap.
        sp = [s for v in enough.values() for s in v]
        grid = np.geomspace(0.25, 4.0, 41)
        if static:
            new = min((_with_comm(_scaled(new, x), fit) for x in grid), key=lambda q: _median_abs(q, sp))
        else:
            x = min(grid, key=lambda x: (_median_abs(_scaled(new, x), sp), abs(np.log(x))))
            new = _with_comm(_scaled(new, x), fit)
        if new.b1_ms != profile.b1_ms or new.a2_ms != profile.a2_ms:
            refitted.append("compute-scale")
    else:
        new = _with_comm(new, fit)
    refitted += [f"{kind}-{degree}{'-across' if spans else ''}" for kind, degree, spans in sorted(fit)]
    return new
