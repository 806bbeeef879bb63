"""Checkpoints of a training run, in Ray Train's layout: one directory per checkpoint, wrapped as a
``ray.train.Checkpoint``.

``RUN_DIR/checkpoints/checkpoint_<step>/`` holds

* ``model.pt``: the model's state dict (tensors only);
* ``train_state.pt``: optimizer, LR schedule and torch RNG state (tensors and plain values);
* ``driver_state.json``: the step count, the data stream position (the exact next document), the corpus
  fingerprint and the run config.

A checkpoint is written to a hidden temporary directory and renamed into place, so a crash never leaves a
half-written one that looks complete. Everything is loaded with ``torch.load(weights_only=True)``. Ray Train is
imported when a checkpoint is first written or found (importing it takes a second or more; a driver stepped in
tests without Ray and without checkpoints never pays it).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from flexorch.config import ConfigError

if TYPE_CHECKING:
    from ray.train import Checkpoint

__all__ = [
    "CheckpointError",
    "RunCheckpoints",
    "corpus_fingerprint",
    "latest_checkpoint",
    "load_checkpoint",
    "save_checkpoint",
]

_PREFIX = "checkpoint_"


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete or from another run."""


def _root(run_dir: Path | str) -> Path:
    return Path(run_dir) / "checkpoints"


def save_checkpoint(
    run_dir: Path | str, step: int, worker_state: dict, driver_state: dict, keep: int = 2
) -> Checkpoint:
    """Write the checkpoint taken after ``step`` steps; keep the newest ``keep`` checkpoints."""
    root = _root(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{_PREFIX}{step:06d}"
    tmp = root / f".tmp-{_PREFIX}{step:06d}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    torch.save(worker_state["model"], tmp / "model.pt")
    torch.save(
        {"optimizer": worker_state["optimizer"], "scheduler": worker_state["scheduler"], "rng": worker_state["rng"]},
        tmp / "train_state.pt",
    )
    (tmp / "driver_state.json").write_text(json.dumps({**driver_state, "step": step}, indent=1, sort_keys=True))
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    for old in sorted(p for p in root.iterdir() if p.name.startswith(_PREFIX))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    from ray.train import Checkpoint

    return Checkpoint.from_directory(str(final))


def latest_checkpoint(run_dir: Path | str) -> Checkpoint | None:
    """The newest complete checkpoint of a run directory, or None."""
    root = _root(run_dir)
    if not root.is_dir():
        return None
    done = sorted(p for p in root.iterdir() if p.name.startswith(_PREFIX) and (p / "driver_state.json").is_file())
    if not done:
        return None
    from ray.train import Checkpoint

    return Checkpoint.from_directory(str(done[-1]))


def load_checkpoint(checkpoint: Checkpoint) -> tuple[dict, dict]:
    """(worker_state, driver_state) of a checkpoint; tensors are loaded with ``weights_only=True``."""
    with checkpoint.as_directory() as d:
        d = Path(d)
        missing = [f for f in ("model.pt", "train_state.pt", "driver_state.json") if not (d / f).is_file()]
        if missing:
            raise CheckpointError(f"checkpoint {d} is incomplete: missing {missing}")
        model = torch.load(d / "model.pt", weights_only=True, map_location="cpu")
        train = torch.load(d / "train_state.pt", weights_only=True, map_location="cpu")
        driver = json.loads((d / "driver_state.json").read_text())
    return {"model": model, **train}, driver


def corpus_fingerprint(corpus) -> dict:
    """What a checkpoint records of the corpus it was taken on (a resume on another corpus is refused)."""
    c = corpus
    return {"num_docs": c.num_docs, "tokens": int(c.lengths.sum()), "first": c.keys[0], "last": c.keys[-1]}


class RunCheckpoints:
    """The checkpoints one run writes and goes back to: it resumes from, or rolls back to, only its own newest
    checkpoint (never an older run's in the same directory)."""

    def __init__(self, run_dir: Path | str, corpus, keep: int):
        self.run_dir, self.corpus, self.keep = Path(run_dir), corpus, keep
        self.own: Checkpoint | None = None

    def resume(self) -> tuple[dict, dict]:
        """(worker state, driver state) of the run directory's newest checkpoint, taken on this corpus (else a
        :class:`~flexorch.config.ConfigError` saying why)."""
        ckpt = latest_checkpoint(self.run_dir)
        if ckpt is None:
            raise ConfigError(f"--resume: no checkpoint in {_root(self.run_dir)}; run without --resume")
        state, dstate = load_checkpoint(ckpt)
        if dstate["corpus"] != corpus_fingerprint(self.corpus):
            raise ConfigError(
                f"--resume: the checkpoint was taken on another corpus ({dstate['corpus']}); this run reads "
                f"{corpus_fingerprint(self.corpus)}"
            )
        self.own = ckpt
        return state, dstate

    def save(self, step: int, worker_state: dict, driver_state: dict) -> str:
        """Write this run's checkpoint after ``step`` steps (``driver_state`` plus the corpus fingerprint)."""
        driver_state = {**driver_state, "corpus": corpus_fingerprint(self.corpus)}
        self.own = save_checkpoint(self.run_dir, step, worker_state, driver_state, keep=self.keep)
        return self.own.path

    def hint(self) -> str:
        """Where the last checkpoint is and how to go on from it (for errors that stop the run)."""
        ckpt = latest_checkpoint(self.run_dir)
        if ckpt is None:
            return "No checkpoint was written yet (set checkpoint_every to keep one)"
        return f"The last checkpoint, {ckpt.path}, is intact: run again with --resume when capacity is back"
