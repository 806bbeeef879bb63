"""``[sharding] activation_checkpointing = "auto"``: what the planner needs to choose recompute per SP group
(``flexorch.solver.recompute``), measured on the workers' own model at start.

* ``none_act_ratio`` and ``selective_act_ratio`` (each layer's MLP recomputed, the rest kept):
  activation bytes per token a layer keeps in that mode over those with full recompute, the largest any worker
  measures (``Worker.activation_bytes_per_token``; memory errs on the safe side);
* ``none_time_ratio`` (``selective_time_ratio``): the forward + backward time of one document in that mode over its
  time with full recompute, the median over the workers of each worker's median of 3 (``Worker.recompute_times``,
  all workers at once, as calibration's probes run). Clipped to at most 1: a mode that recomputes less never runs
  longer. The document is the longest a worker holds without recompute, up to ``data.max_context``, that the
  calibrated profile predicts at most :data:`TIME_PROBE_MS` with full recompute; at least
  :data:`TIME_PROBE_TOKENS` where a worker holds that many. A ratio prices whole groups, fixed costs included, so
  it is measured near the size of a micro-batch's groups, not on a short document whose fixed costs weigh more
  (how a ratio moves with the length is in docs/guide/sharding.md).

A Hugging Face model runs 'full' as Transformers' own per-layer checkpointing and 'selective' as its layers' MLPs
recomputed (``flexorch.workers.hf_model``).
"""

from __future__ import annotations

import statistics

__all__ = ["TIME_PROBE_MS", "TIME_PROBE_TOKENS", "probe_tokens", "with_recompute_ratios"]

TIME_PROBE_TOKENS = 2048
"""The shortest document timed for the time ratios (where a worker holds that many without recompute)."""
TIME_PROBE_MS = 1000.0
"""The longest predicted time (full recompute) of the timed document: 3 modes x 4 runs of it at most ~12 s."""


def probe_tokens(profile, room_tokens: int, max_context: int) -> int:
    """Tokens of the document the modes are timed on: the most, up to ``room_tokens`` (what a worker holds without
    recompute) and ``max_context``, whose predicted time with full recompute on one worker is at most
    :data:`TIME_PROBE_MS`; at least :data:`TIME_PROBE_TOKENS` (16) within ``room_tokens``."""
    from flexorch.solver.cost_model import group_time_ms

    cap = max(16, min(int(room_tokens), int(max_context)))
    lo = min(cap, TIME_PROBE_TOKENS)
    ms = lambda n: group_time_ms([n], 1, "ulysses", profile)  # noqa: E731
    if ms(cap) <= TIME_PROBE_MS:
        return cap
    hi = cap  # ms(hi) > TIME_PROBE_MS; find the largest n in [lo, hi) within it (the time grows with n)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ms(mid) <= TIME_PROBE_MS else (lo, mid)
    return lo


def with_recompute_ratios(cfg, group, profile, say=None):
    """``profile`` with the modes' byte and time ratios measured on ``group``'s workers when the run uses 'auto'
    recompute on SP steps; ``profile`` unchanged otherwise. ``say(message)`` reports what was measured: each mode's
    bytes per token (the largest any worker measured) and their ratio to full recompute's, unclipped, so that a mode
    that keeps no more than full recompute (its checkpointing not applied to the model) shows."""
    if cfg.recompute != "auto" or cfg.pipelined:
        return profile
    modes = ("none", "selective")
    full = group.call("activation_bytes_per_token", "full")
    got = {mode: group.call("activation_bytes_per_token", mode) for mode in modes}
    raw = {mode: float(max(a / b for a, b in zip(got[mode], full, strict=True))) for mode in modes}
    act = {mode: max(1.0, r) for mode, r in raw.items()}  # a profile's ratios are >= 1 (memory errs on the safe side)
    room = profile.memory_budget_bytes - profile.model_state_bytes
    tokens = probe_tokens(profile, room // (act["none"] * profile.act_bytes_per_token), cfg.data.max_context)
    times = group.call("recompute_times", tokens, (*modes, "full"))  # per worker: ms per mode, full last
    ratio = {}
    for i, mode in enumerate(modes):
        ratios = [t[i] / t[-1] for t in times if t[-1] > 0]
        ratio[mode] = min(1.0, statistics.median(ratios)) if ratios else 1.0
    if say is not None:
        ms = [statistics.median(t[i] for t in times) for i in range(len(modes) + 1)]
        each = "; ".join(
            f"{'without recompute' if m == 'none' else 'with selective recompute'} a token keeps {raw[m]:.2f}x the "
            f"activations ({_kib(max(got[m]))}){_not_applied(raw[m])} and the document takes {ms[i]:.1f} ms "
            f"(ratio {ratio[m]:.3f})"
            for i, m in enumerate(modes)
        )
        say(
            f"recompute 'auto' ({tokens:,}-token document, {ms[-1]:.1f} ms with full recompute, which keeps "
            f"{_kib(max(full))} per token): {each}"
        )
    return profile.with_overrides(
        none_act_ratio=act["none"], none_time_ratio=ratio["none"],
        selective_act_ratio=act["selective"], selective_time_ratio=ratio["selective"],
    )  # fmt: skip


def _kib(n: float) -> str:
    return f"{n / 1024:,.1f} KiB"


def _not_applied(ratio: float) -> str:
    """What a ratio of at most 1.05 means: the model kept the same whatever the mode (a transformer layer keeps
    several times its input without recompute), so the modes were not applied to it when it was measured."""
    return "" if ratio > 1.05 else ", no more than with full recompute: the modes did not change what the model keeps"
