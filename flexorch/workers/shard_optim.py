"""AdamW, gradient scaling and the gradient's global norm on the local shards of FSDP2's DTensor parameters.

Why not through DTensor: DTensor's sharding propagation caches each op's output spec by its input specs, and every
world that closes empties those caches (:func:`flexorch.workers.fsdp.forget_closed_meshes`, for correctness). So
the first optimizer step of each new world (a run's start, a resume, a shrink, a planned leave, a grow) would
propagate every foreach op, per-gradient norm and scaling again, on the CPU, making the step after each membership
change many times slower than the steps that follow it.

Why it is the same arithmetic: after FSDP2's reduce-scatter (and, under hsdp, its all-reduce over the replicas)
every gradient is ``Shard``/``Replicate``, with no pending reduction, and the parameters and AdamW's moments are
sharded alike. AdamW and the clip's scaling are elementwise, so the update of each element is what DTensor's own
foreach kernels compute on these local shards: :class:`ShardAdamW` hands torch's own AdamW the local shards
(``DTensor.to_local()``: views of the same storage) and changes nothing else; its state stays DTensors, as
``torch.distributed.checkpoint`` and the re-shard (``flexorch.workers.reshard``) read it. The norm is
``sqrt`` of this rank's sum of squares all-reduced over the mesh dimensions the gradients are sharded on: the value
DTensor's norm reduction gives, up to float reordering.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

__all__ = ["ShardAdamW", "build_shard_optimizer", "local", "scale_grads", "shard_grad_norm"]


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``t`` (a view of its storage), or ``t`` itself when it is a plain tensor."""
    return t.to_local() if isinstance(t, DTensor) else t


class ShardAdamW(torch.optim.AdamW):
    """torch's AdamW stepping the local shards of DTensor parameters (see the module's docstring).

    torch's ``Adam.step`` collects each group's parameters, gradients and moments with ``_init_group`` (creating the
    state of a parameter seen for the first time) and hands the lists to its functional ``adam``; this override
    swaps the DTensors in those lists for their local shards, so the same kernels run on the same numbers without
    DTensor's dispatch."""

    def _init_group(self, group, *lists):
        has_complex = super()._init_group(group, *lists)
        for tensors in lists:
            tensors[:] = [local(t) for t in tensors]
        return has_complex


def scale_grads(grads: Sequence[torch.Tensor], coef: float) -> None:
    """Multiply every gradient by ``coef`` in place, on its local shard."""
    for g in grads:
        local(g).mul_(coef)


def shard_grad_norm(grads: Sequence[torch.Tensor]) -> float:
    """The 2-norm of the whole gradient whose shards (DTensors) this rank holds: the sum of squares of the local
    shards, all-reduced (SUM) over each mesh dimension they are sharded on; a plain tensor counts whole. Every rank
    of the mesh must call it (one all-reduce per sharded mesh dimension)."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for g in grads:
        if isinstance(g, DTensor):
            if any(p.is_partial() for p in g.placements):  # a pending reduction: only DTensor knows it
                raise ValueError("shard_grad_norm takes gradients that are Shard or Replicate, not Partial")
            dims = tuple(i for i, p in enumerate(g.placements) if p.is_shard())
            groups.setdefault((g.device_mesh, dims), []).append(g.to_local())
        else:
            groups.setdefault((None, ()), []).append(g)
    total = 0.0
    for (mesh, dims), tensors in groups.items():
        # the per-tensor norms (fp32 or wider), squared and summed: torch's get_total_norm, over this rank's shards
        norms = [torch.linalg.vector_norm(t, 2, dtype=torch.float32) for t in tensors]
        sq = torch.stack(norms).square().sum()
        for d in dims:
            dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=mesh.get_group(d))
        total += float(sq)
    return total**0.5


def build_shard_optimizer(model: torch.nn.Module, cfg) -> tuple[ShardAdamW, torch.optim.lr_scheduler.LambdaLR]:
    """The sharded model state's optimizer: :class:`ShardAdamW` (multi-tensor) and its LambdaLR
    (:func:`flexorch.workers.optim.build_optimizer`)."""
    from flexorch.workers.optim import build_optimizer

    return build_optimizer(model, cfg, foreach=True, cls=ShardAdamW)
