"""What `flexorch train` says when its driver is lost, and what it resumes from (no Ray: the seams' pure parts; the
real loss is tests/integration/test_driver_crash.py)."""

from __future__ import annotations

from flexorch.cli.driver_handle import loss_reason
from flexorch.cli.train import _RunView
from flexorch.cli.train_console import format_step

RAY_TEXT = (
    "The actor died unexpectedly before finishing this task. class_name: TrainingDriver actor_id: 8d2f pid: 14660 "
    "name: N/A namespace: 1b Worker ID: cd3d Node ID: 5e87 Worker IP address: 192.0.2.2 Worker port: 4112 The "
    "actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR Worker exit detail: Worker "
    "unexpectedly exits with a connection error code 2. End of file. Some common causes include: (1) the process "
    "was killed by the OOM killer due to high memory usage"
)


def test_the_loss_reason_is_rays_cause_without_its_boilerplate():
    assert loss_reason(Exception(RAY_TEXT)) == (
        "The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR Worker exit detail: "
        "Worker unexpectedly exits with a connection error code 2. End of file."
    )
    assert loss_reason(Exception("short\n  message")) == "short message"
    assert len(loss_reason(Exception("x" * 1000))) == 240


def test_the_run_view_resumes_from_the_newest_checkpoint_it_saw():
    view = _RunView()
    assert view.checkpoint_words() == "No checkpoint was written yet: the run starts again from step 0"
    for ev in (
        {"event": "setup", "resumed_from": None},
        {"event": "step", "step": 0},
        {"event": "step", "step": 1},
        {"event": "checkpoint", "step": 2, "path": "/r/checkpoints/checkpoint_000002"},
        {"event": "step", "step": 2},
    ):
        view.see(ev)
    assert (view.completed, view.checkpoint_step) == (3, 2)
    assert view.checkpoint_words() == "The checkpoint of step 2 (/r/checkpoints/checkpoint_000002)"
    again = _RunView(earlier=view)  # the new driver's view starts from what was seen
    again.see({"event": "setup", "resumed_from": 2})
    assert (again.completed, again.checkpoint_step) == (2, 2)


def test_the_step_line_shows_a_driver_restart_with_its_phases():
    ev = {
        "step": 4, "shape": "<2x2>", "solve_s": 0.1, "loss": 5.0, "tokens_per_s": 1000.0, "predicted_ms": 10.0,
        "compute_ms": 10.0, "measured_ms": 12.0, "eta_s": 3.0,
        "recoveries": [{
            "what": "driver lost", "driver_restart": 1, "detect_ms": 200.0, "recovery_ms": 7680.0, "rerun_ms": 1010.0,
            "total_ms": 8890.0, "redone_steps": 1,
        }],
    }  # fmt: skip
    line = format_step(ev, 10)
    assert line.endswith(
        "[driver restarted, recovered in 8.9 s: detect 0.2 s, new driver 7.7 s, re-run 1.0 s (1 step trained again)]"
    )
    ev["recoveries"][0]["corpus_ms"] = 9.0  # a new driver since the corpus store: how long it spent on the corpus
    assert format_step(ev, 10).endswith("new driver 7.7 s (corpus 0.0 s), re-run 1.0 s (1 step trained again)]")
