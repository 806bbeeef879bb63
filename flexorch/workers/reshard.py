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
3. each old shard's rows are contributed by exactly one holder (the lowest rank holding it) into a zero buffer of
   the whole tensor, a SUM all-reduce assembles it (adding zeros is exact), and every rank keeps its new rows.
   Tensors go in buckets of up to :data:`BUCKET_BYTES` (one all-reduce each): a re-form costs a few collectives,
   not three per parameter, and only one bucket of whole tensors exists at a time.

With ``hsdp`` a lost worker's shard lives in another replica group, so survivors recover in place; with ``fsdp``
(no replica) a lost shard is gone and the run rolls back to its checkpoint (Gemini, Wang et al., SOSP'23, keeps
in-memory copies on peers for this; flexorch's hsdp is that copy).

A worker that leaves on notice (its node is being drained, ``flexorch.control.drains``) hands its holding to one that
stays before it goes; that one then brings several holdings to the exchange (``held`` a list), and the new world
re-shards from them exactly as from its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from flexorch.solver.model_state import shard_rows
from flexorch.workers.fsdp import local_rows, reshard_after_failure
from flexorch.workers.step_exec import default_device

__all__ = ["Holding", "exchange", "holding_of", "on_cpu"]

_MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclass
class Holding:
    """What a worker held of the model state in its last world."""

    version: int
    """Optimizer steps applied to this state."""
    positions: dict[str, tuple[int, int]] = field(default_factory=dict)
    """name -> (index, count): which dim-0 shard of how many the local rows of each parameter held are (with
    pipeline stages a worker holds its stage's parameters only)."""
    tensors: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    """name -> {"param": rows, "exp_avg": rows, "exp_avg_sq": rows} (moments absent before the first step)."""
    scheduler: dict | None = None


def holding_of(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler,
    version: int,
    positions: dict[str, tuple[int, int]],
) -> Holding:
    """The local state of a sharded ``model`` (plain tensors, kept after its world is gone); ``positions`` of its
    parameters were recorded while the mesh lived (its groups may be gone now). A step that broke mid-forward
    leaves layers gathered: they are resharded first (local: it drops the gathered copies)."""
    reshard_after_failure(model)
    tensors: dict[str, dict[str, torch.Tensor]] = {}
    for name, p in model.named_parameters():
        if name not in positions:
            continue
        entry = {"param": p.to_local().detach()}
        st = optimizer.state.get(p, {}) if optimizer is not None else {}
        for k in _MOMENTS:
            if k in st:
                entry[k] = st[k].to_local() if isinstance(st[k], DTensor) else st[k]
        tensors[name] = entry
    sched = scheduler.state_dict() if scheduler is not None else None
    return Holding(version, dict(positions), tensors, sched)


def on_cpu(held: Holding) -> Holding:
    """A copy of ``held`` with its tensors on the CPU: what a leaving worker hands to one that stays, through Ray's
    object store."""
    tensors = {n: {k: t.detach().to("cpu", copy=True) for k, t in e.items()} for n, e in held.tensors.items()}
    return Holding(held.version, dict(held.positions), tensors, held.scheduler)


def exchange(
    held: Holding | list[Holding] | None,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler,
    world,
    shapes: list[tuple[str, tuple[int, ...]]],
) -> int | None:
    """Fill the freshly sharded ``model``'s local shards and ``optimizer``/``scheduler`` from the holdings of every
    rank of the new world (a collective; ``held`` None: this rank holds nothing; a list: its own holding and those
    handed to it by workers that left). ``shapes``: every parameter of the whole model, ``(name, shape)`` in one
    order on every rank (``ModelConfig.param_shapes``); this rank fills the ones its ``model`` has. Returns the
    version restored, or None when no version covers every shard of every parameter (nothing was changed)."""
    rank = dist.get_rank(world)
    holdings = [] if held is None else [held] if isinstance(held, Holding) else list(held)
    desc = [(h.version, h.positions, h.scheduler is not None) for h in holdings]
    descs: list = [None] * dist.get_world_size(world)
    dist.all_gather_object(descs, desc, group=world)
    chosen = _choose(descs, [n for n, _ in shapes])
    if chosen is None:
        return None
    version, contributors = chosen
    sched_states: list = [None] * len(descs)
    first, j_first = min((r, j) for r, j, d in _entries(descs) if d[0] == version and d[2])
    dist.all_gather_object(sched_states, holdings[j_first].scheduler if rank == first else None, group=world)
    mine = dict(model.named_parameters())
    device = _device(mine)
    kinds = ("param", *_MOMENTS) if version > 0 else ("param",)  # no moments before the first step
    with torch.no_grad():
        for bucket in _buckets([(name, shape, kind) for name, shape in shapes for kind in kinds]):
            # one collective per bucket (not per tensor: a step's worth of small all-reduces is most of a re-form)
            sizes = [math.prod(shape) for _, shape, _ in bucket]
            flat = torch.zeros(sum(sizes), dtype=torch.float32, device=device)
            fulls = [v.view(shape) for v, (_, shape, _) in zip(flat.split(sizes), bucket, strict=True)]
            for full, (name, shape, kind) in zip(fulls, bucket, strict=True):
                for index, (r, count, j) in contributors[name].items():
                    if r == rank:
                        a, b = shard_rows(shape[0], count, index)
                        full[a:b] = holdings[j].tensors[name][kind].to(device=device, dtype=torch.float32)
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=world)  # (sum(sizes),): every old shard, once
            for full, (name, _, kind) in zip(fulls, bucket, strict=True):
                p = mine.get(name)
                if p is not None:
                    _keep_rows(p, kind, full, optimizer, version)
    if scheduler is not None:
        scheduler.load_state_dict(sched_states[first])
        for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr(), strict=True):
            group["lr"] = lr
    return version


BUCKET_BYTES = 64 << 20
"""Whole tensors summed in one all-reduce during :func:`exchange` (a tensor larger than this goes alone)."""


def _buckets(items: list[tuple[str, tuple[int, ...], str]], limit: int = BUCKET_BYTES):
    """``items`` (name, shape, kind) in order, cut into runs of at most ``limit`` fp32 bytes (one item at least)."""
    run: list = []
    size = 0
    for item in items:
        n = math.prod(item[1]) * 4
        if run and size + n > limit:
            yield run
            run, size = [], 0
        run.append(item)
        size += n
    if run:
        yield run


def _keep_rows(p, kind: str, full: torch.Tensor, optimizer, version: int) -> None:
    """This rank's rows of the whole ``full`` into parameter ``p`` (``kind`` "param") or its AdamW moment."""
    start, stop = local_rows(p)
    rows = full[start:stop]
    if kind == "param":
        p.to_local().copy_(rows)
        return
    optimizer.state[p][kind] = DTensor.from_local(
        rows.clone(), p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
    )
    optimizer.state[p]["step"] = torch.tensor(float(version))


def _entries(descs: list):
    """(rank, index of the holding at that rank, descriptor) of every holding; a rank's entry is None (it holds
    nothing), one descriptor ``(version, positions, has_scheduler)``, or a list of them."""
    for r, d in enumerate(descs):
        for j, one in enumerate([] if d is None else [d] if isinstance(d, tuple) else d):
            yield r, j, one


def _device(params: dict) -> torch.device:
    for p in params.values():
        return p.to_local().device
    return default_device()


def _choose(descs: list, names: list[str]) -> tuple[int, dict[str, dict[int, tuple[int, int, int]]]] | None:
    """(version, {parameter: {old shard index: (contributing rank, shard count, its holding's index)}}) of the newest
    version whose holders cover every shard of every parameter in ``names``, or None. ``descs``: per rank, None, a
    descriptor or a list of them (:func:`_entries`)."""
    entries = list(_entries(descs))
    versions = sorted({d[0] for _, _, d in entries}, reverse=True)
    for v in versions:
        holders = [(r, j, d[1]) for r, j, d in entries if d[0] == v]
        contributors: dict[str, dict[int, tuple[int, int, int]]] = {}
        whole = True
        for name in names:
            got: dict[int, tuple[int, int, int]] = {}
            counts = set()
            for r, j, positions in holders:
                if name in positions:
                    index, count = positions[name]
                    counts.add(count)
                    got.setdefault(index, (r, count, j))
            if len(counts) > 1:
                raise RuntimeError(f"holders of {name} at state version {v} disagree on its shard count: {counts}")
            if not counts or len(got) != counts.pop():
                whole = False
                break
            contributors[name] = got
        if whole:
            return v, contributors
    return None
