"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP): each worker writes and reads only its shard.

``save_sharded`` (a collective over the world) writes DCP's files into a directory: one ``__<rank>_0.distcp`` per
worker holding its rows of every parameter and AdamW moment, DCP's ``.metadata`` (which rows of which tensor are
where), and ``train_state.json`` (LR schedule and state version, from rank 0). ``load_sharded`` reads it into a
model sharded for *any* world size: DCP's load planner maps every rank's rows onto the saved chunks
(``torch.distributed.checkpoint.state_dict``'s ``get_state_dict``/``set_state_dict`` turn FSDP2's DTensors and the
optimizer's per-parameter state into fully-qualified names), so a checkpoint written on 4 workers resumes on 2 or
3. The directory is a local (or shared) path or an object-store URI (``s3://bucket/prefix/checkpoint_000004``): on an
object store each rank writes its file straight there through DCP's fsspec writer over the pyarrow filesystem that
corpora are read with (``flexorch.data.store.remote``), so no node's disk holds a part of it. The driver then writes
its own state and the manifest last (``flexorch.control.checkpoint``).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from flexorch.data.store.remote import filesystem, is_remote
from flexorch.workers.checkpoint_writes import BackgroundWrite

__all__ = ["TRAIN_STATE", "load_sharded", "save_sharded", "stage_sharded"]

TRAIN_STATE = "train_state.json"
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
"""Optimizer state and hyper-parameters keyed by parameter name (``param_groups.<fqn>.lr``), not by group index,
so ranks holding different parameters (pipeline stages, another stage map on resume) save and load the same keys
(torchtitan checkpoints the same way)."""


def save_sharded(directory: str, model, optimizer, scheduler, version: int) -> None:
    """Write this rank's shard of ``model`` and ``optimizer`` into ``directory`` (every rank calls it)."""
    msd, osd = get_state_dict(model, optimizer, options=_OPTIONS) if optimizer is not None else ({}, {})
    dcp.save({"model": msd, "optim": osd}, **_target(directory, write=True))
    if dist.get_rank() == 0:
        state = {"scheduler": scheduler.state_dict(), "version": version}
        fs, path = filesystem(directory)
        with fs.open_output_stream(f"{path}/{TRAIN_STATE}") as f:
            f.write(json.dumps(state, default=_plain).encode())
    dist.barrier()


def _copy_staged(staged: str, directory: str) -> dict[str, int]:
    """Copy this rank's staged files to ``directory``; their names and sizes."""
    import pyarrow.fs as pafs

    files = {f: os.path.getsize(os.path.join(staged, f)) for f in os.listdir(staged)}
    fs, path = filesystem(directory)
    if not is_remote(directory):
        fs.create_dir(path, recursive=True)
    for f in files:  # one rank's file(s): its shard, and rank 0's .metadata and train_state.json
        pafs.copy_files(os.path.join(staged, f), f"{path}/{f}",
                        source_filesystem=pafs.LocalFileSystem(), destination_filesystem=fs)  # fmt: skip
    return files


def _staging_dir(nbytes: int) -> str:
    """A fresh directory for a rank's staged files: in host memory (``/dev/shm``) when it has room for twice the
    state, else the temporary directory's disk (``FLEXORCH_STAGING_DIR`` overrides both)."""
    root = os.environ.get("FLEXORCH_STAGING_DIR")
    if root is None and os.path.isdir("/dev/shm"):
        st = os.statvfs("/dev/shm")
        if st.f_bavail * st.f_frsize > 2 * nbytes:
            root = "/dev/shm"
    return tempfile.mkdtemp(prefix="flexorch-ckpt-", dir=root)


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
    """An asynchronous :func:`save_sharded`: every rank (a collective) writes its shard to a staging directory of its
    node's host memory, as DCP writes it anywhere, and returns at once; a background thread then copies this rank's
    files to ``directory`` (``workers.checkpoint_writes.BackgroundWrite``; its result: the files and their sizes).
    The collectives all run here, in the foreground: the background copy uses no process group, so it can neither
    block nor be blocked by the training steps that run meanwhile. The files are the bytes a direct
    :func:`save_sharded` writes."""
    msd, osd = get_state_dict(model, optimizer, options=_OPTIONS) if optimizer is not None else ({}, {})
    staged = _staging_dir(_state_bytes(msd, osd))
    try:
        save_sharded(staged, model, optimizer, scheduler, version)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    cleanup = lambda: shutil.rmtree(staged, ignore_errors=True)  # noqa: E731
    return BackgroundWrite(lambda: _copy_staged(staged, directory), directory, cleanup)


def load_sharded(directory: str, model, optimizer, scheduler) -> int:
    """Fill ``model`` and ``optimizer`` (sharded for this world) from a checkpoint written on any world size;
    returns the state version (optimizer steps) it holds."""
    fs, path = filesystem(directory)
    with fs.open_input_stream(f"{path}/{TRAIN_STATE}") as f:
        train = json.loads(f.read())
    if optimizer is None:  # a rank on no pipeline stage holds nothing, but takes part in the collective
        dcp.load({}, **_target(directory, write=False))
        return int(train["version"])
    # templates: this world's shards (optimizer state initialised)
    msd, osd = get_state_dict(model, optimizer, options=_OPTIONS)
    state = {"model": msd, "optim": osd}
    dcp.load(state, **_target(directory, write=False))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=_OPTIONS)
    scheduler.load_state_dict(train["scheduler"])
    for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr(), strict=True):
        group["lr"] = lr
    return int(train["version"])


def _target(directory: str, write: bool) -> dict:
    """DCP's keyword for where a checkpoint is: a local path as is; an object-store URI as DCP's fsspec writer or
    reader over flexorch's pyarrow filesystem (endpoint and credentials from the environment, as for corpora)."""
    if not is_remote(directory):
        return {"checkpoint_id": directory}
    from fsspec.implementations.arrow import ArrowFSWrapper
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter  # not re-exported

    fs, path = filesystem(directory)
    io = (FsspecWriter if write else FsspecReader)(path)  # "bucket/prefix/...": fsspec takes it as a local path ...
    io.fs.fs = ArrowFSWrapper(fs)  # ... until it is given the object store it is in
    return {"storage_writer" if write else "storage_reader": io}


def _plain(value):
    if isinstance(value, torch.Tensor):
        return value.tolist()
    raise TypeError(f"cannot write {type(value).__name__} to {TRAIN_STATE}")
