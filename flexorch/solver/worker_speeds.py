"""Each worker's speed relative to the others, estimated from what its ranks measured against what the cost model
predicts for the same work; pure (no Ray, no torch).

**One step.** For every group of a trained SP step's plan, the cost model's time at nominal speed (the price
``solver.simulator.span_ms`` gives it: ``cost_model.group_time_ms`` where it lay, times its recompute mode's factor)
over its measured time (the slowest of its ranks' ``micro_batch_ms``) is the pace the group ran at. A group runs at
its slowest member's pace, so each member is at least that fast, and a rank's speed that step is the fastest pace of
the groups it was in (:func:`step_speeds`): a worker that shared a group with a slow one is not called slow when it
ran elsewhere in the step at full pace. A rank whose every group is explained by another member pinned slow
elsewhere in the step says nothing that step. Groups with a rank that compiled (``compile_s > 0``) or reported
nothing are left out, and so is a rank busy for less than ``EVIDENCE`` of the busiest rank's time. Where the
ranks say what they spent blocked in their group's collectives (``wait_ms``: CPU workers,
``workers.attention.collective_waits``), the member that did clearly more of its own work than the others set the
group's pace and is pinned slow (:func:`_member_paces`), so two ranks that always run together can still be told
apart. The paces are normalised by the step's median rank (the upper one of an even count: of two workers the
faster is 1.0), so a cost model that is off for everyone moves no one.

**Over steps** (:class:`WorkerSpeeds`). A world's first ``skip_first`` steps are left out (warm-up, new groups);
each worker keeps its last ``window`` step speeds (at first its seed, 1.0 without one) and its estimate is their
median. A worker unobserved from its second step on (the planner left it idle) drifts half-way back to its seed
per step, so the planner tries it again and sees whether it recovered (a worker said slow stays so until an
observed step brings it back to ``RECOVERED_AT``). Megatron-LM's straggler detector and NVIDIA's resiliency
extension score each rank against the others the same way (``nvidia_resiliency_ext.straggler``, "relative
performance score"). The planner gets snapped speeds (:meth:`WorkerSpeeds.planning_speeds`) that hold while the
estimate stays near them: a change of speeds forces a plan solved ahead to be solved again.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

from flexorch.solver.cost_model import group_time_ms
from flexorch.solver.profiles import Profile
from flexorch.solver.record_samples import group_placement, plan_topology, time_scales

__all__ = ["RECOVERED_AT", "SLOW_BELOW", "SpeedChange", "WorkerSpeeds", "seed_speeds", "snap_speed", "step_speeds"]

SLOW_BELOW = 0.8
"""A worker whose estimate drops below this is slow: the console says so once (:class:`SpeedChange`)."""
RECOVERED_AT = 0.9
"""A slow worker whose estimate is back at or above this has recovered (said once). One observed step at this pace
is believed at once (its window refilled with it), so a worker that speeds up gets its full share back on the next
plan; a drop needs the window's median (two slow steps of three)."""
PRIOR_GAP = 0.05
"""Where several members of a group can have set its pace, one whose estimate is lower than every other's by this
share is taken as the one that did (:func:`_untangle`)."""
TIGHT = 0.1
"""A group's pace is set by a member whose speed bound is within this share of it (measurement noise)."""
BAND = 0.2
"""A planning speed within this of 1.0 is 1.0 (the band before the run has measured its noise, and the band of
:func:`snap_speed`): the planner plans around a worker that stands out, not around noise (on 4 CPU workers
time-sharing 2 cores, workers at one pace measured 0.67-1.35 of each other from step to step, and plans made around
such phantom speeds made the steps of an aware run slower)."""
NOISE_SAMPLES = 24
"""The run's measurement noise is the median of the last this many step speeds' deviations from their workers'
estimates (:attr:`WorkerSpeeds.band`); fewer than a third of them: ``BAND``."""
BAND_PER_NOISE = 2.5
"""The band is this many times the measured noise, within ``BAND_LIMITS``."""
BAND_LIMITS = (0.1, 0.35)
EVIDENCE = 0.15
"""A rank busy for less than this share of the busiest rank's time in a step says nothing of its speed that step,
but that a rank taken as slow is back where it ran at full pace: on a little work the cost model's fixed costs are
off by more than a pace (on 4 CPU workers, ranks given 5-10 % of a step measured 0.25-0.5x on it, and a rank taken
as slow is given less still)."""
SETTER_BY = 1.25
"""A group member whose own work (its time less its waits, ``wait_ms``) is this many times every other member's set
the group's pace."""
STICK = 0.05
"""Hysteresis of the planning speeds: a snapped speed holds while the estimate stays this far past its band."""


@dataclass(frozen=True)
class SpeedChange:
    """A worker that went slow (``slow``) or recovered: what the console says once each."""

    worker: int
    rank: int
    node: str | None
    speed: float
    steps: int
    """Slow: the consecutive observed steps it ran below ``SLOW_BELOW``; recovered: the observed steps it ran below
    it while it was slow."""
    slow: bool

    def message(self) -> str:
        who = f"worker {self.worker}" + (f" on node {self.node}" if self.node else "")
        if self.slow:
            plural = "s" if self.steps != 1 else ""
            return f"{who} runs at {self.speed:.2f}x the others for {self.steps} step{plural}; planning around it"
        return f"{who} is back to {self.speed:.2f}x the others; it gets its full share again"


def _group_paces(record: dict, profile: Profile) -> list[tuple[tuple[int, ...], float]]:
    """``(ranks, predicted / measured)`` of the groups of the record's plan that every rank reported, none
    compiling; the groups of the same ranks in several micro-batches taken together (their predicted times summed
    over their measured times summed), so a rank that ran alone in many light micro-batches is weighed by its time
    in them, not by its luckiest one."""
    summed: dict[tuple[int, ...], list[float]] = {}
    for members, predicted, took in _group_times(record, profile):
        acc = summed.setdefault(members, [0.0, 0.0])
        acc[0] += predicted
        acc[1] += took
    return [(members, p / t) for members, (p, t) in summed.items()]


def _group_times(record: dict, profile: Profile) -> list[tuple[tuple[int, ...], float, float]]:
    """``(ranks, predicted, measured)`` of each group of the record's plan that every rank reported, none
    compiling (where the ranks' waits name the member that set a group's pace, that one alone too)."""
    ranks = record.get("ranks") or []
    scales = time_scales(record, profile.mode_time_ratios())
    topology = plan_topology(record)
    out = []
    for mi, mb in enumerate(record["plan"]["micro_batches"]):
        for gi, g in enumerate(mb):
            members = tuple(int(r) for r in g["ranks"])
            entries = [ranks[r] if 0 <= r < len(ranks) else None for r in members]
            if any(e is None or (e.get("compile_s") or 0) > 0 for e in entries):
                continue
            times = [(e.get("micro_batch_ms") or [])[mi:][:1] for e in entries]
            if any(not t or t[0] is None or not t[0] > 0 for t in times):
                continue
            lengths = [int(s) for s in g["seq_lengths"]]
            predicted = group_time_ms(lengths, int(g["degree"]), g["kind"], profile, **group_placement(g, topology))
            predicted *= 1.0 if scales is None else scales[mi][gi]
            if predicted > 0:
                took = [t[0] for t in times]
                waits = [(e.get("wait_ms") or [])[mi:][:1] for e in entries]
                if len(members) > 1 and all(w and w[0] is not None for w in waits):
                    out += _member_paces(members, predicted, took, [w[0] for w in waits])
                else:
                    out.append((members, predicted, max(took)))
    return out


def _member_paces(members, predicted: float, took: list[float], waits: list[float]):
    """The group's ``(members, predicted, measured)`` and, where what each member spent blocked in the group's
    collectives (``wait_ms``) names the one that set the pace, that one alone too (``((rank,), ...)``). A
    member's own work is its time less its waits; the one whose own work is at least ``SETTER_BY`` times every
    other member's set the pace (the others waited for it). The others are then explained by it (``_untangle``):
    they say nothing this step unless they ran elsewhere, rather than a pace of their own (their own work leaves
    out the transfers the slow member's work hid, so it would make them look faster than they are)."""
    whole = max(took)
    own = [t - w for t, w in zip(took, waits, strict=True)]
    setter = max(range(len(members)), key=lambda i: own[i])
    rest = [o for i, o in enumerate(own) if i != setter]
    if own[setter] > 0 and all(own[setter] >= SETTER_BY * max(o, 0.0) for o in rest):
        return [((members[setter],), predicted, whole), (members, predicted, whole)]
    return [(members, predicted, whole)]


def _untangle(paces: list[tuple[tuple[int, ...], float]], priors: dict[int, float] | None = None) -> dict[int, float]:
    """Each rank's pace bound (the fastest of its groups'), less ranks whose every group is explained by another
    member pinned slow (the one member that can have set the pace of some group of its own). ``priors`` (rank ->
    its estimate before this step): where several members can have set a group's pace, one whose prior is clearly
    the lowest (by ``PRIOR_GAP``) is pinned, so a fast rank that shares groups with a known slow one is not called
    slow with it; where they are alike and already taken as slow, the group tells nothing of any of them (they
    are left unobserved, drift back and are planned apart again, where they can be told apart)."""
    lo: dict[int, float] = {}
    for members, p in paces:
        for m in members:
            lo[m] = max(lo.get(m, 0.0), p)
    setters = [[m for m in members if lo[m] <= p * (1 + TIGHT)] for members, p in paces]  # who can have set it
    pinned = {s[0] for s in setters if len(s) == 1}
    unknown: set[int] = set()  # setters of a group none of whom can be told from the others
    for s in setters if priors else ():
        if len(s) > 1 and not pinned.intersection(s):
            low = min(s, key=lambda m: priors.get(m, 1.0))
            if all(priors.get(low, 1.0) <= (1 - PRIOR_GAP) * priors.get(o, 1.0) for o in s if o != low):
                pinned.add(low)
            elif priors.get(low, 1.0) < RECOVERED_AT:  # all already taken as slow, alike: this says nothing new
                unknown.update(s)
    explained: dict[int, bool] = {}
    for members, _ in paces:  # a group holding a member pinned slow says nothing of the others in it
        slow = [o for o in members if o in pinned]
        for m in members:
            explained[m] = explained.get(m, True) and any(o != m for o in slow)
    return {m: bound for m, bound in lo.items() if m in pinned or not (explained[m] or m in unknown)}


def _median_worker(values) -> float:
    """The median worker's value: the upper middle of an even count (of two, the faster)."""
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def step_speeds(
    record: dict, profile: Profile, priors: dict[int, float] | None = None, slivers: set | None = None
) -> dict[int, float]:
    """Each observed rank's speed in one trained SP step's record (rank -> speed, the step's median rank 1.0);
    empty for pipelined, skipped and plan-less records and when fewer than two ranks say anything. ``priors``:
    each rank's estimate before the step (:func:`_untangle`); ``slivers``: filled with the ranks whose speed comes
    from a sliver of the step (``EVIDENCE``: a worker taken as slow seen back at full pace on it)."""
    if record.get("source") != "train" or record.get("pipeline") is not None or not record.get("plan"):
        return {}
    raw = _untangle(_group_paces(record, profile), priors)
    busy = {r: sum(t for t in e.get("micro_batch_ms") or () if t) for r, e in enumerate(record["ranks"])
            if e is not None and not (e.get("compile_s") or 0) > 0}  # fmt: skip
    most = max(busy.values(), default=0.0)
    sliver = {r: v for r, v in raw.items() if busy.get(r, 0.0) < EVIDENCE * most}
    raw = {r: v for r, v in raw.items() if r not in sliver}
    if len(raw) < 2:
        return {}
    ref = _median_worker(raw.values())
    out = {r: v / ref for r, v in raw.items()}
    # a sliver says one thing: that a rank taken as slow is back (its pace at full speed even on so little work)
    back = {r: v / ref for r, v in sliver.items() if (priors or {}).get(r, 1.0) < SLOW_BELOW}
    out.update({r: v for r, v in back.items() if v >= RECOVERED_AT})
    if slivers is not None:  # the caller's: which ranks said so on a sliver
        slivers.update(r for r in back if r in out)
    return out


def snap_speed(speed: float, band: float = BAND) -> float:
    """A speed as the planner is given it: 1.0 within ``band`` of it, else on a 0.05 grid (at least 0.05)."""
    if 1.0 - band <= speed <= 1.0 + band:
        return 1.0
    return _grid(speed)


def _grid(speed: float) -> float:
    return round(max(0.05, round(speed / 0.05) * 0.05), 2)


def _held(prev: float, speed: float, band: float = BAND) -> bool:
    """Does the planning speed ``prev`` still hold at estimate ``speed`` (its snap band widened by ``STICK``)?"""
    half = band if prev == 1.0 else 0.025
    return prev - half - STICK <= speed <= prev + half + STICK


@dataclass
class _Track:
    """One worker's recent step speeds and what was said and planned about it."""

    seed: float
    window: deque
    missed: int = 0
    run: int = 0
    """Consecutive observed steps below ``SLOW_BELOW``."""
    slow: bool = False
    spell: int = 0
    """Observed steps below ``SLOW_BELOW`` since it was said to be slow (those that made it so included)."""
    planned: float | None = None

    def estimate(self) -> float:
        return float(statistics.median(self.window))


class WorkerSpeeds:
    """The workers' speeds over a run (worker id -> its estimate). ``window``: step speeds kept per worker;
    ``skip_first``: steps of each world left out; ``seeds``: worker id -> its speed before any step
    (:func:`seed_speeds`)."""

    def __init__(self, *, window: int = 3, skip_first: int = 1, seeds: dict[int, float] | None = None):
        if window < 1 or skip_first < 0:
            raise ValueError(f"window must be >= 1 and skip_first >= 0, got {window} and {skip_first}")
        self.window, self.skip_first = int(window), int(skip_first)
        self._seeds = {int(w): float(v) for w, v in (seeds or {}).items()}
        self._tracks: dict[int, _Track] = {}
        self._skip = self.skip_first
        self._noise: deque = deque(maxlen=NOISE_SAMPLES)  # step speeds' deviations from their estimates

    @property
    def band(self) -> float:
        """Planning speeds within this of 1.0 are 1.0: ``BAND_PER_NOISE`` times the noise the run measured (the
        median deviation of a step's speed from its worker's estimate), within ``BAND_LIMITS``; ``BAND`` until a
        third of ``NOISE_SAMPLES`` are in. Workers time-sharing CPU cores measure +-20-30 % from step to step, GPUs
        a few per cent: a band that fits one would plan around noise on the other, or miss a real straggler."""
        if len(self._noise) < NOISE_SAMPLES // 3:
            return BAND
        lo, hi = BAND_LIMITS
        return min(hi, max(lo, BAND_PER_NOISE * float(statistics.median(self._noise))))

    def _track(self, worker: int) -> _Track:
        if worker not in self._tracks:
            seed = self._seeds.get(worker, 1.0)  # the window starts full of it: one odd step moves nothing
            self._tracks[worker] = _Track(seed, deque([seed] * self.window, maxlen=self.window))
        return self._tracks[worker]

    def observe(self, record: dict, profile: Profile, worker_ids, nodes=None) -> list[SpeedChange]:
        """Learn from a trained step's ``record`` (its plan priced by ``profile``) run by ``worker_ids`` (rank
        order) on ``nodes`` (rank order, or None); the workers that went slow or recovered with it."""
        workers = [int(w) for w in worker_ids]
        if record.get("source") != "train" or record.get("pipeline") is not None or not record.get("plan"):
            return []
        if len(workers) != len(record.get("ranks") or ()):
            return []  # not this world's record
        if self._skip > 0:
            self._skip -= 1
            return []
        priors = {rank: self._track(w).estimate() for rank, w in enumerate(workers)}
        slivers: set[int] = set()
        speeds = step_speeds(record, profile, priors, slivers)
        if not speeds:
            return []
        changes = []
        for rank, w in enumerate(workers):
            t = self._track(w)
            if rank not in speeds:
                t.missed += 1
                if t.missed >= 2:  # left idle: drift half-way back, so the planner tries it again
                    t.window = deque((t.seed + (v - t.seed) / 2 for v in t.window), maxlen=self.window)
                continue
            t.missed = 0
            self._noise.append(abs(speeds[rank] / t.estimate() - 1.0))
            if t.slow and speeds[rank] >= RECOVERED_AT and rank not in slivers:
                # back at full pace on a real share: believed at once (a drop needs two; on a sliver, two too)
                t.window.extend([speeds[rank]] * self.window)
            t.window.append(speeds[rank])
            t.run = t.run + 1 if speeds[rank] < SLOW_BELOW else 0
            t.spell += t.slow and t.run > 0
            est = t.estimate()
            node = None if nodes is None else nodes[rank]
            if not t.slow and est < SLOW_BELOW:
                t.slow, t.spell = True, max(t.run, 1)
                changes.append(SpeedChange(w, rank, node, est, t.spell, True))
            elif t.slow and est >= RECOVERED_AT:
                t.slow = False
                changes.append(SpeedChange(w, rank, node, est, t.spell, False))
        return changes

    def estimate(self, worker: int) -> float:
        """``worker``'s speed relative to the others: the median of its last ``window`` step speeds, the window
        starting full of its seed (1.0 without one)."""
        t = self._tracks.get(int(worker))
        return t.estimate() if t is not None else self._seeds.get(int(worker), 1.0)

    def planning_speeds(self, worker_ids) -> tuple[float, ...]:
        """Each rank's speed for the planner (:func:`snap_speed` of its worker's estimate), held while the
        estimate stays within ``STICK`` of the snapped value's band, so noise near a grid boundary does not change
        the speeds (and force a plan to be solved again) from one step to the next; the band is the run's
        (:attr:`band`). A worker planned around and then left idle, drifting back, is planned below 1.0 until a
        step shows it back (``RECOVERED_AT``): given some work to show its pace, not its whole share at once."""
        out, band = [], self.band
        for w in worker_ids:
            t = self._track(int(w))
            est = t.estimate()
            if t.planned is None or not _held(t.planned, est, band):
                was, t.planned = t.planned, snap_speed(est, band)
                if t.missed and was is not None and was < 1.0 and t.planned == 1.0 and est < RECOVERED_AT:
                    # planned around, then idle and drifting back: tried again with some work, not all of it
                    t.planned = _grid(est)
            out.append(t.planned)
        return tuple(out)

    def slow_steps(self, worker: int) -> int:
        """The consecutive observed steps ``worker`` ran below ``SLOW_BELOW`` (its latest ones)."""
        t = self._tracks.get(int(worker))
        return 0 if t is None else t.run

    def new_world(self) -> None:
        """The membership changed: the next ``skip_first`` steps are left out."""
        self._skip = self.skip_first

    def forget(self, worker: int) -> None:
        """``worker`` left: its estimate and seed go."""
        self._tracks.pop(int(worker), None)
        self._seeds.pop(int(worker), None)


# Dense (no sparsity) bf16 tensor TFLOP/s per GPU from the vendors' datasheets, keyed by Ray's accelerator_type names
# (ray.util.accelerators; AMD's without the "AMD-Instinct-" prefix): NVIDIA H100/H200 Tensor Core GPU datasheets
# (SXM: 1,979 with sparsity), H20 product brief, A100 datasheet, L40S, L4, A10 datasheets (A10G: AWS's A10, no sheet
# of its own: the A10's figure), HGX B200/B300 and GB200 NVL72 specifications per GPU; V100, T4, P100 have no bf16:
# their fp16 figures. AMD Instinct MI300X, MI300A, MI250X, MI210, MI100 datasheets. TPUs and other kinds: unknown.
TFLOPS = {
    "GB300": 2500.0, "GB200": 2500.0, "B300": 2250.0, "B200": 2250.0, "H200": 989.0, "H100": 989.0, "H20": 148.0,
    "A100": 312.0, "L40S": 362.0, "L4": 121.0, "A10G": 125.0, "A10": 125.0, "V100": 125.0, "T4": 65.0,
    "P100": 18.7, "MI300X": 1307.0, "MI300A": 980.6, "MI250X": 383.0, "MI210": 181.0, "MI100": 92.3,
}  # fmt: skip


def _tflops(kind: str | None) -> float | None:
    """A kind's figure: Ray's name, else its first part ('A100-80G' -> 'A100', 'AMD-Instinct-MI300X-OAM' ->
    'MI300X'); None when unknown."""
    if not kind:
        return None
    name = kind.upper().removeprefix("AMD-INSTINCT-")
    return TFLOPS.get(name, TFLOPS.get(name.split("-")[0]))


def seed_speeds(kinds: dict[int, str | None]) -> dict[int, float]:
    """Each worker's starting speed from its accelerator kind (worker id -> Ray's ``accelerator_type``, None on a
    CPU node): its datasheet bf16 dense TFLOP/s (``TFLOPS``) over the median worker's of the known kinds; an unknown
    kind counts as that median worker (1.0)."""
    known = [f for f in map(_tflops, kinds.values()) if f is not None]
    ref = _median_worker(known) if known else 1.0
    return {int(w): (f / ref if (f := _tflops(k)) is not None else 1.0) for w, k in kinds.items()}
