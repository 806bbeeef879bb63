"""``[sharding] activation_checkpointing = "auto"``: what the planner needs to choose recompute per SP group
(``flexorch.solver.recompute``), measured on the workers' own model at start.

* ``none_act_ratio`` (and on flexorch's decoder, which can recompute only its MLPs, ``selective_act_ratio``):
  activation bytes per token a layer keeps in that mode over those with full recompute, the largest any worker
  measures (``Worker.activation_bytes_per_token``; memory errs on the safe side);
* ``none_time_ratio`` (``selective_time_ratio``): the forward + backward time of one document in that mode over its
  time with full recompute, the median over the workers of each worker's median of 3 (``Worker.recompute_times``,
  all workers at once, as calibration's probes run). The document is as long as a worker holds without recompute, at
  most :data:`TIME_PROBE_TOKENS`. Clipped to at most 1: a mode that recomputes less never runs longer.

A Hugging Face model takes 'none' or 'full' only (Transformers' own per-layer checkpointing).
"""

from __future__ import annotations

import statistics

__all__ = ["TIME_PROBE_TOKENS", "with_recompute_ratios"]

TIME_PROBE_TOKENS = 2048
"""The longest document timed for the time ratios."""


def with_recompute_ratios(cfg, group, profile, say=None):
    """``profile`` with the modes' byte and time ratios measured on ``group``'s workers when the run uses 'auto'
    recompute on SP steps; ``profile`` unchanged otherwise. ``say(message)`` reports what was measured."""
    if cfg.recompute != "auto" or cfg.pipelined:
        return profile
    modes = ("none",) if cfg.model.hf is not None else ("none", "selective")
    full = group.call("activation_bytes_per_token", "full")
    act = {}
    for mode in modes:
        got = group.call("activation_bytes_per_token", mode)
        act[mode] = max(1.0, float(max(a / b for a, b in zip(got, full, strict=True))))
    room = profile.memory_budget_bytes - profile.model_state_bytes
    tokens = int(max(16, min(TIME_PROBE_TOKENS, room // (act["none"] * profile.act_bytes_per_token))))
    times = group.call("recompute_times", tokens, (*modes, "full"))  # per worker: ms per mode, full last
    ratio = {}
    for i, mode in enumerate(modes):
        ratios = [t[i] / t[-1] for t in times if t[-1] > 0]
        ratio[mode] = min(1.0, statistics.median(ratios)) if ratios else 1.0
    if say is not None:
        ms = [statistics.median(t[i] for t in times) for i in range(len(modes) + 1)]
        each = "; ".join(
            f"{'without recompute' if m == 'none' else 'with selective recompute'} a token keeps {act[m]:.2f}x the "
            f"activations and the document takes {ms[i]:.1f} ms (ratio {ratio[m]:.3f})"
            for i, m in enumerate(modes)
        )
        say(f"recompute 'auto' ({tokens:,}-token document, {ms[-1]:.1f} ms with full recompute): {each}")
    extra = {}
    if "selective" in modes:
        extra = {"selective_act_ratio": act["selective"], "selective_time_ratio": ratio["selective"]}
    return profile.with_overrides(none_act_ratio=act["none"], none_time_ratio=ratio["none"], **extra)
