"""The checkpoints one run writes and goes back to, in its store (``[checkpoint] storage``): the resume from the
newest that verifies (on this corpus, with this sharding), saves whole or in parts (an asynchronous save begins, the
workers copy their shards in the background, and it completes or is abandoned: ``control.checkpointer``), and the
run's records mirrored beside the checkpoints when the store is elsewhere than the run directory. What a checkpoint
holds and how it verifies is ``flexorch.control.checkpoint``.
"""

from __future__ import annotations

from pathlib import Path

from flexorch.config import ConfigError
from flexorch.control.checkpoint import (
    as_store,
    begin_checkpoint,
    complete_checkpoint,
    corpus_fingerprint,
    latest_checkpoint,
    load_checkpoint,
    newest_good_checkpoint,
    no_good_checkpoint,
    write_model_state,
)
from flexorch.control.checkpoint_store import CheckpointStore, StoredCheckpoint

__all__ = ["MIRRORED", "RunCheckpoints", "fetch_records"]


MIRRORED = ("config.json", "profile.json", "steps.jsonl")
"""The run's records copied to ``STORAGE/run/`` at each checkpoint when the storage is not under the run directory
(a dashboard or a person can open the run from storage alone)."""


class RunCheckpoints:
    """The checkpoints one run writes and goes back to: it resumes from, or rolls back to, only its own newest
    checkpoint (never an older run's in the same store). ``where``: the run's store, or its run directory (the
    default store, ``RUN_DIR/checkpoints``); ``run_dir``: the records mirrored to a store elsewhere."""

    def __init__(
        self,
        where: CheckpointStore | Path | str,
        corpus,
        keep: int,
        sharded: bool = False,
        keep_every: int = 0,
        run_dir: Path | str | None = None,
    ):
        self.store = as_store(where)
        self.corpus, self.keep, self.keep_every, self.sharded = corpus, keep, keep_every, sharded
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.own: StoredCheckpoint | None = None
        self.skipped: list[str] = []  # newer checkpoints the resume skipped, one message each (file and why)

    def resume(self) -> tuple[dict, dict]:
        """(worker state, driver state) of the store's newest checkpoint that verifies against its manifest, taken
        on this corpus (else a :class:`~flexorch.config.ConfigError` saying why). Newer damaged or partial
        checkpoints are skipped; :attr:`skipped` says which and why."""
        ckpt, self.skipped = newest_good_checkpoint(self.store)
        if ckpt is None:
            raise no_good_checkpoint(self.store, self.skipped)
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
        whole ``worker_state``, or shards the workers write with ``write_shards(location)``. Returns where it is."""
        ckpt = self.begin(step)
        hashes = {}
        if write_shards is not None:
            write_shards(ckpt.path)
        else:
            hashes = write_model_state(ckpt, worker_state)
        return self.complete(ckpt, driver_state, hashes)

    def begin(self, step: int) -> StoredCheckpoint:
        """A save in parts (an asynchronous one): the empty directory of the checkpoint after ``step`` steps."""
        return begin_checkpoint(self.store, step)

    def complete(self, ckpt: StoredCheckpoint, driver_state: dict, hashes: dict[str, str] | None = None) -> str:
        """The end of a save in parts, once the model state is in ``ckpt``: the driver's state and the manifest
        (:func:`complete_checkpoint`), retention, the records mirrored; it is this run's newest from here."""
        driver_state = {**driver_state, "corpus": corpus_fingerprint(self.corpus)}
        self.own = complete_checkpoint(ckpt, driver_state, hashes or {}, self.keep, self.keep_every)
        self.mirror_records()
        return self.own.path

    def abandon(self, ckpt: StoredCheckpoint) -> None:
        """A save in parts that failed: delete what it wrote (the previous checkpoint stays the newest)."""
        ckpt.store.delete(ckpt.name)

    def mirror_records(self) -> None:
        """Copy the run's records (:data:`MIRRORED`) to ``STORAGE/run/`` when the store is not the run directory's."""
        if self.run_dir is None or self.store == CheckpointStore.of_run(self.run_dir):
            return
        for name in MIRRORED:
            f = self.run_dir / name
            if f.is_file():
                self.store.put_file(f, "run", name)

    def hint(self) -> str:
        """Where the last checkpoint is and how to go on from it (for errors that stop the run)."""
        ckpt = latest_checkpoint(self.store)
        if ckpt is None:
            return "No checkpoint was written yet (set checkpoint_every to keep one)"
        return f"The last checkpoint, {ckpt.path}, is intact: run again with --resume when capacity is back"


def fetch_records(storage: str, into: Path) -> list[str]:
    """Copy a run's records mirrored to ``STORAGE/run/`` (:data:`MIRRORED`, as its last checkpoint left them) into
    the local directory ``into`` (``flexorch dashboard s3://...``); returns the names copied. Each file is written
    beside its old copy and renamed over it, so a reader never sees half of one. Raises
    :class:`~flexorch.config.ConfigError` saying what to do when the storage holds no run records."""
    store = CheckpointStore(storage)
    if not store.has("run", "steps.jsonl"):
        raise ConfigError(
            f"{store.location('run', 'steps.jsonl')} does not exist: pass the [checkpoint] storage of a run (its "
            "records are copied there at each checkpoint, when the storage is not under the run directory), or a "
            "local run directory"
        )
    into.mkdir(parents=True, exist_ok=True)
    copied = []
    for name in MIRRORED:
        if store.has("run", name):
            part = into / f".{name}.part"
            part.write_bytes(store.read("run", name))
            part.replace(into / name)
            copied.append(name)
    return copied
