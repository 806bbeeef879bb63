"""Bad input to `flexorch train` / `flexorch plan` fails with a clear message and exit code 2, and what can be checked
without workers is checked before Ray starts: here Ray cannot start at all (``ray_session`` is replaced by one that
fails the test), so every error below is proven to come from the checks of ``flexorch.cli.preflight`` and the
configuration, not from a worker."""

from __future__ import annotations

import json

import pytest
import torch

import flexorch.cli.train as cli_train
from flexorch.cli.main import main
from tests.train_helpers import write_corpus


class RayStarted(Exception):
    """Raised where Ray would start: the command got past every check that needs no worker."""


@pytest.fixture(autouse=True)
def no_ray(monkeypatch):
    def refuse(*args, **kwargs):
        raise RayStarted

    monkeypatch.setattr(cli_train, "ray_session", refuse)


def _train(capsys, *args) -> tuple[int, str]:
    code = main(["train", *map(str, args)])
    return code, capsys.readouterr().err


def _one_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, f"expected a one-line error, got:\n{err}"
    assert "Traceback" not in err
    return lines[0]


@pytest.fixture
def corpus(tmp_path):
    return write_corpus(tmp_path / "corpus")


def test_an_empty_jsonl_file_is_an_empty_source(tmp_path, capsys):
    f = tmp_path / "empty.jsonl"
    f.write_text("")
    code, err = _train(capsys, "--data", f, "--run-dir", tmp_path / "run")
    assert code == 2
    line = _one_line(err)
    assert str(f) in line and ("no documents" in line.lower() or "empty" in line.lower()), line


def test_an_empty_directory_fails_before_ray(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    code, err = _train(capsys, "--data", tmp_path / "empty", "--run-dir", tmp_path / "run")
    assert code == 2
    assert str(tmp_path / "empty") in _one_line(err)


def test_a_missing_source_fails_before_ray(tmp_path, capsys):
    code, err = _train(capsys, "--data", tmp_path / "nope", "--run-dir", tmp_path / "run")
    assert code == 2 and "does not exist" in _one_line(err)


def test_a_malformed_first_jsonl_record_names_the_file_and_line(tmp_path, capsys):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"text": "a"} {"text": "b"}\n{"text": "fine"}\n')
    code, err = _train(capsys, "--data", f, "--run-dir", tmp_path / "run")
    line = _one_line(err)
    assert code == 2 and str(f) in line and "line 1" in line and "on_bad_record" in line, line


def test_resume_without_a_checkpoint_fails_before_ray(corpus, tmp_path, capsys):
    code, err = _train(capsys, "--data", corpus, "--run-dir", tmp_path / "run", "--resume")
    line = _one_line(err)
    assert code == 2 and "no checkpoint" in line and "without --resume" in line, line


def _checkpoint(run_dir, step: int, model: dict) -> None:
    from flexorch.control.checkpoint import save_checkpoint

    state = {"model": {"w": torch.ones(3) * step}, "optimizer": {}, "scheduler": {}, "rng": {}}
    save_checkpoint(run_dir, step, state, {"config": {"model": model}, "stream": {}, "corpus": {}}, keep=5)


def test_resume_skips_a_damaged_newest_checkpoint_and_names_the_file(corpus, tmp_path, capsys):
    from flexorch.config import ModelConfig

    run = tmp_path / "run"
    model = ModelConfig().to_dict()
    _checkpoint(run, 1, model)
    _checkpoint(run, 2, model)
    newest = run / "checkpoints" / "checkpoint_000002" / "model.pt"
    newest.write_bytes(newest.read_bytes()[:10])  # truncated
    with pytest.raises(RayStarted):  # the run goes on: the older checkpoint is good
        main(["train", "--data", str(corpus), "--run-dir", str(run), "--resume"])
    out = capsys.readouterr().out
    assert "checkpoint_000001" in out and "model.pt" in out and "checkpoint_000002" in out, out


def test_resume_of_a_checkpoint_of_another_model_fails_before_ray(corpus, tmp_path, capsys):
    from flexorch.config import ModelConfig

    run = tmp_path / "run"
    _checkpoint(run, 1, ModelConfig(dim=128).to_dict())
    code, err = _train(capsys, "--data", corpus, "--run-dir", run, "--resume")
    line = _one_line(err)
    assert code == 2 and "dim" in line, line


def test_a_profile_that_does_not_fit_the_model_fails_before_ray(corpus, tmp_path, capsys):
    from flexorch.solver.profiles import get_profile

    p = tmp_path / "profile.json"
    p.write_text(json.dumps({**json.loads(get_profile("gpt-7b-a100").to_json()), "hidden": 4100}))
    code, err = _train(capsys, "--data", corpus, "--run-dir", tmp_path / "run", "--profile", p)
    line = _one_line(err)
    assert code == 2 and "plan.profile" in line and "profile = 'auto'" in line, line
    code, err = _train(capsys, "--data", corpus, "--run-dir", tmp_path / "run", "--profile", tmp_path / "none.json")
    assert code == 2 and "does not exist" in _one_line(err)


@pytest.mark.parametrize(
    "args,words",
    [(["--workers", "0"], "workers must be a positive integer"), (["--steps", "-1"], "steps must be"),
     (["--batch-size", "0"], "batch_size must be"), (["--mode", "static-zigzag-2"], "mode"),
     (["--sharding", "hsdp", "--shard-size", "3"], "does not divide workers=4")],
)  # fmt: skip
def test_bad_run_settings_are_one_line_errors(corpus, tmp_path, capsys, args, words):
    code, err = _train(capsys, "--data", corpus, "--run-dir", tmp_path / "run", *args)
    assert code == 2 and words in _one_line(err)


def test_a_good_run_gets_past_every_check_to_ray(corpus, tmp_path):
    with pytest.raises(RayStarted):
        main(["train", "--data", str(corpus), "--run-dir", str(tmp_path / "run"), "--steps", "1"])


def test_a_missing_text_field_is_named(tmp_path, capsys):
    f = tmp_path / "docs.jsonl"
    f.write_text('{"body": "no text field here"}\n')
    code, err = _train(capsys, "--data", f, "--run-dir", tmp_path / "run")
    line = _one_line(err)
    assert code == 2 and "text" in line and str(f) in line, line


def test_plan_lengths_drop_zero_length_documents_with_a_message_and_name_bad_lines(tmp_path, capsys):
    f = tmp_path / "lengths.txt"
    f.write_text("100\n0\n2000\n")
    code = main(["plan", "--lengths", str(f), "--workers", "8", "--steps", "1", "--batch", "2"])
    out = capsys.readouterr()
    assert code == 0 and "1 zero-length" in (out.out + out.err), out
    f.write_text("100\n0\n-5\n")
    code = main(["plan", "--lengths", str(f), "--workers", "8", "--steps", "1"])
    assert code == 2 and "line 3" in _one_line(capsys.readouterr().err)


@pytest.mark.slow
def test_python_dash_m_flexorch_exits_with_the_commands_status(corpus, tmp_path):
    """`python -m flexorch` (what `ray job submit -- python -m flexorch ...` runs) returns the command's status: 0 on
    success, 2 on an error, so a failed run is not reported as SUCCEEDED. A real process: nothing is patched."""
    import subprocess
    import sys

    ok = subprocess.run([sys.executable, "-m", "flexorch", "profiles"], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and "gpt-7b-a100" in ok.stdout, ok.stderr
    args = ["train", "--data", str(corpus), "--run-dir", str(tmp_path / "run"), "--resume"]
    bad = subprocess.run([sys.executable, "-m", "flexorch", *args], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2, (bad.returncode, bad.stderr)
    assert "no checkpoint" in _one_line(bad.stderr)
