"""The one-worker run that rows d and e stand for: its config, a torch.distributed world of one rank, the decoder
sharded as a worker shards it."""

from __future__ import annotations

import contextlib

import torch.distributed as dist

from .check import Ctx

__all__ = ["one_rank_world", "sharded_model", "train_config"]


@contextlib.contextmanager
def one_rank_world(ctx: Ctx):
    """A torch.distributed world of one rank (FSDP2 needs one), with a worker's backend: gloo + NCCL on CUDA."""
    from flexorch.workers.process_groups import ProcessGroupRegistry

    backend = "cpu:gloo,cuda:nccl" if ctx.cuda else "gloo"
    with ProcessGroupRegistry(
        store=dist.HashStore(), rank=0, world_size=1, epoch=0, backend=backend, timeout_s=ctx.sizes.job_timeout_s
    ) as reg:
        yield reg


def train_config(ctx: Ctx):
    """The run the step and the calibration stand for: one worker, fsdp, bf16, full activation checkpointing."""
    from flexorch.config import CorpusConfig, OptimConfig, PlanSettings, ShardingSettings, TrainConfig

    tpw = ctx.sizes.tokens_per_worker
    return TrainConfig(
        workers=1,
        use_gpu=ctx.cuda,
        run_dir=str(ctx.out),
        model=ctx.sizes.model,
        optim=OptimConfig(lr=1e-4, warmup_steps=1),
        data=CorpusConfig(max_context=tpw),
        plan=PlanSettings(tokens_per_worker=tpw),
        sharding=ShardingSettings(mode="fsdp", precision="bf16", activation_checkpointing="full"),
    )


def sharded_model(ctx: Ctx, cfg):
    """The decoder as a sharded worker builds it (``flexorch.workers.sharded_state.ShardedState._build_sharded``
    and ``_reshard``)."""
    from flexorch.workers.fsdp import build_mesh, fill_initial, sharded_decoder

    mesh = build_mesh("fsdp", 1, None, ctx.device.type)
    model = sharded_decoder(
        cfg.model, mesh, precision="bf16", recompute="full", device=ctx.device if ctx.cuda else None
    )
    fill_initial(model, cfg.model, cfg.seed)
    return model
