"""``[sharding] activation_checkpointing = "auto"``: recompute only where memory needs it, per micro-batch.

Recomputing a layer in the backward costs about a third more compute (on one H200, a 40,596-token micro-batch of a
1.1B Llama: 1,452 ms with full recompute, 1,129 without, compiled; ``benchmarks/gpu_profile.py``), and keeping its
activations costs memory (54 GiB against 8.4 GiB there). With 'auto' the planner packs micro-batches for the
activation bytes of full recompute (the most tokens a worker holds), and then each SP group of each micro-batch
runs without recompute when its tokens fit the activation budget at the bytes per token measured without
recompute, else with full recompute. Every member of a group runs the same mode (a recompute runs the group's
sequence-parallel collectives again); groups of one micro-batch may differ (their collectives are their own, and
FSDP gathers each layer once per backward either way).

The bytes a device holds per token of its shard without recompute are the planner's bytes per token (those of full
recompute: calibrated, or a fixed profile's) times the ratio of the two modes measured on the workers' own model
(``Worker.activation_bytes_per_token``), plus a Ulysses group's all-to-all copies
(``Profile.act_bytes_per_local_token``); a group's shard is ``ceil(tokens / degree)``.
"""

from __future__ import annotations

import math

__all__ = ["choose_recompute", "describe", "none_over_full"]


def none_over_full(cfg, group) -> float | None:
    """With 'auto' recompute (SP steps): activation bytes per token without recompute over those with full
    recompute, the largest ratio any worker measures on its model; None otherwise."""
    if cfg.sharding.activation_checkpointing != "auto" or cfg.pipelined:
        return None
    none = group.call("activation_bytes_per_token", "none")
    full = group.call("activation_bytes_per_token", "full")
    return float(max(a / b for a, b in zip(none, full, strict=True)))


def choose_recompute(plan, profile, none_ratio: float) -> tuple[tuple[str, ...], ...]:
    """Per micro-batch of ``plan`` (a ``solver.plan.Plan``), each group's mode in the plan's order: 'none' when
    its shard's activations without recompute (``none_ratio`` x the profile's bytes per token) fit ``profile``'s
    activation budget, else 'full'."""
    room = profile.memory_budget_bytes - profile.model_state_bytes
    act_bytes_none = none_ratio * profile.act_bytes_per_token
    modes = []
    for mb in plan.micro_batches:
        row = []
        for g in mb.groups:
            shard = math.ceil(sum(plan.seq_lengths[i] for i in g.seq_ids) / g.degree)
            copies = profile.act_bytes_per_local_token(g.kind, g.degree) - profile.act_bytes_per_token
            row.append("none" if shard * (act_bytes_none + copies) <= room else "full")
        modes.append(tuple(row))
    return tuple(modes)


def describe(modes) -> str:
    """E.g. 'recompute: none in 5 of 6 groups'."""
    flat = [m for row in modes for m in row]
    return f"recompute: none in {flat.count('none')} of {len(flat)} groups"
