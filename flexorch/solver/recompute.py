"""Recompute per SP group (``[sharding] activation_checkpointing = "auto"``): each group of each micro-batch runs
without recompute where its shard fits the activation budget at the bytes it keeps then, else with full recompute.

Recomputing a layer in the backward runs its forward twice: a third more compute (on one H200, a 40,596-token
micro-batch of a 1.1B Llama: 1,452 ms with full recompute, 1,129 without, compiled; ``benchmarks/gpu_profile.py``),
for 8.4 GiB of activations instead of 54 GiB there. The profile's time and memory terms are full recompute's
(the mode the workers calibrate in); ``Profile.none_act_ratio`` and ``Profile.none_time_ratio``, measured on the
workers' own model at start, say what a token keeps and what a group takes without it.

Two ways to pack a step, and the planner plans both and keeps the faster in this time model
(:func:`choose_packing`):

* **full's packing**: micro-batches packed for full recompute's bytes (the most tokens a worker holds: fewest
  micro-batches, so the fewest fixed costs per micro-batch), then every group whose shard fits without recompute
  runs without it (:func:`choose_modes`);
* **none's packing**: micro-batches packed for the bytes without recompute (more of them, smaller), every group
  without recompute; documents too long for any group of the world without recompute are packed for full
  recompute's bytes in micro-batches of their own before the others (:func:`too_long_without_recompute`).

Korthikanti et al. (arXiv 2205.05198) choose what to recompute per layer for one fixed micro-batch size; here the
choice is per group and trades against the micro-batch size, as InfiniPipe's checkpointing ILP trades it against
pipeline chunks (arXiv 2509.21275; ``flexorch.solver.pipeline``). A group's time without recompute is
``none_time_ratio`` x its time with it, fixed cost included (the ratio is measured on a whole micro-batch).
Members of a group share its mode (a recompute runs the group's sequence-parallel collectives again); groups of one
micro-batch may differ (their collectives are their own). A shard is ``ceil(tokens / degree)``; a Ulysses group
also holds its all-to-all copies (``Profile.act_bytes_per_local_token``).
"""

from __future__ import annotations

import math

from flexorch.solver.plan import Plan
from flexorch.solver.profiles import Profile

__all__ = [
    "choose_modes",
    "choose_packing",
    "concatenated",
    "describe",
    "none_bytes_profile",
    "recompute_modes",
    "too_long_without_recompute",
    "uses_auto",
    "with_modes",
]


def uses_auto(profile: Profile) -> bool:
    """Whether ``profile`` plans recompute per group (its ``none_act_ratio`` is measured)."""
    return profile.none_act_ratio > 0


def none_bytes_profile(profile: Profile) -> Profile:
    """``profile`` with the activation bytes per token a layer keeps without recompute: micro-batches packed with
    it fit every group without recompute. Times are unchanged (the same factor for every group: the same plans)."""
    return profile.with_overrides(act_bytes_per_token=profile.act_bytes_per_token * profile.none_act_ratio)


def too_long_without_recompute(lengths, num_devices: int, profile: Profile) -> list[int]:
    """Indices of the documents no group of ``num_devices`` holds without recompute (a ring group of the largest
    power of two <= ``num_devices`` holds the most tokens)."""
    d = 1 << (int(num_devices).bit_length() - 1)
    limit = none_bytes_profile(profile).group_token_cap("ring", d)
    return [i for i, s in enumerate(lengths) if int(s) > limit]


def concatenated(profile: Profile, lengths, parts) -> Plan:
    """One plan of the batch ``lengths`` whose micro-batches are those of each part in turn; ``parts``:
    ``(plan, ids)`` pairs, ``ids[j]`` the batch index of the part's sequence j (every index in exactly one part)."""
    from flexorch.solver.plan import Group, MicroBatch

    micro_batches = [
        MicroBatch(tuple(Group(g.degree, g.kind, g.ranks, tuple(ids[j] for j in g.seq_ids)) for g in mb.groups))
        for part, ids in parts
        for mb in part.micro_batches
    ]
    n = parts[0][0].num_devices
    return Plan.for_profile(num_devices=n, seq_lengths=lengths, micro_batches=micro_batches, profile=profile)


def choose_modes(plan: Plan, profile: Profile) -> tuple[tuple[str, ...], ...]:
    """Per micro-batch of ``plan``, each group's mode in the plan's order: 'none' when its shard's activations
    without recompute fit ``profile``'s activation budget, else 'full'."""
    room = profile.memory_budget_bytes - profile.model_state_bytes
    act_none = profile.none_act_ratio * profile.act_bytes_per_token
    modes = []
    for mb in plan.micro_batches:
        row = []
        for g in mb.groups:
            shard = math.ceil(sum(plan.seq_lengths[i] for i in g.seq_ids) / g.degree)
            copies = profile.act_bytes_per_local_token(g.kind, g.degree) - profile.act_bytes_per_token
            row.append("none" if shard * (act_none + copies) <= room else "full")
        modes.append(tuple(row))
    return tuple(modes)


def with_modes(plan: Plan, modes) -> Plan:
    """``plan`` carrying its groups' recompute modes (``plan.meta['recompute']``): the simulator times each group in
    its mode, the driver sends each group's mode to its workers."""
    plan.meta["recompute"] = tuple(tuple(row) for row in modes)
    return plan


def choose_packing(full_plan: Plan, none_plan: Plan | None, profile: Profile) -> tuple[Plan, dict]:
    """The faster, in the recompute-aware time model, of ``full_plan`` (packed for full recompute's bytes, each
    group in :func:`choose_modes`' mode) and ``none_plan`` (packed for the bytes without recompute; None: not
    planned), carrying its modes; and what was compared: ``{"packing": "full"|"none", "full_ms", "none_ms"}``."""
    from flexorch.solver.simulator import step_time_ms

    with_modes(full_plan, choose_modes(full_plan, profile))
    full_ms = step_time_ms(full_plan, profile)
    info = {"packing": "full", "full_ms": full_ms, "none_ms": None}
    if none_plan is not None:
        with_modes(none_plan, choose_modes(none_plan, profile))
        info["none_ms"] = none_ms = step_time_ms(none_plan, profile)
        if none_ms < full_ms:
            info["packing"] = "none"
            none_plan.meta["recompute_packing"] = info
            return none_plan, info
    full_plan.meta["recompute_packing"] = info
    return full_plan, info


def recompute_modes(plan: Plan, profile: Profile):
    """The modes ``plan``'s groups run in: those the planner chose (``plan.meta['recompute']``), else chosen now
    (a plan made without them, e.g. before the profile measured its ratios); None when ``profile`` does not plan
    recompute per group."""
    if plan.meta.get("recompute"):
        return plan.meta["recompute"]
    if not uses_auto(profile):
        return None
    return with_modes(plan, choose_modes(plan, profile)).meta["recompute"]


def describe(modes) -> str:
    """E.g. 'recompute: none in 5 of 6 groups'."""
    flat = [m for row in modes for m in row]
    return f"recompute: none in {flat.count('none')} of {len(flat)} groups"
