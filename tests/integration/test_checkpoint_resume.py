"""--resume goes on from the newest checkpoint that verifies against its manifest: a newer damaged (truncated,
altered) or partial one is skipped with a message naming the file, and ``check_resume`` says all of it before Ray
starts. The fast tests write checkpoints with ``save_checkpoint`` and small tensors; the slow one trains, truncates
the newest checkpoint's ``model.pt``, resumes and compares the losses with an uninterrupted run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from flexorch.config import ConfigError, ModelConfig
from flexorch.control.checkpoint import (
    check_resume,
    corpus_fingerprint,
    latest_checkpoint,
    load_checkpoint,
    newest_good_checkpoint,
    newest_good_directory,
    save_checkpoint,
)
from flexorch.control.run_checkpoints import RunCheckpoints

CORPUS = SimpleNamespace(num_docs=3, lengths=np.array([4, 5, 6]), total_tokens=15, keys=["a", "b", "c"])


def _write(run_dir: Path, step: int, model: dict | None = None, keep: int = 5) -> Path:
    """A small replicated checkpoint after ``step`` steps, written as the driver writes it; its directory."""
    worker_state = {
        "model": {"w": torch.full((64,), float(step)), "b": torch.zeros(3)},
        "optimizer": {"state": {}, "param_groups": []},
        "scheduler": {"last_epoch": step},
        "rng": torch.zeros(4, dtype=torch.uint8),
    }
    driver_state = {
        "stream": {"position": step},
        "skipped_batches": 0,
        "config": {"model": model if model is not None else ModelConfig().to_dict()},
        "corpus": corpus_fingerprint(CORPUS),
    }
    return Path(save_checkpoint(run_dir, step, worker_state, driver_state, keep=keep).path)


def _truncate(path: Path) -> tuple[int, int]:
    size = path.stat().st_size
    path.write_bytes(path.read_bytes()[: size // 2])
    return size // 2, size


def test_a_truncated_newest_checkpoint_is_skipped_for_the_older_good_one(tmp_path):
    _write(tmp_path, 1)
    good = _write(tmp_path, 2)
    bad = _write(tmp_path, 3)
    now, was = _truncate(bad / "model.pt")
    ckpt, skipped = newest_good_checkpoint(tmp_path)
    assert Path(ckpt.path) == good
    assert skipped == [f"skipped checkpoint_000003: model.pt is corrupted ({now} bytes, the manifest says {was} bytes)"]
    assert Path(latest_checkpoint(tmp_path).path) == bad, "latest_checkpoint still names the newest (export)"

    # RunCheckpoints.resume loads the good one and keeps the messages for the driver to publish
    run = RunCheckpoints(tmp_path, CORPUS, keep=5)
    state, dstate = run.resume()
    assert dstate["step"] == 2 and torch.equal(state["model"]["w"], torch.full((64,), 2.0))
    assert run.skipped == skipped and Path(run.own.path) == good


def test_an_altered_file_of_the_same_size_is_skipped(tmp_path):
    good = _write(tmp_path, 1)
    bad = _write(tmp_path, 2)
    data = bytearray((bad / "train_state.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (bad / "train_state.pt").write_bytes(bytes(data))
    d, skipped = newest_good_directory(tmp_path)
    assert d == good
    assert len(skipped) == 1 and "checkpoint_000002: train_state.pt is corrupted" in skipped[0]
    assert "another SHA-256" in skipped[0]


def test_partial_checkpoints_without_manifest_or_driver_state_are_skipped(tmp_path):
    good = _write(tmp_path, 1)
    no_manifest = _write(tmp_path, 2)
    (no_manifest / "manifest.json").unlink()
    no_state = tmp_path / "checkpoints" / "checkpoint_000003"
    no_state.mkdir()
    (no_state / "model.pt").write_bytes(b"half")
    d, skipped = newest_good_directory(tmp_path)
    assert d == good
    assert skipped[0].startswith("skipped checkpoint_000003: partial checkpoint, manifest.json and driver_state.json")
    assert skipped[1].startswith("skipped checkpoint_000002: partial checkpoint, manifest.json missing")
    _, dstate = RunCheckpoints(tmp_path, CORPUS, keep=5).resume()
    assert dstate["step"] == 1


def test_a_missing_file_is_skipped(tmp_path):
    good = _write(tmp_path, 1)
    (_write(tmp_path, 2) / "model.pt").unlink()
    d, skipped = newest_good_directory(tmp_path)
    assert d == good and skipped == ["skipped checkpoint_000002: model.pt is missing"]


def test_no_intact_checkpoint_is_a_config_error_listing_each(tmp_path):
    one, two = _write(tmp_path, 1), _write(tmp_path, 2)
    _truncate(one / "model.pt")
    (two / "driver_state.json").unlink()
    ckpt, skipped = newest_good_checkpoint(tmp_path)
    assert ckpt is None and len(skipped) == 2
    pattern = r"no checkpoint in .* is intact \(skipped checkpoint_000002: .*; skipped checkpoint_000001: model\.pt"
    with pytest.raises(ConfigError, match=pattern + r".*nothing was loaded.*without --resume"):
        RunCheckpoints(tmp_path, CORPUS, keep=5).resume()
    with pytest.raises(ConfigError, match=pattern):
        check_resume(tmp_path, ModelConfig().to_dict())


def test_check_resume_without_any_checkpoint(tmp_path):
    for run_dir in (tmp_path, tmp_path / "never-ran"):
        with pytest.raises(ConfigError, match=r"--resume: no checkpoint in .*checkpoints; run without --resume"):
            check_resume(run_dir, ModelConfig().to_dict())
    assert newest_good_checkpoint(tmp_path) == (None, [])


def test_check_resume_names_the_model_keys_that_differ(tmp_path):
    _write(tmp_path, 2)
    other = ModelConfig().to_dict()
    other["dim"] = other["dim"] * 2
    other["num_layers"] = other["num_layers"] + 1
    with pytest.raises(ConfigError, match=r"another model \(dim: checkpoint \d+, this run \d+, num_layers: .*\)"):
        check_resume(tmp_path, other)


def test_a_checkpoint_resumes_with_another_loss_chunk_and_one_written_before_the_key_existed(tmp_path):
    older = ModelConfig().to_dict()
    del older["loss_chunk_tokens"]  # a checkpoint of a flexorch without the key
    _write(tmp_path, 2, model=older)
    live = {**ModelConfig().to_dict(), "loss_chunk_tokens": 512}  # how the loss runs, not what the model is
    assert check_resume(tmp_path, live).startswith("--resume: from checkpoint_000002 (step 2)")


def test_check_resume_describes_the_checkpoint_and_the_skipped_ones(tmp_path):
    _write(tmp_path, 1)
    _write(tmp_path, 2)
    now, was = _truncate(_write(tmp_path, 3) / "model.pt")
    lines = check_resume(tmp_path, ModelConfig().to_dict()).splitlines()
    assert lines == [
        f"--resume: from checkpoint_000002 (step 2) in {tmp_path / 'checkpoints'}",
        f"skipped checkpoint_000003: model.pt is corrupted ({now} bytes, the manifest says {was} bytes)",
    ]
    shutil.rmtree(tmp_path / "checkpoints" / "checkpoint_000003")
    assert check_resume(tmp_path, ModelConfig().to_dict()) == (
        f"--resume: from checkpoint_000002 (step 2) in {tmp_path / 'checkpoints'}"
    )


def test_check_resume_refuses_a_checkpoint_without_a_run_config(tmp_path):
    d = _write(tmp_path, 1)
    state = json.loads((d / "driver_state.json").read_text())
    del state["config"]
    (d / "driver_state.json").write_text(json.dumps(state))
    manifest = json.loads((d / "manifest.json").read_text())  # keep it verifying: only the config is missing
    from flexorch.control.checkpoint import _sha256

    manifest["driver_state.json"] = {
        "bytes": (d / "driver_state.json").stat().st_size,
        "sha256": _sha256(d / "driver_state.json"),
    }
    (d / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ConfigError, match="holds no run config"):
        check_resume(tmp_path, ModelConfig().to_dict())
    load_checkpoint(newest_good_checkpoint(tmp_path)[0])  # still loads: the files verify


# ---------------------------------------------------------------- end to end, on Ray


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    from tests.train_helpers import training_env

    yield from training_env(tmp_path_factory, "ckpt-resume")


@pytest.mark.slow
def test_resume_skips_a_truncated_newest_checkpoint_and_trains_like_the_uninterrupted_run(env):
    from flexorch.control.driver import TrainingDriver
    from tests.train_helpers import run_driver, train_config

    root, corpus_dir, profile, corpus = env
    small = {"workers": 2, "plan": {"tokens_per_worker": 128}}  # 2 workers hold a 256-token document
    full, _ = run_driver(train_config(corpus_dir, root / "full", profile, steps=4, **small), corpus)

    cfg = train_config(corpus_dir, root / "part", profile, steps=3, checkpoint_every=1, keep_checkpoints=3, **small)
    driver = TrainingDriver(cfg, corpus=corpus)
    try:
        driver.run()  # checkpoints after steps 1, 2 and 3 (the last at the end of the run)
    finally:
        driver.shutdown()
    ckpts = sorted((root / "part" / "checkpoints").glob("checkpoint_*"))
    assert [p.name for p in ckpts] == ["checkpoint_000001", "checkpoint_000002", "checkpoint_000003"]
    _truncate(ckpts[-1] / "model.pt")
    more = cfg.replace(resume=True, steps=4)
    assert check_resume(more.run_dir, more.model.to_dict()).startswith("--resume: from checkpoint_000002 (step 2)")

    resumed = TrainingDriver(more, corpus=corpus)
    try:
        resumed.setup()
        events = resumed.events.poll(0)[0]
        skipped = [e["message"] for e in events if e["event"] == "checkpoint_skipped"]
        assert len(skipped) == 1 and skipped[0].startswith("skipped checkpoint_000003: model.pt is corrupted (")
        assert resumed.resumed_from == 2
        assert next(e for e in events if e["event"] == "setup")["resumed_from"] == 2
        tail = []
        while not resumed.finished:
            tail.append(resumed.step().record)
    finally:
        resumed.shutdown()
    assert [r["step"] for r in tail] == [2, 3]
    assert [r["doc_ids"] for r in tail] == [r["doc_ids"] for r in full[2:]]
    assert [r["loss"] for r in tail] == pytest.approx([r["loss"] for r in full[2:]], rel=1e-5)
