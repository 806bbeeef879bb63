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

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from flexorch.data.store.remote import filesystem, is_remote

__all__ = ["TRAIN_STATE", "load_sharded", "save_sharded"]

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
