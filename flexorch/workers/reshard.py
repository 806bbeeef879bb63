"""Re-shard model state in memory when the world changes (a worker lost, or new ones joining), without disk.

After a membership change every worker joins a new world and builds a freshly sharded decoder for it
(``flexorch.workers.fsdp``). What it held before is a :class:`Holding`: the local rows of every parameter and of
AdamW's moments, which dim-0 shard of how many that was, and the optimizer-step count (the state's version). One
collective over the new world (:func:`exchange`) then moves the state:

1. every rank all-gathers the holdings' descriptors (version, shard index, shard count);
2. the newest version whose holders still cover every old shard is chosen (a worker that finished the step's
   update before a failure holds a newer version than one that did not; old versions are used only if the newer
   one lost a shard); no covering version means the state is gone from memory: ``exchange`` returns None, nothing
   is changed, and the driver rolls back to its last checkpoint;
3. parameter by parameter, each old shard's rows are contributed by exactly one holder (the lowest rank holding
   it) into a zero buffer of the whole tensor, one SUM all-reduce assembles it (adding zeros is exact), and every
   rank keeps its new rows. Only one whole parameter exists at a time.

With ``hsdp`` a lost worker's shard lives in another replica group, so survivors recover in place; with ``fsdp``
(no replica) a lost shard is gone and the run rolls back to its checkpoint (Gemini, Wang et al., SOSP'23, keeps
in-memory copies on peers for this; flexorch's hsdp is that copy).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from flexorch.solver.model_state import shard_rows
from flexorch.workers.fsdp import local_rows

__all__ = ["Holding", "exchange", "holding_of"]

_MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclass
class Holding:
    """What a worker held of the model state in its last world."""

    version: int
    """Optimizer steps applied to this state."""
    index: int
    """Which dim-0 shard (of ``count``) every parameter's local rows are."""
    count: int
    tensors: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    """name -> {"param": rows, "exp_avg": rows, "exp_avg_sq": rows} (moments absent before the first step)."""
    scheduler: dict | None = None


def holding_of(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler, version: int, position: tuple[int, int]
) -> Holding:
    """The local state of a sharded ``model`` (plain tensors, kept after its world is gone), which is shard
    ``position`` = (index, count) of its mesh (recorded while the mesh lived: its groups may be gone). A step that broke
    mid-forward leaves layers gathered: they are resharded first (local: it drops the gathered copies)."""
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()
    index, count = position
    tensors: dict[str, dict[str, torch.Tensor]] = {}
    for name, p in model.named_parameters():
        entry = {"param": p.to_local().detach()}
        st = optimizer.state.get(p, {})
        for k in _MOMENTS:
            if k in st:
                entry[k] = st[k].to_local() if isinstance(st[k], DTensor) else st[k]
        tensors[name] = entry
    return Holding(version, index, count, tensors, scheduler.state_dict())


def exchange(
    held: Holding | None, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler, world
) -> int | None:
    """Fill the freshly sharded ``model``'s local shards and ``optimizer``/``scheduler`` from the holdings of every
    rank of the new world (a collective; ``held`` None: this rank holds nothing). Returns the version restored, or
    None when no version covers every shard (nothing was changed)."""
    rank = dist.get_rank(world)
    desc = None if held is None else (held.version, held.index, held.count)
    descs: list = [None] * dist.get_world_size(world)
    dist.all_gather_object(descs, desc, group=world)
    chosen = _choose(descs)
    if chosen is None:
        return None
    version, count, contributor = chosen
    sched_states: list = [None] * len(descs)
    mine = held.scheduler if held is not None and contributor.get(held.index) == rank else None
    dist.all_gather_object(sched_states, mine, group=world)
    params = dict(model.named_parameters())
    device = next(iter(params.values())).to_local().device
    has_moments = version > 0
    with torch.no_grad():
        for name, p in params.items():
            start, stop = local_rows(p)
            kinds = ("param", *_MOMENTS) if has_moments else ("param",)
            for kind in kinds:
                full = torch.zeros(p.shape, dtype=torch.float32, device=device)
                if held is not None and desc[0] == version and contributor.get(held.index) == rank:
                    a, b = shard_rows(p.shape[0], count, held.index)
                    full[a:b] = held.tensors[name][kind].to(device=device, dtype=torch.float32)
                dist.all_reduce(full, op=dist.ReduceOp.SUM, group=world)
                rows = full[start:stop]
                if kind == "param":
                    p.to_local().copy_(rows)
                else:
                    optimizer.state[p][kind] = DTensor.from_local(
                        rows.clone(), p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
                    )
            if has_moments:
                optimizer.state[p]["step"] = torch.tensor(float(version))
    sched = next(s for s in sched_states if s is not None)
    scheduler.load_state_dict(sched)
    for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr(), strict=True):
        group["lr"] = lr
    return version


def _choose(descs: list) -> tuple[int, int, dict[int, int]] | None:
    """(version, shard count, {old shard index: contributing rank}) of the newest version whose holders cover
    every old shard, or None."""
    versions = sorted({d[0] for d in descs if d is not None}, reverse=True)
    for v in versions:
        holders = [(r, d) for r, d in enumerate(descs) if d is not None and d[0] == v]
        count = holders[0][1][2]
        contributor: dict[int, int] = {}
        for r, (_, index, c) in holders:
            if c != count:
                raise RuntimeError(f"holders of state version {v} disagree on the shard count: {descs}")
            contributor.setdefault(index, r)
        if len(contributor) == count:
            return v, count, contributor
    return None
