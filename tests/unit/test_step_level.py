"""The run's step level (``flexorch.solver.step_level``): every step's prices times how much slower or faster than
its profile the steps before it ran, replayed on two recorded runs of the demo."""

from __future__ import annotations

import json

import numpy as np
import pytest

from flexorch.solver.profiles import load_profile, profile_from_dict
from flexorch.solver.record_samples import step_of_record
from flexorch.solver.step_level import LEVEL_ALPHA, LEVEL_BOUNDS, LEVEL_STEPS, step_level
from tests.paths import DATA, REPO


class _Step:
    """A step the profile prices at ``predicted`` ms that took ``ms``."""

    def __init__(self, ms: float, predicted: float = 100.0):
        self.ms, self.predicted = ms, predicted

    def predict_ms(self, profile) -> float:
        return self.predicted


def test_no_step_is_level_one_and_a_steady_drift_is_its_factor():
    assert step_level([], None) == 1.0
    assert step_level([_Step(50.0, predicted=0.0)], None) == 1.0  # nothing priced: nothing to level by
    for k in (0.7, 1.0, 1.3):
        assert step_level([_Step(100.0 * k) for _ in range(5)], None) == pytest.approx(k)


def test_the_newest_step_weighs_alpha_and_only_the_last_steps_count():
    assert step_level([_Step(100.0), _Step(200.0)], None) == pytest.approx(1.0 + LEVEL_ALPHA)
    old = [_Step(300.0)] * 20
    recent = [_Step(100.0)] * LEVEL_STEPS
    assert step_level(old + recent, None) == pytest.approx(1.0)  # the run left its warm-up behind
    with pytest.raises(ValueError, match="alpha"):
        step_level([_Step(100.0)], None, alpha=0.0)


def test_one_stalled_step_moves_the_level_a_bounded_amount():
    lo, hi = LEVEL_BOUNDS
    stalled = step_level([_Step(100.0)] * 4 + [_Step(100.0 * 1000)], None)
    assert stalled == pytest.approx((1 - LEVEL_ALPHA) + LEVEL_ALPHA * hi)
    assert step_level([_Step(0.001)], None) == pytest.approx(lo)


def _run(name: str):
    d = DATA / name
    records = [json.loads(x) for x in (d / "steps.jsonl").read_text().splitlines()]
    profiles = {0: load_profile(d / "profile.json")}
    for line in (d / "profile_revisions.jsonl").read_text().splitlines():
        entry = json.loads(line)
        profiles[entry["revision"]] = profile_from_dict(entry["profile"])
    return records, profiles


@pytest.mark.parametrize("name", ["demo_refit", "demo_drift"])
def test_leveled_predictions_of_recorded_demo_runs_are_closer_than_the_profiles_alone(name):
    # two `make demo` runs (20 steps, 4 CPU workers on 2 cores, refits every 4 steps) recorded before the level
    # existed: in demo_drift the first 5 steps ran 20 % slower per predicted ms than the later ones, with the same
    # plan shapes. Each step leveled as the driver now does it, by the warm steps before it (the first step of a
    # world is left out), priced by the profile revision that planned it: the median error over steps 3-20 drops.
    records, profiles = _run(name)
    steps = [step_of_record(r) for r in records]
    measured = np.array([r["measured_ms"] for r in records])
    plain = np.array([r["predicted_ms"] for r in records])
    leveled = np.array(
        [r["predicted_ms"] * step_level(steps[1:i], profiles[r["profile_revision"]]) for i, r in enumerate(records)]
    )
    err_plain = np.abs(plain[2:] / measured[2:] - 1)
    err_leveled = np.abs(leveled[2:] / measured[2:] - 1)
    assert np.median(err_leveled) < np.median(err_plain) - 0.01, (np.median(err_plain), np.median(err_leveled))
    assert err_leveled.max() < err_plain.max()


def test_calibration_error_prints_the_per_step_table_and_the_noise_floor_of_a_recorded_run():
    # `python -m benchmarks.measured.calibration_error --records DIR` on demo_drift: its steps 3-20 as the run
    # predicted them, and how far steps the calibration prices alike lie from their kind's median time (what no
    # price can get under)
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.measured.calibration_error", "--records", str(DATA / "demo_drift"),
         "--results", "-"],
        capture_output=True, text=True, check=True, timeout=120, cwd=REPO,
    ).stdout  # fmt: skip
    assert "steps 3-20: as predicted median 13.8 %, worst 26.0 %" in out, out
    assert "noise floor: 10 of these steps are of 3 kinds the calibration prices alike" in out, out
    assert "at most 17.5 % from the median time of their kind" in out, out
