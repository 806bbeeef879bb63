"""Where a run's checkpoints live: a local directory, a shared path, or an object-store prefix (``s3://``, ``gs://``).

``[checkpoint] storage`` names it (default ``RUN_DIR/checkpoints``). Every checkpoint is one directory of the store,
``checkpoint_<step>/``; the driver writes its files through :class:`CheckpointStore` and each worker of a sharded run
writes its own DCP shard straight into the same directory (``flexorch.workers.sharded_checkpoint``), so a checkpoint
on object storage outlives every node that wrote part of it.

Objects are read and written with pyarrow's filesystems, configured the way corpora are
(``flexorch.data.store.remote``: ``AWS_*`` credentials and region, ``FLEXORCH_S3_ENDPOINT`` / ``AWS_ENDPOINT_URL`` for
an S3-compatible endpoint, ``GOOGLE_APPLICATION_CREDENTIALS`` for GCS). There is no rename on an object store, so a
checkpoint is complete only once its ``manifest.json`` is there: the driver writes it last, after every other file
(``flexorch.control.checkpoint``). This module knows files and bytes, not what a checkpoint means.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pyarrow.fs as pafs

from flexorch.data.errors import DataError
from flexorch.data.store.remote import filesystem, is_remote, join, store_error

__all__ = ["PREFIX", "CheckpointStore", "StoredCheckpoint", "StoreError"]

PREFIX = "checkpoint_"


class StoreError(ValueError):
    """The checkpoint storage cannot be reached, read or written; the message names the URI and what to fix."""


def _error(uri: str, exc: BaseException, doing: str) -> StoreError:
    text = str(store_error(uri, exc)) if not isinstance(exc, DataError) else str(exc)
    return StoreError(f"checkpoint storage: {doing} failed: {text}")


@dataclass(frozen=True)
class StoredCheckpoint:
    """One checkpoint directory of a store."""

    store: CheckpointStore
    name: str

    @property
    def path(self) -> str:
        """Its location: a local directory path, or a URI under an object store."""
        return self.store.location(self.name)

    @property
    def step(self) -> int:
        """The step it was taken after (-1 for a name that carries none)."""
        tail = self.name[len(PREFIX) :]
        return int(tail) if tail.isdigit() else -1


class CheckpointStore:
    """The checkpoint directories under one location, local or remote."""

    def __init__(self, location: str | os.PathLike):
        self.uri = str(location)
        self.remote = is_remote(self.uri)
        try:
            self.fs, self.root = filesystem(self.uri)
        except DataError as e:
            raise StoreError(f"checkpoint storage {self.uri}: {e}") from None
        self.root = self.root.rstrip("/")

    @classmethod
    def of_run(cls, run_dir: str | os.PathLike, storage: str | None = None) -> CheckpointStore:
        """A run's store: ``storage`` when set, else ``RUN_DIR/checkpoints``."""
        return cls(storage if storage else Path(run_dir) / "checkpoints")

    def __repr__(self) -> str:
        return f"CheckpointStore({self.uri!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CheckpointStore) and (self.uri, self.root) == (other.uri, other.root)

    def __hash__(self) -> int:
        return hash((self.uri, self.root))

    # ------------------------------------------------------------------ names

    def location(self, name: str, file: str | None = None) -> str:
        """Where a checkpoint directory (or one of its files) is, as a user and a worker name it: a local absolute
        path, or a URI (``s3://bucket/prefix/checkpoint_000004``)."""
        parts = [name] if file is None else [name, file]
        if self.remote:
            return join(self.uri, *parts)
        return str(Path(self.root, *parts))

    def _path(self, name: str, file: str | None = None) -> str:
        return "/".join([self.root, name] if file is None else [self.root, name, file])

    def checkpoint(self, name: str) -> StoredCheckpoint:
        return StoredCheckpoint(self, name)

    def checkpoints(self) -> list[StoredCheckpoint]:
        """Every ``checkpoint_<step>`` directory, newest (highest step) first, complete or not."""
        try:
            infos = self.fs.get_file_info(pafs.FileSelector(self.root, allow_not_found=True, recursive=False))
        except OSError as e:
            raise _error(self.uri, e, "listing the checkpoints") from None
        names = {i.base_name for i in infos if i.type == pafs.FileType.Directory and i.base_name.startswith(PREFIX)}
        found = [StoredCheckpoint(self, n) for n in names]
        return sorted(found, key=lambda c: (c.step, c.name), reverse=True)

    # ------------------------------------------------------------------ files

    def files(self, name: str) -> dict[str, int]:
        """The files of a checkpoint directory and their sizes in bytes (``/``-separated, relative to it)."""
        base = self._path(name)
        try:
            infos = self.fs.get_file_info(pafs.FileSelector(base, allow_not_found=True, recursive=True))
        except OSError as e:
            raise _error(self.location(name), e, "listing a checkpoint") from None
        prefix = base + "/"
        return {i.path[len(prefix) :]: i.size for i in infos if i.type == pafs.FileType.File}

    def has(self, name: str, file: str) -> bool:
        try:
            return self.fs.get_file_info(self._path(name, file)).type == pafs.FileType.File
        except OSError as e:
            raise _error(self.location(name, file), e, "looking up a file") from None

    def read(self, name: str, file: str) -> bytes:
        try:
            with self.fs.open_input_stream(self._path(name, file)) as f:
                return f.read()
        except OSError as e:
            raise _error(self.location(name, file), e, "reading") from None

    def open_read(self, name: str, file: str):
        """A binary stream of one file, read in chunks (hashing a large file without holding it)."""
        try:
            return self.fs.open_input_stream(self._path(name, file))
        except OSError as e:
            raise _error(self.location(name, file), e, "reading") from None

    def write(self, name: str, file: str, data: bytes) -> None:
        """Write one whole file (an object store makes it visible whole or not at all)."""
        path = self._path(name, file)
        try:
            if not self.remote:
                self.fs.create_dir(self._path(name), recursive=True)
            with self.fs.open_output_stream(path) as f:
                f.write(data)
        except OSError as e:
            raise _error(self.location(name, file), e, "writing") from None

    def prepare(self, name: str) -> None:
        """An empty checkpoint directory ``name`` (whatever was there is deleted: a partial save of the same step)."""
        self.delete(name)
        if not self.remote:
            try:
                self.fs.create_dir(self._path(name), recursive=True)
            except OSError as e:
                raise _error(self.location(name), e, "creating a checkpoint directory") from None

    def delete(self, name: str) -> None:
        """Delete a checkpoint directory and everything in it (nothing when it is not there)."""
        path = self._path(name)
        try:
            if self.fs.get_file_info(path).type != pafs.FileType.NotFound:
                self.fs.delete_dir(path)
        except OSError as e:
            raise _error(self.location(name), e, "deleting a checkpoint") from None

    def download(self, name: str, dest: str | os.PathLike) -> Path:
        """Copy a checkpoint directory into the local directory ``dest`` (created); returns it."""
        dest = Path(dest)
        dest.mkdir(parents=True, exist_ok=True)
        try:
            pafs.copy_files(self._path(name), str(dest), source_filesystem=self.fs,
                            destination_filesystem=pafs.LocalFileSystem())  # fmt: skip
        except OSError as e:
            raise _error(self.location(name), e, "downloading a checkpoint") from None
        return dest

    def put_file(self, local: str | os.PathLike, name: str, file: str) -> None:
        """Copy the local file ``local`` to ``name/file`` of the store."""
        try:
            if not self.remote:
                self.fs.create_dir(self._path(name), recursive=True)
            pafs.copy_files(str(local), self._path(name, file), source_filesystem=pafs.LocalFileSystem(),
                            destination_filesystem=self.fs)  # fmt: skip
        except OSError as e:
            raise _error(self.location(name, file), e, "uploading") from None

    def check_writable(self) -> None:
        """Write, read back and delete a small object under the store, before the first step: a bucket that does not
        exist, missing credentials or an unreachable endpoint is a :class:`StoreError` naming the URI and the fix."""
        if not self.remote:  # nothing is created: the nearest existing directory must be writable
            here = Path(self.root)
            while not here.exists() and here != here.parent:
                here = here.parent
            if not here.is_dir() or not os.access(here, os.W_OK | os.X_OK):
                raise StoreError(
                    f"checkpoint storage {self.uri} cannot be written ({here} is not a writable directory); set "
                    "[checkpoint] storage (or run_dir) to a directory this job can write"
                )
            return
        bucket = self.root.split("/", 1)[0]
        path = f"{self.root}/.flexorch-write-check-{os.getpid()}-{os.urandom(4).hex()}"
        try:
            if self.fs.get_file_info(bucket).type == pafs.FileType.NotFound:
                raise StoreError(
                    f"checkpoint storage {self.uri}: the bucket {bucket!r} does not exist; create it, or set "
                    "[checkpoint] storage to a bucket that exists (and check FLEXORCH_S3_ENDPOINT / AWS_ENDPOINT_URL)"
                )
            with self.fs.open_output_stream(path) as f:
                f.write(b"flexorch")
            self.fs.delete_file(path)
        except OSError as e:
            raise StoreError(
                f"checkpoint storage {self.uri} cannot be written: {store_error(self.uri, e)}. Set [checkpoint] "
                "storage to a location this job can write (the driver and every worker write there)"
            ) from None
