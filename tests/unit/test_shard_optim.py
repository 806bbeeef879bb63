"""The sharded state's optimizer steps the local shards (``flexorch.workers.shard_optim``): bitwise what torch's AdamW
computes on the same DTensors, its state still DTensors (what DCP and the re-shard read), and the shard norm what
DTensor's norm gives; on a real one-rank gloo world with FSDP2 (the cross-rank reduction runs in
test_dataplane_without_ray's two-rank sharded parts and every fsdp/hsdp run checked against the reference)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial

from flexorch.config import OptimConfig
from flexorch.workers.fsdp import build_mesh, forget_closed_meshes
from flexorch.workers.optim import build_optimizer
from flexorch.workers.process_groups import ProcessGroupRegistry
from flexorch.workers.shard_optim import ShardAdamW, build_shard_optimizer, scale_grads, shard_grad_norm


def _sharded_mlp(mesh, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 3), nn.LayerNorm(3))
    for unit in (model[0], model[2], model):
        fully_shard(unit, mesh=mesh)
    return model


@pytest.mark.parametrize("mode", ["fsdp", "hsdp"])
def test_shard_adamw_steps_bitwise_like_adamw_on_dtensors_and_keeps_dtensor_state(mode):
    cfg = OptimConfig(lr=0.05, weight_decay=0.1, warmup_steps=1)
    try:
        with ProcessGroupRegistry(
            store=dist.HashStore(), rank=0, world_size=1, epoch=0, backend="gloo", timeout_s=10
        ) as reg:
            reg.ensure([(0,)])
            mesh = build_mesh(mode, 1, 1, "cpu")
            plain, shard = _sharded_mlp(mesh, 3), _sharded_mlp(mesh, 3)
            opt_plain, _ = build_optimizer(plain, cfg, foreach=True)
            opt_shard, _ = build_shard_optimizer(shard, cfg)
            assert isinstance(opt_shard, ShardAdamW) and opt_shard.param_groups[0]["foreach"]
            gen = torch.Generator().manual_seed(0)
            for step in range(3):
                x = torch.randn(5, 6, generator=gen)
                for model in (plain, shard):
                    model(x).square().sum().backward()
                grads = [p.grad for p in plain.parameters()]
                want = float(torch.nn.utils.get_total_norm(grads, foreach=False).full_tensor())
                got = shard_grad_norm([p.grad for p in shard.parameters()])
                assert got == pytest.approx(want, rel=1e-6) and got > 0
                for g in grads:
                    g.mul_(0.5)
                scale_grads([p.grad for p in shard.parameters()], 0.5)
                opt_plain.step()
                opt_shard.step()
                for a, b in zip(plain.parameters(), shard.parameters(), strict=True):
                    assert isinstance(b, DTensor) and torch.equal(a.to_local(), b.to_local()), step
                for opt in (opt_plain, opt_shard):
                    opt.zero_grad(set_to_none=True)
                if step == 1:
                    forget_closed_meshes()  # a new world's first step: nothing cached, the same numbers
            for p in shard.parameters():
                state = opt_shard.state[p]
                assert isinstance(state["exp_avg"], DTensor) and isinstance(state["exp_avg_sq"], DTensor)
                assert float(state["step"]) == 3.0
            a_state, b_state = opt_plain.state_dict()["state"], opt_shard.state_dict()["state"]
            for k in a_state:
                assert torch.equal(a_state[k]["exp_avg_sq"].to_local(), b_state[k]["exp_avg_sq"].to_local())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        forget_closed_meshes()


def test_shard_grad_norm_counts_plain_tensors_whole_and_refuses_a_pending_reduction():
    assert shard_grad_norm([torch.tensor([3.0]), torch.tensor([4.0])]) == pytest.approx(5.0)
    try:
        with ProcessGroupRegistry(
            store=dist.HashStore(), rank=0, world_size=1, epoch=0, backend="gloo", timeout_s=10
        ) as reg:
            reg.ensure([(0,)])
            mesh = build_mesh("fsdp", 1, None, "cpu")
            partial = DTensor.from_local(torch.ones(2), mesh, [Partial()])
            with pytest.raises(ValueError, match="not Partial"):
                shard_grad_norm([partial])
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        forget_closed_meshes()
