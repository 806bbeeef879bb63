"""Recompute per SP group (``[sharding] activation_checkpointing = "auto"``): each group of each micro-batch runs in
the fastest recompute mode whose activations for its shard fit the budget: none, selective (flexorch's decoder:
only the MLPs are run again) or full.

Recomputing a layer in the backward runs its forward twice: about a third more compute, for a small share of the
activations (measured figures: docs/guide/sharding.md, ``benchmarks/gpu/gpu_profile.py``). The profile's time and
memory terms are full recompute's (the mode the workers calibrate in); ``Profile.none_act_ratio`` /
``none_time_ratio`` (and ``selective_*``), measured on the workers' own model at start
(``flexorch.control.recompute_choice``), say what a token keeps and what a group takes in the other modes.

A step can be packed several ways, and the planner plans them and keeps the fastest in this time model
(:func:`choose_packing`):

* **full's packing**: micro-batches packed for full recompute's bytes (the most tokens a worker holds: fewest
  micro-batches, so the fewest fixed costs per micro-batch), then every group runs in the fastest mode that fits
  (:func:`choose_modes`);
* **none's / selective's packing**: micro-batches packed for that mode's bytes (more of them, smaller), every group
  in that mode or faster; documents too long for any group of the world in that mode are packed for full
  recompute's bytes in micro-batches of their own before the others (:func:`too_long_for`). Planned only when some
  group of full's packing runs in a slower mode.

Korthikanti et al. (arXiv 2205.05198) choose what to recompute per layer for one fixed micro-batch size; here the
choice is per group and trades against the micro-batch size, as InfiniPipe's checkpointing ILP trades it against
pipeline chunks (arXiv 2509.21275; ``flexorch.solver.pipeline``). A group's time in a mode is its time ratio x its
time with full recompute, fixed cost included (the ratio is measured on a whole micro-batch). Members of a group
share its mode (a recompute runs the group's sequence-parallel collectives again); groups of one micro-batch may
differ (their collectives are their own). A shard is ``ceil(tokens / degree)``; a Ulysses group also holds its
all-to-all copies (``Profile.act_bytes_per_local_token``).
"""

from __future__ import annotations

import math
from typing import NamedTuple

from flexorch.solver.plan import Plan
from flexorch.solver.profiles import Profile
from flexorch.solver.simulator import step_time_ms

__all__ = [
    "PACKINGS",
    "Packings",
    "choose_modes",
    "choose_packing",
    "concatenated",
    "describe",
    "faster_modes",
    "mode_bytes_profile",
    "mode_packing",
    "other_packings",
    "none_bytes_profile",
    "recompute_bound",
    "recompute_modes",
    "too_long_for",
    "too_long_without_recompute",
    "uses_auto",
    "with_chosen_modes",
    "with_modes",
    "worth_packing",
]

PACKINGS = ("full", "none", "selective")
"""The activation bytes a step may be packed for, in the order the planner plans them."""


def uses_auto(profile: Profile) -> bool:
    """Whether ``profile`` plans recompute per group (its ``none_act_ratio`` is measured)."""
    return profile.none_act_ratio > 0


def _act_ratio(profile: Profile, mode: str) -> float:
    """Bytes a token keeps in ``mode`` over full recompute's (0: the mode is not available)."""
    return {"full": 1.0, "none": profile.none_act_ratio, "selective": profile.selective_act_ratio}[mode]


def faster_modes(profile: Profile) -> list[str]:
    """The modes faster than full recompute that ``profile`` measured, fastest first ('none' before 'selective' on a
    tie)."""
    ratios = profile.mode_time_ratios()
    modes = [m for m in ("none", "selective") if _act_ratio(profile, m) > 0]
    return sorted(modes, key=lambda m: ratios[m])  # stable: 'none' first on a tie


def mode_bytes_profile(profile: Profile, mode: str) -> Profile:
    """``profile`` with the activation bytes per token a layer keeps in ``mode``: micro-batches packed with it fit
    every group in that mode. Times are unchanged (the same factor for every group: the same plans)."""
    return profile.with_overrides(act_bytes_per_token=profile.act_bytes_per_token * _act_ratio(profile, mode))


def none_bytes_profile(profile: Profile) -> Profile:
    """:func:`mode_bytes_profile` for no recompute."""
    return mode_bytes_profile(profile, "none")


def too_long_for(mode: str, lengths, num_devices: int, profile: Profile) -> list[int]:
    """Indices of the documents no group of ``num_devices`` holds in ``mode`` (a ring group of the largest power of
    two <= ``num_devices`` holds the most tokens)."""
    d = 1 << (int(num_devices).bit_length() - 1)
    limit = mode_bytes_profile(profile, mode).group_token_cap("ring", d)
    return [i for i, s in enumerate(lengths) if int(s) > limit]


def too_long_without_recompute(lengths, num_devices: int, profile: Profile) -> list[int]:
    """:func:`too_long_for` no recompute."""
    return too_long_for("none", lengths, num_devices, profile)


def concatenated(profile: Profile, lengths, parts) -> Plan:
    """One plan of the batch ``lengths`` whose micro-batches are those of each part in turn; ``parts``:
    ``(plan, ids)`` pairs, ``ids[j]`` the batch index of the part's sequence j (every index in exactly one part)."""
    from flexorch.solver.plan import Group, MicroBatch

    micro_batches = [
        MicroBatch(
            tuple(
                Group(g.degree, g.kind, g.ranks, tuple(ids[j] for j in g.seq_ids), g.ulysses_degree) for g in mb.groups
            )
        )
        for part, ids in parts
        for mb in part.micro_batches
    ]
    n, topology = parts[0][0].num_devices, parts[0][0].topology
    return Plan.for_profile(
        num_devices=n, seq_lengths=lengths, micro_batches=micro_batches, profile=profile, topology=topology
    )


def choose_modes(plan: Plan, profile: Profile) -> tuple[tuple[str, ...], ...]:
    """Per micro-batch of ``plan``, each group's mode in the plan's order: of the modes whose activations for the
    group's shard fit ``profile``'s activation budget ('full' always does: the plan was packed for it), the one
    measured fastest ('none', then 'selective', then 'full' on a tie)."""
    room = profile.memory_budget_bytes - profile.model_state_bytes
    order = faster_modes(profile)
    modes = []
    for mb in plan.micro_batches:
        row = []
        for g in mb.groups:
            shard = math.ceil(sum(plan.seq_lengths[i] for i in g.seq_ids) / g.degree)
            copies = profile.act_bytes_per_local_token(g.kind, g.degree) - profile.act_bytes_per_token
            fits = (m for m in order if shard * (_act_ratio(profile, m) * profile.act_bytes_per_token + copies) <= room)
            row.append(next(fits, "full"))
        modes.append(tuple(row))
    return tuple(modes)


def with_modes(plan: Plan, modes) -> Plan:
    """``plan`` carrying its groups' recompute modes (``plan.meta['recompute']``): the simulator times each group in
    its mode, the driver sends each group's mode to its workers."""
    plan.meta["recompute"] = tuple(tuple(row) for row in modes)
    return plan


class Packings(NamedTuple):
    """The packings :func:`choose_packing` compared: ``ran``, the mode whose packing won, and ``ms``, each packing's
    step time in the recompute-aware time model (full's first; None: not planned)."""

    ran: str
    ms: dict[str, float | None]

    @property
    def ran_ms(self) -> float:
        """The winner's step time: the step's prediction."""
        return self.ms[self.ran]

    def record(self) -> dict:
        """The step record's ``recompute_packing``: ``{"packing": the winner's mode, "full_ms", "<mode>_ms", ...}``."""
        return {"packing": self.ran, **{f"{mode}_ms": ms for mode, ms in self.ms.items()}}


def choose_packing(full_plan: Plan, others: dict, profile: Profile) -> tuple[Plan, Packings]:
    """The fastest, in the recompute-aware time model, of ``full_plan`` (packed for full recompute's bytes) and
    ``others`` (``{mode: plan packed for that mode's bytes, or None: not planned}``), each group in
    :func:`choose_modes`' mode, carrying its modes and (in ``meta["recompute_packing"]``) what was compared; and
    the :class:`Packings` compared."""
    best, ran, times = full_plan, "full", {}
    for mode, plan in (("full", full_plan), *others.items()):
        if plan is None:
            times[mode] = None
            continue
        with_modes(plan, choose_modes(plan, profile))
        times[mode] = ms = step_time_ms(plan, profile)
        if ms < times[ran]:
            best, ran = plan, mode
    packings = Packings(ran, times)
    best.meta["recompute_packing"] = packings.record()
    return best, packings


def with_chosen_modes(plan: Plan, profile: Profile) -> Plan:
    """``plan`` carrying each group's :func:`choose_modes` mode where ``profile`` plans them ('auto'), else as it
    is."""
    return with_modes(plan, choose_modes(plan, profile)) if plan is not None and uses_auto(profile) else plan


def worth_packing(mode: str, ran: set[str], profile: Profile) -> bool:
    """Whether packing a step for ``mode``'s bytes can beat full's packing whose groups ran in the modes ``ran``:
    the mode is available and some group ran in a mode slower than it."""
    ratios = profile.mode_time_ratios()
    return mode in faster_modes(profile) and any(ratios[m] > ratios[mode] for m in ran)


def recompute_bound(plan: Plan, bound: float, profile: Profile) -> float:
    """A lower bound under 'auto' recompute, from ``bound`` (full recompute's, for any plan): no plan runs faster than
    the fastest mode's time ratio x its full-recompute time, so ``ratio x bound`` holds; claimed (as a bound near the
    plan) only when every group of ``plan`` runs in that fastest mode, else 0 (none computed)."""
    ratios = profile.mode_time_ratios()
    fastest = min([*faster_modes(profile), "full"], key=ratios.get)
    every = all(m == fastest for row in plan.meta["recompute"] for m in row)
    return bound * ratios[fastest] if every else 0.0


def mode_packing(planner, mode: str, lengths, n: int, due: float, idle=None, topology=None) -> tuple[Plan | None, int]:
    """The MILP plan of ``planner`` (a ``solver.planner.Planner`` planning with full recompute's profile) packed for
    ``mode``'s activation bytes by ``due``, the documents too long for that in micro-batches of their own packed
    for full recompute's bytes first; None when every document is too long, or a solve ran out of time. Also the
    solver crashes it cost. ``idle``: the caller's work while the solves run (``Planner.plan``)."""
    import time

    full_profile = planner.profile
    long = set(too_long_for(mode, lengths, n, full_profile))
    if len(long) == len(lengths):
        return None, 0
    short = [i for i in range(len(lengths)) if i not in long]
    parts, crashes = [], 0
    try:
        for ids, profile in ((sorted(long), full_profile), (short, mode_bytes_profile(full_profile, mode))):
            if not ids:
                continue
            planner.profile = profile
            left = due - time.monotonic()  # the long documents (few) get a quarter of the time left
            until = due if ids is short else time.monotonic() + 0.25 * left
            sp = planner.plan([lengths[i] for i in ids], n, deadline=until, idle=idle, topology=topology)
            crashes += sp.solver_crashes
            if sp.out_of_time:
                return None, crashes
            parts.append((sp.plan, ids))
    finally:
        planner.profile = full_profile
    if len(parts) == 1:
        return parts[0][0], crashes
    return concatenated(full_profile, lengths, parts), crashes


def other_packings(planner, plan: Plan, lengths, n: int, due: float, idle=None, *, min_s: float) -> tuple[dict, int]:
    """'auto' recompute: ``{mode: the MILP plan packed for that mode's bytes (None: no time left, or no plan)}``
    for each mode faster than one some group of ``plan`` (packed for full recompute's bytes) runs in, planned
    one after another by ``due`` (:func:`mode_packing`; not started with less than ``min_s`` left); and the solver
    crashes they cost (:func:`choose_packing` picks among them)."""
    import time

    profile = planner.profile
    others, crashes = {}, 0
    ran = {m for row in choose_modes(plan, profile) for m in row}
    todo = [m for m in PACKINGS[1:] if worth_packing(m, ran, profile)]
    for i, mode in enumerate(todo):
        until = time.monotonic() + (due - time.monotonic()) / (len(todo) - i)
        others[mode], more = (
            mode_packing(planner, mode, lengths, n, until, idle, plan.topology)
            if until - time.monotonic() >= min_s
            else (None, 0)  # no time left to plan it
        )
        crashes += more
    return others, crashes


def recompute_modes(plan: Plan, profile: Profile):
    """The modes ``plan``'s groups run in: those the planner chose (``plan.meta['recompute']``), else chosen now
    (a plan made without them, e.g. before the profile measured its ratios); None when ``profile`` does not plan
    recompute per group."""
    if plan.meta.get("recompute"):
        return plan.meta["recompute"]
    if not uses_auto(profile):
        return None
    return with_chosen_modes(plan, profile).meta["recompute"]


def describe(modes) -> str:
    """E.g. 'recompute: none in 5 of 6 groups' or 'recompute: none in 3, selective in 2 of 6 groups'."""
    flat = [m for row in modes for m in row]
    parts = [f"none in {flat.count('none')}"] + [f"selective in {flat.count('selective')}"] * ("selective" in flat)
    return f"recompute: {', '.join(parts)} of {len(flat)} groups"
