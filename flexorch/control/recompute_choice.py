"""``[sharding] activation_checkpointing = "auto"``: what the planner needs to choose recompute per SP group
(``flexorch.solver.recompute``), measured on the workers' own model at start.

* ``none_act_ratio``: activation bytes per token a layer keeps without recompute over those with full recompute,
  the largest any worker measures (``Worker.activation_bytes_per_token``; memory errs on the safe side);
* ``none_time_ratio``: the forward + backward time of one document without recompute over its time with full
  recompute, the median over the workers of each worker's median of 3 (``Worker.recompute_times``, all workers at
  once, as calibration's probes run). The document is as long as a worker holds without recompute, at most
  :data:`TIME_PROBE_TOKENS`. Clipped to at most 1: a recompute never runs less.
"""

from __future__ import annotations

import statistics

__all__ = ["TIME_PROBE_TOKENS", "with_recompute_ratios"]

TIME_PROBE_TOKENS = 2048
"""The longest document timed for ``none_time_ratio``."""


def with_recompute_ratios(cfg, group, profile, say=None):
    """``profile`` with ``none_act_ratio`` and ``none_time_ratio`` measured on ``group``'s workers when the run
    uses 'auto' recompute on SP steps; ``profile`` unchanged otherwise. ``say(message)`` reports what was measured."""
    if cfg.sharding.activation_checkpointing != "auto" or cfg.pipelined:
        return profile
    none = group.call("activation_bytes_per_token", "none")
    full = group.call("activation_bytes_per_token", "full")
    act_ratio = float(max(a / b for a, b in zip(none, full, strict=True)))
    room = profile.memory_budget_bytes - profile.model_state_bytes
    tokens = int(max(16, min(TIME_PROBE_TOKENS, room // (act_ratio * profile.act_bytes_per_token))))
    times = group.call("recompute_times", tokens)
    ratios = [n / f for n, f in times if f > 0]
    time_ratio = min(1.0, statistics.median(ratios)) if ratios else 1.0
    if say is not None:
        ms_none = statistics.median(t[0] for t in times)
        ms_full = statistics.median(t[1] for t in times)
        say(
            f"recompute 'auto': without recompute a token keeps {act_ratio:.2f}x the activations and a "
            f"{tokens:,}-token document takes {ms_none:.1f} ms against {ms_full:.1f} ms with full recompute "
            f"(time ratio {time_ratio:.3f})"
        )
    return profile.with_overrides(none_act_ratio=max(1.0, act_ratio), none_time_ratio=time_ratio)
