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

Loading from an object store, each rank fetches of each file only the bytes its items span, in a few large ranged
reads (``workers.ranged_reads.ObjectStoreReader``), not DCP's seek-and-read per item. An asynchronous save stages
with :func:`write_sharded` in host memory and copies from there in the background (``workers.shard_staging``).
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from flexorch.data.store.remote import filesystem, is_remote

__all__ = ["OPTIONS", "TRAIN_STATE", "load_sharded", "save_sharded", "write_sharded"]

TRAIN_STATE = "train_state.json"
OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
"""Optimizer state and hyper-parameters keyed by parameter name (``param_groups.<fqn>.lr``), not by group index,
so ranks holding different parameters (pipeline stages, another stage map on resume) save and load the same keys
(torchtitan checkpoints the same way)."""


def save_sharded(directory: str, model, optimizer, scheduler, version: int) -> None:
    """Write this rank's shard of ``model`` and ``optimizer`` into ``directory`` (every rank calls it)."""
    msd, osd = get_state_dict(model, optimizer, options=OPTIONS) if optimizer is not None else ({}, {})
    write_sharded(directory, {"model": msd, "optim": osd}, scheduler, version)


def write_sharded(directory: str, state: dict, scheduler, version: int, staging: bool = False) -> None:
    """:func:`save_sharded` of a state dict already taken (``{"model", "optim"}``, by ``get_state_dict``).
    ``staging``: ``directory`` is a rank's staging directory in host memory, whose files are copied to the
    checkpoint's storage afterwards: DCP does not ``fsync`` them there (the copy's destination is synced)."""
    from flexorch.workers.checkpoint_writes import without_zip_crc

    with without_zip_crc():
        if staging:
            dcp.save(state, storage_writer=FileSystemWriter(directory, sync_files=False))
        else:
            dcp.save(state, **_target(directory, write=True))
    if dist.get_rank() == 0:
        state = {"scheduler": scheduler.state_dict(), "version": version}
        fs, path = filesystem(directory)
        with fs.open_output_stream(f"{path}/{TRAIN_STATE}") as f:
            f.write(json.dumps(state, default=_plain).encode())
    dist.barrier()


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
    msd, osd = get_state_dict(model, optimizer, options=OPTIONS)
    state = {"model": msd, "optim": osd}
    dcp.load(state, **_target(directory, write=False))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=OPTIONS)
    scheduler.load_state_dict(train["scheduler"])
    for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr(), strict=True):
        group["lr"] = lr
    return int(train["version"])


def _target(directory: str, write: bool) -> dict:
    """DCP's keyword for where a checkpoint is: a local path as is; an object-store URI as DCP's fsspec writer over
    flexorch's pyarrow filesystem (endpoint and credentials from the environment, as for corpora), or the reader of
    ranged reads (``workers.ranged_reads.ObjectStoreReader``) over it."""
    if not is_remote(directory):
        return {"checkpoint_id": directory}
    from fsspec.implementations.arrow import ArrowFSWrapper

    fs, path = filesystem(directory)
    if not write:
        from flexorch.workers.ranged_reads import ObjectStoreReader

        return {"storage_reader": ObjectStoreReader(fs, path)}
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter  # not re-exported

    writer = FsspecWriter(path)  # "bucket/prefix/...": fsspec takes it as a local path ...
    writer.fs.fs = ArrowFSWrapper(fs)  # ... until it is given the object store it is in
    return {"storage_writer": writer}


def _plain(value):
    if isinstance(value, torch.Tensor):
        return value.tolist()
    raise TypeError(f"cannot write {type(value).__name__} to {TRAIN_STATE}")
