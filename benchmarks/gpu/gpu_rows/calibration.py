"""e. calibration: ``flexorch.control.calibration.calibrate`` on a one-worker group in this process, written as
``<out>/profile.json`` and loaded back (row ``e.profile``); then the planner's time for d's batch from that profile
against d's measured step time (row ``e.predict``)."""

from __future__ import annotations

import json
import math

from .check import Check, Ctx, FailRow, SkipRow
from .one_worker import one_rank_world, sharded_model, train_config
from .sizes import PREDICT_SLACK

__all__ = ["LocalGroup", "section_calibration"]


class LocalGroup:
    """The worker group ``flexorch.control.calibration.calibrate`` drives (``size``, ``call``, ``rank_nodes``): one
    worker in this process, running what ``flexorch.workers.actor.Worker.probe`` and ``.activation_bytes_per_token``
    run."""

    size = 1

    def rank_nodes(self) -> list[str | None]:
        return [None]  # one worker: probed as one node

    def __init__(self, model, reg, vocab_size: int) -> None:
        self.model, self.reg, self.vocab_size = model, reg, vocab_size

    def call(self, method: str, *args):
        from flexorch.workers.calibrate import activation_bytes_per_token, run_probes

        if method == "activation_bytes_per_token":
            return [activation_bytes_per_token(self.model, self.vocab_size)]
        if method != "probe":
            raise ValueError(f"LocalGroup has no method {method!r}")

        return [run_probes(self.model, args[0], 0, 1, self.reg.group, None, self.vocab_size, every_rank=True)]


def section_calibration(check: Check, ctx: Ctx) -> None:
    planned = None  # the calibrated profile as the planner uses it, for e.predict
    with check.row("e.profile", f"calibration -> {ctx.out / 'profile.json'}, loaded back") as r:
        from flexorch.control.calibration import calibrate, fitted_profile  # inside the row: a failed import is a row
        from flexorch.solver.profiles import get_profile

        cfg = train_config(ctx)
        with one_rank_world(ctx) as reg:
            group = LocalGroup(sharded_model(ctx, cfg), reg, cfg.model.vocab_size)
            profile, report = calibrate(
                group, cfg, repeats=ctx.sizes.cal_repeats, publish=lambda e: print(f"    {e['message']}", flush=True)
            )
        path = ctx.out / "profile.json"
        path.write_text(profile.to_json())
        (ctx.out / "calibration.json").write_text(json.dumps(report, indent=1))
        loaded = get_profile(str(path))
        if loaded != profile:
            raise FailRow(f"{path} loads as a different profile")
        planned = fitted_profile(loaded, cfg)
        keys = ("a1_ms", "a2_ms", "b1_ms", "act_bytes_per_token", "model_state_bytes", "memory_budget_bytes")
        r.metrics = {k: getattr(loaded, k) for k in keys} | {
            "tokens_per_device": planned.tokens_per_device,
            "median_rel_error": report["median_rel_error"],
            "max_rel_error": report["max_rel_error"],
        }
        r.detail = (
            f"a1 {loaded.a1_ms:.3g} ms/tok^2, a2 {loaded.a2_ms:.3g} ms/tok, b1 {loaded.b1_ms:.3g} ms, "
            f"{loaded.act_bytes_per_token:,.0f} B/token, model state {loaded.model_state_bytes / 2**30:.2f} GiB; "
            f"planner: {planned.tokens_per_device:,} tokens/device; fit error median "
            f"{100 * report['median_rel_error']:.1f} %, max {100 * report['max_rel_error']:.1f} %"
        )
        bad = [k for k in keys if not (math.isfinite(getattr(loaded, k)) and getattr(loaded, k) >= 0)]
        if bad or loaded.act_bytes_per_token <= 0:
            raise FailRow(f"profile constants not usable: {bad or 'act_bytes_per_token'}; {r.detail}")
    with check.row("e.predict", "the calibrated planner's time for d.step's batch vs the measured step") as r:
        from flexorch.solver.cost_model import group_time_ms

        if ctx.step is None:
            raise SkipRow("d.step did not run or failed")
        if planned is None:
            raise FailRow("no calibrated profile (e.profile failed)")
        predicted = group_time_ms(ctx.step["lengths"], 1, "ulysses", planned)  # one worker: one group of degree 1
        measured = 1e3 * ctx.step["step_s"]
        err = abs(predicted - measured) / measured
        r.metrics = {"predicted_ms": predicted, "measured_ms": measured, "rel_error": err}
        r.detail = (
            f"{len(ctx.step['lengths'])} documents, {ctx.step['tokens']:,} tokens: predicted {predicted:,.1f} ms, "
            f"measured {measured:,.1f} ms (median of {ctx.sizes.reps}): error {100 * err:.1f} %"
        )
        if ctx.dry:
            r.detail += " (not judged in --dry: a tiny model on shared CPU cores)"
        elif err > PREDICT_SLACK:
            raise FailRow(f"off by more than {100 * PREDICT_SLACK:.0f} %: {r.detail}")
