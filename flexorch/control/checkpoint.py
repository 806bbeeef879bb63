"""Checkpoints of a training run, in Ray Train's layout: one directory per checkpoint, wrapped as a
``ray.train.Checkpoint``.

``RUN_DIR/checkpoints/checkpoint_<step>/`` holds

* ``model.pt``: the model's state dict (tensors only);
* ``train_state.pt``: optimizer, LR schedule and torch RNG state (tensors and plain values);
* ``driver_state.json``: the step count, the data stream position (the exact next document), the corpus
  fingerprint and the run config;
* ``manifest.json``: the size and SHA-256 of every other file, checked before anything is loaded (a truncated or
  corrupted file is an error naming it, and nothing is loaded).

``--resume`` goes on from the newest checkpoint that verifies against its manifest
(:func:`newest_good_checkpoint`): a newer one that is damaged (a file truncated or altered) or partial (no
``manifest.json`` or no ``driver_state.json``) is skipped with a message naming the file and why, so a damaged
checkpoint never ends a run that has a good one. :func:`check_resume` runs the same checks before Ray starts.

With sharded model state (``[sharding] mode = "fsdp"/"hsdp"``) ``model.pt`` and ``train_state.pt`` are replaced by
``torch.distributed.checkpoint`` files that the workers write themselves, one per worker
(``flexorch.workers.sharded_checkpoint``), loadable on any number of workers; ``flexorch checkpoint export``
consolidates them into one ``model.pt``.

A checkpoint is written to a hidden temporary directory and renamed into place, so a crash never leaves a
half-written one that looks complete. Everything is loaded with ``torch.load(weights_only=True)``. Ray Train is
imported when a checkpoint is first written or found (importing it takes a second or more; a driver stepped in
tests without Ray and without checkpoints never pays it).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from flexorch.config import ConfigError
from flexorch.config.model import RUN_KEYS

if TYPE_CHECKING:
    from ray.train import Checkpoint

__all__ = [
    "CheckpointError",
    "RunCheckpoints",
    "check_resume",
    "checkpoint_config",
    "consolidated_state",
    "corpus_fingerprint",
    "export_model",
    "is_sharded",
    "latest_checkpoint",
    "load_checkpoint",
    "newest_good_checkpoint",
    "newest_good_directory",
    "save_checkpoint",
    "verify_files",
]

_PREFIX = "checkpoint_"
_MANIFEST = "manifest.json"


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete or from another run."""


def _root(run_dir: Path | str) -> Path:
    return Path(run_dir) / "checkpoints"


def save_checkpoint(
    run_dir: Path | str,
    step: int,
    worker_state: dict | None,
    driver_state: dict,
    keep: int = 2,
    write_shards: Callable[[str], None] | None = None,
) -> Checkpoint:
    """Write the checkpoint taken after ``step`` steps; keep the newest ``keep`` checkpoints. ``worker_state``:
    the whole model state (replicas); or ``write_shards(directory)``: the workers write their shards there."""
    root = _root(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{_PREFIX}{step:06d}"
    tmp = root / f".tmp-{_PREFIX}{step:06d}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    if write_shards is not None:
        write_shards(str(tmp))
    else:
        torch.save(worker_state["model"], tmp / "model.pt")
        torch.save(
            {
                "optimizer": worker_state["optimizer"],
                "scheduler": worker_state["scheduler"],
                "rng": worker_state["rng"],
            },
            tmp / "train_state.pt",
        )
    (tmp / "driver_state.json").write_text(json.dumps({**driver_state, "step": step}, indent=1, sort_keys=True))
    files = sorted(f for f in tmp.iterdir() if f.is_file())
    manifest = {f.name: {"bytes": f.stat().st_size, "sha256": _sha256(f)} for f in files}
    (tmp / _MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    for old in sorted(p for p in root.iterdir() if p.name.startswith(_PREFIX))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    from ray.train import Checkpoint

    return Checkpoint.from_directory(str(final))


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _file_problem(directory: Path) -> tuple[str, str] | None:
    """The first file of a checkpoint that does not match its manifest: (file name, why), or None when every file
    matches (or there is no manifest: checkpoints written before manifests existed are not checked)."""
    path = directory / _MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        return _MANIFEST, f"is unreadable ({e})"
    if not isinstance(manifest, dict) or not all(
        isinstance(w, dict) and {"bytes", "sha256"} <= w.keys() for w in manifest.values()
    ):
        return _MANIFEST, "is unreadable (not a map of file name -> bytes and sha256)"
    for name, want in manifest.items():
        f = directory / name
        if not f.is_file():
            return name, "is missing"
        size = f.stat().st_size
        if size != want["bytes"]:
            return name, f"is corrupted ({size} bytes, the manifest says {want['bytes']} bytes)"
        if _sha256(f) != want["sha256"]:
            return name, f"is corrupted ({size} bytes as the manifest says, but another SHA-256)"
    return None


def verify_files(directory: Path) -> None:
    """Check every file of a checkpoint against its manifest; raise :class:`CheckpointError` naming the first
    missing, truncated or altered one (checkpoints written before manifests existed are not checked)."""
    problem = _file_problem(directory)
    if problem is None:
        return
    name, why = problem
    if why == "is missing":
        raise CheckpointError(f"checkpoint {directory} is incomplete: {name} is missing")
    raise CheckpointError(
        f"checkpoint file {directory / name} {why}; nothing was loaded. Resume from an older checkpoint (delete "
        "this one) or start the run again"
    )


def _checkpoint_dirs(run_dir: Path | str) -> list[Path]:
    """Every ``checkpoint_<step>`` directory of a run, newest (highest step) first."""
    root = _root(run_dir)
    if not root.is_dir():
        return []

    def step(p: Path) -> tuple[int, str]:
        tail = p.name[len(_PREFIX) :]
        return (int(tail) if tail.isdigit() else -1, p.name)

    return sorted((p for p in root.iterdir() if p.name.startswith(_PREFIX) and p.is_dir()), key=step, reverse=True)


def _skip_reason(directory: Path) -> str | None:
    """Why a checkpoint directory cannot be resumed from (partial or damaged), or None when it verifies."""
    missing = [f for f in (_MANIFEST, "driver_state.json") if not (directory / f).is_file()]
    if missing:
        return f"partial checkpoint, {' and '.join(missing)} missing (written by a crash before it was complete)"
    problem = _file_problem(directory)
    if problem is not None:
        return f"{problem[0]} {problem[1]}"
    return None


def newest_good_directory(run_dir: Path | str) -> tuple[Path | None, list[str]]:
    """Like :func:`newest_good_checkpoint`, as a plain directory path (needs neither Ray nor torch)."""
    skipped = []
    for d in _checkpoint_dirs(run_dir):
        why = _skip_reason(d)
        if why is None:
            return d, skipped
        skipped.append(f"skipped {d.name}: {why}")
    return None, skipped


def newest_good_checkpoint(run_dir: Path | str) -> tuple[Checkpoint | None, list[str]]:
    """The newest checkpoint of a run directory whose files all verify against its manifest (None when none
    does), and one message per newer checkpoint skipped, naming the file and why, e.g. ``"skipped
    checkpoint_000004: model.pt is corrupted (1234 bytes, the manifest says 5678 bytes)"``. A directory without
    ``manifest.json`` or ``driver_state.json`` is partial and skipped, never loaded."""
    d, skipped = newest_good_directory(run_dir)
    if d is None:
        return None, skipped
    from ray.train import Checkpoint

    return Checkpoint.from_directory(str(d)), skipped


def _no_good_checkpoint(run_dir: Path | str, skipped: list[str]) -> ConfigError:
    root = _root(run_dir)
    if not skipped:
        return ConfigError(f"--resume: no checkpoint in {root}; run without --resume")
    return ConfigError(
        f"--resume: no checkpoint in {root} is intact ({'; '.join(skipped)}); nothing was loaded. Run without "
        "--resume to start again (or put back an intact checkpoint)"
    )


_MISSING = object()


def _plain(value):
    """A config value as JSON has it (tuples become lists), so saved and live configs compare equal."""
    return json.loads(json.dumps(value, default=list))


def check_resume(run_dir: Path | str, model_config: dict) -> str:
    """Preflight of ``--resume``, before Ray starts and without loading any tensor: the checkpoint the run will
    resume from (the newest that verifies against its manifest, by size and SHA-256) must exist and describe the
    same model as ``model_config`` (the run's ``ModelConfig.to_dict()``).

    Returns its description, ``"--resume: from checkpoint_000002 (step 2) in RUN/checkpoints"``, then one line
    per newer checkpoint skipped and why. Raises :class:`~flexorch.config.ConfigError` saying what to do when
    there is no checkpoint, when none verifies (listing each and why), or when the checkpoint's model differs
    (naming the differing keys)."""
    d, skipped = newest_good_directory(run_dir)
    if d is None:
        raise _no_good_checkpoint(run_dir, skipped)
    try:
        state = json.loads((d / "driver_state.json").read_text())
        saved = state["config"]["model"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(
            f"--resume: {d / 'driver_state.json'} holds no run config ({type(e).__name__}: {e}); run without "
            "--resume, or resume a run written by flexorch"
        ) from None
    saved, live = _plain(saved), _plain(dict(model_config))
    keys = (set(saved) | set(live)) - RUN_KEYS  # how the model runs (the loss's chunks) is free to change
    differ = sorted(k for k in keys if saved.get(k, _MISSING) != live.get(k, _MISSING))
    if differ:
        what = ", ".join(
            f"{k}: checkpoint {saved.get(k, '(absent)')!r}, this run {live.get(k, '(absent)')!r}" for k in differ
        )
        raise ConfigError(
            f"--resume: the checkpoint {d} was written for another model ({what}); set [model] as the checkpoint "
            "has it, or run without --resume (or with another run_dir) to train this model from scratch"
        )
    line = f"--resume: from {d.name} (step {state.get('step', '?')}) in {d.parent}"
    return "\n".join([line, *skipped])


def is_sharded(directory: Path | str) -> bool:
    """Whether a checkpoint directory holds sharded (``torch.distributed.checkpoint``) model state."""
    return (Path(directory) / ".metadata").is_file()


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
    """(worker_state, driver_state) of a checkpoint, every file checked against its manifest first; tensors are
    loaded with ``weights_only=True``. Sharded: worker_state is ``{"sharded_dir": path}``, which the workers read
    themselves (each its own rows)."""
    with checkpoint.as_directory() as d:
        d = Path(d)
        verify_files(d)
        if is_sharded(d):
            if not (d / "driver_state.json").is_file():
                raise CheckpointError(f"checkpoint {d} is incomplete: missing driver_state.json")
            return {"sharded_dir": str(d)}, json.loads((d / "driver_state.json").read_text())
        missing = [f for f in ("model.pt", "train_state.pt", "driver_state.json") if not (d / f).is_file()]
        if missing:
            raise CheckpointError(f"checkpoint {d} is incomplete: missing {missing}")
        model = torch.load(d / "model.pt", weights_only=True, map_location="cpu")
        train = torch.load(d / "train_state.pt", weights_only=True, map_location="cpu")
        driver = json.loads((d / "driver_state.json").read_text())
    return {"model": model, **train}, driver


def consolidated_state(directory: Path | str) -> dict:
    """The whole model's state dict (parameter name -> CPU tensor) of a checkpoint, gathered from a sharded
    checkpoint's per-worker files or read from a replicated one's ``model.pt``; every file is checked against the
    manifest first. Runs in one process, without a world."""
    d = Path(directory)
    verify_files(d)
    if is_sharded(d):
        import tempfile

        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        with tempfile.TemporaryDirectory() as tmp:
            dcp_to_torch_save(d, Path(tmp) / "all.pt")
            return torch.load(Path(tmp) / "all.pt", weights_only=True, map_location="cpu")["model"]
    if (d / "model.pt").is_file():
        return torch.load(d / "model.pt", weights_only=True, map_location="cpu")
    raise CheckpointError(f"{d} is not a flexorch checkpoint (no model.pt and no .metadata)")


def checkpoint_config(directory: Path | str) -> dict:
    """The run configuration a checkpoint was written with (``TrainConfig.to_dict()``)."""
    f = Path(directory) / "driver_state.json"
    if not f.is_file():
        raise CheckpointError(f"{directory} is not a complete flexorch checkpoint: missing driver_state.json")
    return json.loads(f.read_text())["config"]


def export_model(directory: Path | str, out: Path | str) -> dict:
    """Consolidate a checkpoint's model into one ``torch.save`` file of the whole state dict (parameter name ->
    tensor); returns ``{"parameters", "tensors", "bytes"}``."""
    model = consolidated_state(directory)
    torch.save(model, out)
    return {
        "parameters": int(sum(t.numel() for t in model.values())),
        "tensors": len(model),
        "bytes": Path(out).stat().st_size,
    }


def corpus_fingerprint(corpus) -> dict:
    """What a checkpoint records of the corpus it was taken on (a resume on another corpus is refused)."""
    c = corpus
    return {"num_docs": c.num_docs, "tokens": c.total_tokens, "first": c.keys[0], "last": c.keys[-1]}


class RunCheckpoints:
    """The checkpoints one run writes and goes back to: it resumes from, or rolls back to, only its own newest
    checkpoint (never an older run's in the same directory)."""

    def __init__(self, run_dir: Path | str, corpus, keep: int, sharded: bool = False):
        self.run_dir, self.corpus, self.keep, self.sharded = Path(run_dir), corpus, keep, sharded
        self.own: Checkpoint | None = None
        self.skipped: list[str] = []  # newer checkpoints the resume skipped, one message each (file and why)

    def resume(self) -> tuple[dict, dict]:
        """(worker state, driver state) of the run directory's newest checkpoint that verifies against its
        manifest, taken on this corpus (else a :class:`~flexorch.config.ConfigError` saying why). Newer damaged or
        partial checkpoints are skipped; :attr:`skipped` says which and why."""
        ckpt, self.skipped = newest_good_checkpoint(self.run_dir)
        if ckpt is None:
            raise _no_good_checkpoint(self.run_dir, self.skipped)
        state, dstate = load_checkpoint(ckpt)
        if dstate["corpus"] != corpus_fingerprint(self.corpus):
            raise ConfigError(
                f"--resume: the checkpoint was taken on another corpus ({dstate['corpus']}); this run reads "
                f"{corpus_fingerprint(self.corpus)}"
            )
        if ("sharded_dir" in state) != self.sharded:
            was = "sharded (fsdp/hsdp)" if "sharded_dir" in state else "whole replicas (replicate)"
            raise ConfigError(
                f"--resume: the checkpoint {ckpt.path} holds {was} model state and this run's sharding.mode "
                f"{'is sharded' if self.sharded else 'is replicate'}; resume with the sharding it was written with "
                "(any world size works within the sharded modes)"
            )
        self.own = ckpt
        return state, dstate

    def save(self, step: int, worker_state: dict | None, driver_state: dict, write_shards=None) -> str:
        """Write this run's checkpoint after ``step`` steps (``driver_state`` plus the corpus fingerprint); the
        whole ``worker_state``, or shards the workers write with ``write_shards(directory)``."""
        driver_state = {**driver_state, "corpus": corpus_fingerprint(self.corpus)}
        self.own = save_checkpoint(
            self.run_dir, step, worker_state, driver_state, keep=self.keep, write_shards=write_shards
        )
        return self.own.path

    def hint(self) -> str:
        """Where the last checkpoint is and how to go on from it (for errors that stop the run)."""
        ckpt = latest_checkpoint(self.run_dir)
        if ckpt is None:
            return "No checkpoint was written yet (set checkpoint_every to keep one)"
        return f"The last checkpoint, {ckpt.path}, is intact: run again with --resume when capacity is back"
