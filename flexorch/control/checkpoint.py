"""Checkpoints of a training run: one directory per checkpoint in the run's checkpoint store.

The store (``flexorch.control.checkpoint_store``) is ``[checkpoint] storage``: ``RUN_DIR/checkpoints`` by default, a
shared path, or an object-store prefix (``s3://bucket/prefix``, ``gs://...``). ``checkpoint_<step>/`` holds

* ``model.pt``: the model's state dict (tensors only);
* ``train_state.pt``: optimizer, LR schedule and torch RNG state (tensors and plain values);
* ``driver_state.json``: the step count, the data stream position (the exact next document), the corpus
  fingerprint and the run config;
* ``manifest.json``: every other file's size, and its SHA-256 where the checkpoint is local or the driver wrote the
  file, checked before anything is loaded (a truncated or corrupted file is an error naming it, and nothing is
  loaded). On an object store a worker's shard is checked by its size: the store checks content itself, and hashing
  it would download every shard on each save.

The driver writes ``manifest.json`` last, so a checkpoint is complete only once it is there and verifies; a partial
one (a crash, a killed upload) is never loaded, and is deleted at the next save. ``--resume`` goes on from the
newest checkpoint that verifies (:func:`newest_good_checkpoint`): a newer one that is damaged or partial is skipped
with a message naming the file and why, so a damaged checkpoint never ends a run that has a good one.
:func:`check_resume` runs the same checks before Ray starts.

With sharded model state (``[sharding] mode = "fsdp"/"hsdp"``) ``model.pt`` and ``train_state.pt`` are replaced by
``torch.distributed.checkpoint`` files that the workers write themselves straight into the store, one per worker
(``flexorch.workers.sharded_checkpoint``), loadable on any number of workers; ``flexorch export`` consolidates them
into one ``model.pt`` (``flexorch.control.checkpoint_export``; a remote checkpoint is downloaded first).

Retention (:func:`prune`): the newest ``keep`` complete checkpoints, plus every one whose step is a multiple of
``keep_every``; an older checkpoint is deleted only after a newer one was written and verified. Everything is loaded
with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Callable
from pathlib import Path

import torch

from flexorch.config import ConfigError
from flexorch.config.model import RUN_KEYS
from flexorch.control.checkpoint_store import PREFIX, CheckpointStore, StoredCheckpoint

__all__ = [
    "as_store",
    "CheckpointError",
    "check_resume",
    "corpus_fingerprint",
    "is_sharded",
    "latest_checkpoint",
    "load_checkpoint",
    "newest_good_checkpoint",
    "newest_good_directory",
    "no_good_checkpoint",
    "begin_checkpoint",
    "complete_checkpoint",
    "prune",
    "save_checkpoint",
    "write_model_state",
    "verify_files",
]

_MANIFEST = "manifest.json"
_DRIVER = "driver_state.json"
_DCP_METADATA = ".metadata"


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete or from another run."""


def as_store(where: CheckpointStore | Path | str) -> CheckpointStore:
    """A checkpoint store; a plain path is a run directory, whose checkpoints are in ``RUN_DIR/checkpoints``."""
    return where if isinstance(where, CheckpointStore) else CheckpointStore.of_run(where)


def _digest(chunks) -> str:
    h = hashlib.sha256()
    for chunk in chunks:
        h.update(chunk)
    return h.hexdigest()


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return _digest(iter(lambda: f.read(1 << 20), b""))


def _stored_sha256(ckpt: StoredCheckpoint, file: str) -> str:
    with ckpt.store.open_read(ckpt.name, file) as f:
        return _digest(iter(lambda: f.read(1 << 20), b""))


def save_checkpoint(
    where: CheckpointStore | Path | str,
    step: int,
    worker_state: dict | None,
    driver_state: dict,
    keep: int = 2,
    write_shards: Callable[[str], None] | None = None,
    keep_every: int = 0,
) -> StoredCheckpoint:
    """Write the checkpoint taken after ``step`` steps, then apply retention (:func:`prune`). ``worker_state``: the
    whole model state (replicas); or ``write_shards(location)``: the workers write their shards there (a local
    directory or an object-store URI). ``where``: a store, or a run directory (its ``checkpoints/``)."""
    ckpt = begin_checkpoint(as_store(where), step)
    hashes = {}
    if write_shards is not None:
        write_shards(ckpt.path)
    else:
        hashes = write_model_state(ckpt, worker_state)
    return complete_checkpoint(ckpt, driver_state, hashes, keep, keep_every)


def begin_checkpoint(store: CheckpointStore, step: int) -> StoredCheckpoint:
    """The empty directory of the checkpoint after ``step`` steps (a partial save of that step is deleted first)."""
    ckpt = store.checkpoint(f"{PREFIX}{step:06d}")
    store.prepare(ckpt.name)
    return ckpt


def write_model_state(ckpt: StoredCheckpoint, worker_state: dict) -> dict[str, str]:
    """Write a replicated run's ``model.pt`` and ``train_state.pt``; returns their SHA-256 by file name (the files a
    worker that holds the whole model writes itself, ``workers.checkpoint_writes.write_state_files``)."""
    from flexorch.workers.checkpoint_writes import write_state_files

    return write_state_files(ckpt.path, worker_state)


def complete_checkpoint(
    ckpt: StoredCheckpoint, driver_state: dict, hashes: dict[str, str], keep: int, keep_every: int = 0
) -> StoredCheckpoint:
    """Once the model state is written: the driver's state, then the manifest (the checkpoint is complete from
    here), a check that it verifies, then retention. ``hashes``: SHA-256 of files already hashed as written."""
    store, hashes = ckpt.store, dict(hashes)
    data = json.dumps({**driver_state, "step": ckpt.step}, indent=1, sort_keys=True).encode()
    store.write(ckpt.name, _DRIVER, data)
    hashes[_DRIVER] = hashlib.sha256(data).hexdigest()
    manifest = {}
    for file, size in sorted(store.files(ckpt.name).items()):
        if file == _MANIFEST:
            continue
        entry = {"bytes": size}
        if file in hashes:
            entry["sha256"] = hashes[file]
        elif not store.remote:  # a worker's shard on a local or shared disk: hashed here, as it always was
            entry["sha256"] = _stored_sha256(ckpt, file)
        manifest[file] = entry
    store.write(ckpt.name, _MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())  # complete from here
    problem = _file_problem(ckpt, contents=False)  # the hashes were taken of the bytes written: sizes suffice here
    if problem is not None:
        raise CheckpointError(f"checkpoint {ckpt.path} did not verify after it was written: {problem[0]} {problem[1]}")
    prune(store, keep, keep_every)
    return ckpt


def _manifest(ckpt: StoredCheckpoint) -> dict | None:
    """The manifest of a checkpoint (None when there is none); raises ValueError when it is unreadable."""
    if not ckpt.store.has(ckpt.name, _MANIFEST):
        return None
    manifest = json.loads(ckpt.store.read(ckpt.name, _MANIFEST))
    if not isinstance(manifest, dict) or not all(
        isinstance(w, dict) and "bytes" in w and set(w) <= {"bytes", "sha256"} for w in manifest.values()
    ):
        raise ValueError("not a map of file name -> bytes and sha256")
    return manifest


def _file_problem(ckpt: StoredCheckpoint, contents: bool = True) -> tuple[str, str] | None:
    """The first file of a checkpoint that does not match its manifest: (file name, why), or None when every file
    matches (or there is no manifest: checkpoints written before manifests existed are not checked). ``contents``
    false: sizes only, no SHA-256 (a save checking what it just wrote)."""
    try:
        manifest = _manifest(ckpt)
    except ValueError as e:
        return _MANIFEST, f"is unreadable ({e})"
    if manifest is None:
        return None
    sizes = ckpt.store.files(ckpt.name)
    for name, want in manifest.items():
        if name not in sizes:
            return name, "is missing"
        size = sizes[name]
        if size != want["bytes"]:
            return name, f"is corrupted ({size} bytes, the manifest says {want['bytes']} bytes)"
        if contents and "sha256" in want and _stored_sha256(ckpt, name) != want["sha256"]:
            return name, f"is corrupted ({size} bytes as the manifest says, but another SHA-256)"
    return None


def _checkpoint(ckpt: StoredCheckpoint | Path | str) -> StoredCheckpoint:
    """A checkpoint given as a stored one or as a local directory path."""
    if isinstance(ckpt, StoredCheckpoint):
        return ckpt
    d = Path(ckpt)
    return CheckpointStore(d.parent).checkpoint(d.name)


def verify_files(ckpt: StoredCheckpoint | Path | str) -> None:
    """Check every file of a checkpoint against its manifest; raise :class:`CheckpointError` naming the first
    missing, truncated or altered one (checkpoints written before manifests existed are not checked)."""
    ckpt = _checkpoint(ckpt)
    problem = _file_problem(ckpt)
    if problem is None:
        return
    name, why = problem
    if why == "is missing":
        raise CheckpointError(f"checkpoint {ckpt.path} is incomplete: {name} is missing")
    raise CheckpointError(
        f"checkpoint file {ckpt.store.location(ckpt.name, name)} {why}; nothing was loaded. Resume from an older "
        "checkpoint (delete this one) or start the run again"
    )


def _skip_reason(ckpt: StoredCheckpoint) -> str | None:
    """Why a checkpoint cannot be resumed from (partial or damaged), or None when it verifies."""
    missing = [f for f in (_MANIFEST, _DRIVER) if not ckpt.store.has(ckpt.name, f)]
    if missing:
        return f"partial checkpoint, {' and '.join(missing)} missing (written by a crash before it was complete)"
    problem = _file_problem(ckpt)
    if problem is not None:
        return f"{problem[0]} {problem[1]}"
    return None


def newest_good_checkpoint(where: CheckpointStore | Path | str) -> tuple[StoredCheckpoint | None, list[str]]:
    """The newest checkpoint of a store (or a run directory) whose files all verify against its manifest (None when
    none does), and one message per newer checkpoint skipped, naming the file and why, e.g. ``"skipped
    checkpoint_000004: model.pt is corrupted (1234 bytes, the manifest says 5678 bytes)"``. A directory without
    ``manifest.json`` or ``driver_state.json`` is partial and skipped, never loaded."""
    skipped = []
    for ckpt in as_store(where).checkpoints():
        why = _skip_reason(ckpt)
        if why is None:
            return ckpt, skipped
        skipped.append(f"skipped {ckpt.name}: {why}")
    return None, skipped


def newest_good_directory(where: CheckpointStore | Path | str) -> tuple[Path | str | None, list[str]]:
    """Like :func:`newest_good_checkpoint`, as a location: a local ``Path``, or a URI on an object store."""
    ckpt, skipped = newest_good_checkpoint(where)
    if ckpt is None:
        return None, skipped
    return (ckpt.path if ckpt.store.remote else Path(ckpt.path)), skipped


def prune(store: CheckpointStore, keep: int, keep_every: int = 0, writing: str | None = None) -> list[str]:
    """Retention: keep the newest ``keep`` complete checkpoints and every one whose step is a multiple of
    ``keep_every`` (0: none); delete the other complete ones, and every partial one (no manifest) but ``writing``
    (a save in flight). Called after a save verified, so a checkpoint is deleted only when a newer one is complete.
    Returns the names deleted."""
    complete, gone = [], []
    for ckpt in store.checkpoints():  # newest first
        if ckpt.name == writing:
            continue
        if store.has(ckpt.name, _MANIFEST):
            complete.append(ckpt)
        else:
            gone.append(ckpt)
    for i, ckpt in enumerate(complete):
        kept = i < keep or (keep_every > 0 and ckpt.step > 0 and ckpt.step % keep_every == 0)
        if not kept:
            gone.append(ckpt)
    for ckpt in gone:
        store.delete(ckpt.name)
    return sorted(c.name for c in gone)


def no_good_checkpoint(where: CheckpointStore | Path | str, skipped: list[str]) -> ConfigError:
    root = as_store(where).uri
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


def check_resume(where: CheckpointStore | Path | str, model_config: dict) -> str:
    """Preflight of ``--resume``, before Ray starts and without loading any tensor: the checkpoint the run will
    resume from (the newest that verifies against its manifest) must exist and describe the same model as
    ``model_config`` (the run's ``ModelConfig.to_dict()``). ``where``: the run's store, or its run directory.

    Returns its description, ``"--resume: from checkpoint_000002 (step 2) in RUN/checkpoints"``, then one line
    per newer checkpoint skipped and why. Raises :class:`~flexorch.config.ConfigError` saying what to do when
    there is no checkpoint, when none verifies (listing each and why), or when the checkpoint's model differs
    (naming the differing keys)."""
    ckpt, skipped = newest_good_checkpoint(where)
    if ckpt is None:
        raise no_good_checkpoint(where, skipped)
    try:
        state = json.loads(ckpt.store.read(ckpt.name, _DRIVER))
        saved = state["config"]["model"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(
            f"--resume: {ckpt.store.location(ckpt.name, _DRIVER)} holds no run config ({type(e).__name__}: {e}); run "
            "without --resume, or resume a run written by flexorch"
        ) from None
    saved, live = _plain(saved), _plain(dict(model_config))
    keys = (set(saved) | set(live)) - RUN_KEYS  # how the model runs (the loss's chunks) is free to change
    differ = sorted(k for k in keys if saved.get(k, _MISSING) != live.get(k, _MISSING))
    if differ:
        what = ", ".join(
            f"{k}: checkpoint {saved.get(k, '(absent)')!r}, this run {live.get(k, '(absent)')!r}" for k in differ
        )
        raise ConfigError(
            f"--resume: the checkpoint {ckpt.path} was written for another model ({what}); set [model] as the "
            "checkpoint has it, or run without --resume (or with another run_dir) to train this model from scratch"
        )
    line = f"--resume: from {ckpt.name} (step {state.get('step', '?')}) in {ckpt.store.uri}"
    return "\n".join([line, *skipped])


def is_sharded(ckpt: StoredCheckpoint | Path | str) -> bool:
    """Whether a checkpoint (or a local checkpoint directory) holds sharded (``torch.distributed.checkpoint``) model
    state."""
    ckpt = _checkpoint(ckpt)
    return ckpt.store.has(ckpt.name, _DCP_METADATA)


def latest_checkpoint(where: CheckpointStore | Path | str) -> StoredCheckpoint | None:
    """The newest complete checkpoint of a store (or a run directory), verified or not; None when there is none."""
    store = as_store(where)
    return next((c for c in store.checkpoints() if store.has(c.name, _MANIFEST) and store.has(c.name, _DRIVER)), None)


def load_checkpoint(ckpt: StoredCheckpoint | Path | str) -> tuple[dict, dict]:
    """(worker_state, driver_state) of a checkpoint, every file checked against its manifest first; tensors are
    loaded with ``weights_only=True``. Sharded: worker_state is ``{"sharded_dir": location}`` (a local directory or
    a URI), which the workers read themselves (each its own rows)."""
    ckpt = _checkpoint(ckpt)
    verify_files(ckpt)
    store = ckpt.store
    if is_sharded(ckpt):
        if not store.has(ckpt.name, _DRIVER):
            raise CheckpointError(f"checkpoint {ckpt.path} is incomplete: missing driver_state.json")
        return {"sharded_dir": ckpt.path}, json.loads(store.read(ckpt.name, _DRIVER))
    missing = [f for f in ("model.pt", "train_state.pt", _DRIVER) if not store.has(ckpt.name, f)]
    if missing:
        raise CheckpointError(f"checkpoint {ckpt.path} is incomplete: missing {missing}")
    model = torch.load(io.BytesIO(store.read(ckpt.name, "model.pt")), weights_only=True, map_location="cpu")
    train = torch.load(io.BytesIO(store.read(ckpt.name, "train_state.pt")), weights_only=True, map_location="cpu")
    driver = json.loads(store.read(ckpt.name, _DRIVER))
    return {"model": model, **train}, driver


def corpus_fingerprint(corpus) -> dict:
    """What a checkpoint records of the corpus it was taken on (a resume on another corpus is refused)."""
    c = corpus
    return {"num_docs": c.num_docs, "tokens": c.total_tokens, "first": c.keys[0], "last": c.keys[-1]}
