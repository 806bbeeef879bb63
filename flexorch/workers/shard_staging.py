"""Asynchronous sharded checkpoints: each rank's DCP files staged in its node's host memory, then copied to the
checkpoint's storage from a background thread (:func:`stage_sharded`), and staging a dead worker left swept away
(:func:`sweep_staging`).

A rank stages in a directory named with its process id, locked while it lives: the staged files of a process killed
before its copy finished (its node removed mid-save) would hold ``/dev/shm`` host memory until the node rebooted, so
each rank sweeps before it stages, and each sharded worker as it starts. The copy hashes each file (SHA-256) as it
streams it, so the driver need not read the files back to write the manifest (``control.checkpoint``).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shutil
import stat
import tempfile
import time

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict

from flexorch.data.store.remote import filesystem, is_remote
from flexorch.workers.checkpoint_writes import BackgroundWrite
from flexorch.workers.sharded_checkpoint import OPTIONS, write_sharded

__all__ = ["STAGING_PREFIX", "UNOWNED_AGE_S", "stage_sharded", "sweep_staging"]

COPY_CHUNK = 8 << 20
"""Bytes a staged file is copied (and hashed) in at a time."""


def _copy_staged(staged: str, directory: str) -> dict[str, str]:
    """Copy this rank's staged files to ``directory`` (a local one synced to its disk); their SHA-256 by name, taken
    of the bytes as they were copied."""
    fs, path = filesystem(directory)
    local = not is_remote(directory)
    if local:
        os.makedirs(path, exist_ok=True)
    hashes = {}
    for name in sorted(os.listdir(staged)):  # one rank's file(s): its shard, and rank 0's .metadata and train_state
        h = hashlib.sha256()
        with open(os.path.join(staged, name), "rb") as src:
            out = open(f"{path}/{name}", "wb") if local else fs.open_output_stream(f"{path}/{name}")
            with out:
                while chunk := src.read(COPY_CHUNK):
                    h.update(chunk)
                    out.write(chunk)
                if local:
                    out.flush()
                    os.fsync(out.fileno())  # durable as DCP's own save makes it (``sync_files``)
        hashes[name] = h.hexdigest()
    return hashes


STAGING_PREFIX = "flexorch-ckpt-"
"""How a staging directory's name begins: ``flexorch-ckpt-<pid>-<random>``, ``<pid>`` the process that staged in it
(the sweep's test of whether it is still wanted)."""
_OWNED = re.compile(r"(\d+)-[a-z0-9_]+")
"""A staging directory's name after the prefix: its owner's pid, then ``tempfile.mkdtemp``'s random letters."""
_UNOWNED = re.compile(r"[a-z0-9_]+")
"""The name after the prefix that staging directories had before they named their owner: ``mkdtemp``'s letters."""
UNOWNED_AGE_S = 3600.0
"""How old (seconds since it last changed) a staging directory that names no owner must be to be swept: no save
stages for that long, so it is a dead worker's."""


def _staging_roots() -> list[str]:
    """Where ranks stage (:func:`_staging_dir`): ``FLEXORCH_STAGING_DIR``, else ``/dev/shm`` and the temporary
    directory (a save uses the disk where host memory has no room)."""
    root = os.environ.get("FLEXORCH_STAGING_DIR")
    if root is not None:
        return [root]
    return list(dict.fromkeys(r for r in ("/dev/shm", tempfile.gettempdir()) if os.path.isdir(r)))


def _staging_dir(nbytes: int) -> tuple[str, int | None]:
    """A fresh directory for a rank's staged files, and the descriptor that holds its lock: in host memory
    (``/dev/shm``) when it has room for twice the state, else the temporary directory's disk
    (``FLEXORCH_STAGING_DIR`` overrides both). Its name holds this process's id, and this process holds an exclusive
    ``flock`` on it until it is deleted (:func:`_release`), so that :func:`sweep_staging` leaves it alone while its
    owner lives, even when the sweeper sees another pid namespace (a container sharing the host's ``/dev/shm``)."""
    root = os.environ.get("FLEXORCH_STAGING_DIR")
    if root is None and os.path.isdir("/dev/shm"):
        st = os.statvfs("/dev/shm")
        if st.f_bavail * st.f_frsize > 2 * nbytes:
            root = "/dev/shm"
    staged = tempfile.mkdtemp(prefix=f"{STAGING_PREFIX}{os.getpid()}-", dir=root)
    try:
        fd = os.open(staged, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return staged, None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # a filesystem without locks: the pid alone tells the sweep
        os.close(fd)
        return staged, None
    return staged, fd


def _release(staged: str, lock: int | None) -> None:
    """Delete a staging directory, then let go of its lock."""
    shutil.rmtree(staged, ignore_errors=True)
    if lock is not None:
        os.close(lock)


def sweep_staging(root: str | None = None) -> list[str]:
    """Delete the staging directories in ``root`` (None: every root ranks stage in, :func:`_staging_roots`) that
    no live process owns, and return their paths: those whose owner (the pid in the name) is gone and whose lock no
    process holds, and those of older versions that name no owner once :data:`UNOWNED_AGE_S` old. A worker killed
    between staging and the end of its copy (its node removed mid-save) leaves its files there, in ``/dev/shm`` host
    memory, and no later save of that process deletes them; each rank sweeps before it stages and each sharded
    worker as it starts (``workers.actor.Worker``). Nothing else is touched: only directories whose whole name is a
    staging directory's."""
    removed = []
    for where in [root] if root is not None else _staging_roots():
        try:
            names = os.listdir(where)
        except OSError:
            continue
        for name in names:
            path = os.path.join(where, name)
            if name.startswith(STAGING_PREFIX) and _abandoned(path, name[len(STAGING_PREFIX) :]):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
    return removed


def _abandoned(path: str, rest: str) -> bool:
    """Whether the staging directory ``path`` (``rest``: its name after the prefix) is no live process's."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    if not stat.S_ISDIR(st.st_mode):
        return False
    owned = _OWNED.fullmatch(rest)
    if owned is not None:
        return not _running(int(owned[1])) and not _locked(path)
    return _UNOWNED.fullmatch(rest) is not None and time.time() - st.st_mtime > UNOWNED_AGE_S


def _running(pid: int) -> bool:
    """Whether process ``pid`` runs: signal 0 checks without sending; a process of another user runs too."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError):  # PermissionError: it runs, as another user's; anything else: cannot tell
        return True
    return True


def _locked(path: str) -> bool:
    """Whether a process holds the lock of staging directory ``path`` (its owner, :func:`_staging_dir`)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return True  # gone, or not ours to open: leave it
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:  # a filesystem without locks: its owner could not lock it either
        return False
    finally:
        os.close(fd)
    return False


def _state_bytes(*dicts) -> int:
    total = 0
    for d in dicts:
        for v in d.values():
            if isinstance(v, torch.Tensor):
                local = getattr(v, "_local_tensor", v)  # a DTensor: this rank's rows
                total += local.numel() * local.element_size()
            elif isinstance(v, dict):
                total += _state_bytes(v)
    return total


def stage_sharded(directory: str, model, optimizer, scheduler, version: int) -> BackgroundWrite:
    """An asynchronous ``save_sharded``: every rank (a collective) writes its shard to a staging directory of its
    node's host memory, as DCP writes it anywhere, and returns at once; a background thread then copies this rank's
    files to ``directory`` (``workers.checkpoint_writes.BackgroundWrite``; its result: each file's SHA-256).
    The collectives all run here, in the foreground: the background copy uses no process group, so it can neither
    block nor be blocked by the training steps that run meanwhile. The files are the bytes a direct
    ``save_sharded`` writes. The staging directory is deleted after the copy, whether it succeeded or not; one
    a killed worker left is swept by the next (:func:`sweep_staging`)."""
    msd, osd = get_state_dict(model, optimizer, options=OPTIONS) if optimizer is not None else ({}, {})
    sweep_staging()  # what workers killed mid-save left on this node
    staged, lock = _staging_dir(_state_bytes(msd, osd))
    try:
        write_sharded(staged, {"model": msd, "optim": osd}, scheduler, version, staging=True)
    except BaseException:
        _release(staged, lock)
        raise
    return BackgroundWrite(lambda: _copy_staged(staged, directory), directory, lambda: _release(staged, lock))
