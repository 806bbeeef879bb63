"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP): each worker writes and reads only its shard.

``save_sharded`` (a collective over the world) writes DCP's files into a directory: one ``__<rank>_0.distcp`` per
worker holding its rows of every parameter and AdamW moment, DCP's ``.metadata`` (which rows of which tensor are
where), and ``train_state.json`` (LR schedule and state version, from rank 0). ``load_sharded`` reads it into a
model sharded for *any* world size: DCP's load planner maps every rank's rows onto the saved chunks
(``torch.distributed.checkpoint.state_dict``'s ``get_state_dict``/``set_state_dict`` turn FSDP2's DTensors and the
optimizer's per-parameter state into fully-qualified names), so a checkpoint written on 4 workers resumes on 2 or
3. The control plane writes into a temporary directory, checks every file against its manifest, and renames
(``flexorch.control.checkpoint``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

__all__ = ["TRAIN_STATE", "load_sharded", "save_sharded"]

TRAIN_STATE = "train_state.json"
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
"""Optimizer state and hyper-parameters keyed by parameter name (``param_groups.<fqn>.lr``), not by group index,
so ranks holding different parameters (pipeline stages, another stage map on resume) save and load the same keys
(torchtitan checkpoints the same way)."""


def save_sharded(directory: str, model, optimizer, scheduler, version: int) -> None:
    """Write this rank's shard of ``model`` and ``optimizer`` into ``directory`` (every rank calls it)."""
    msd, osd = get_state_dict(model, optimizer, options=_OPTIONS) if optimizer is not None else ({}, {})
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=directory)
    if dist.get_rank() == 0:
        state = {"scheduler": scheduler.state_dict(), "version": version}
        (Path(directory) / TRAIN_STATE).write_text(json.dumps(state, default=_plain))
    dist.barrier()


def load_sharded(directory: str, model, optimizer, scheduler) -> int:
    """Fill ``model`` and ``optimizer`` (sharded for this world) from a checkpoint written on any world size;
    returns the state version (optimizer steps) it holds."""
    train = json.loads((Path(directory) / TRAIN_STATE).read_text())
    if optimizer is None:  # a rank on no pipeline stage holds nothing, but takes part in the collective
        dcp.load({}, checkpoint_id=directory)
        return int(train["version"])
    # templates: this world's shards (optimizer state initialised)
    msd, osd = get_state_dict(model, optimizer, options=_OPTIONS)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=directory)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=_OPTIONS)
    scheduler.load_state_dict(train["scheduler"])
    for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr(), strict=True):
        group["lr"] = lr
    return int(train["version"])


def _plain(value):
    if isinstance(value, torch.Tensor):
        return value.tolist()
    raise TypeError(f"cannot write {type(value).__name__} to {TRAIN_STATE}")
