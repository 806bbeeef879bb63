"""A real NCCL world of one on a GPU: bound to its device, used eagerly, aborted and formed again
(``test_devices_nccl.py`` runs the same branches on CPU against fakes); skipped without CUDA and NCCL."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from flexorch.workers.devices import pin_device
from flexorch.workers.process_groups import ProcessGroupRegistry


@pytest.mark.gpu
@pytest.mark.skipif(
    not (torch.cuda.is_available() and dist.is_nccl_available()), reason="needs CUDA and NCCL (a GPU machine)"
)
def test_real_nccl_world_is_bound_eager_and_aborts():
    device = pin_device(True)
    assert torch.cuda.current_device() == device.index
    try:
        reg = ProcessGroupRegistry(store=dist.HashStore(), rank=0, world_size=1, epoch=0, timeout_s=30, device=device)
        assert reg.backend == "cpu:gloo,cuda:nccl"
        assert dist.group.WORLD.bound_device_id == device
        x = torch.ones(4, device=device)
        dist.all_reduce(x, group=reg.world)
        cpu = torch.ones(2)
        dist.all_reduce(cpu, group=reg.world)  # CPU tensors still go to gloo
        assert x.sum().item() == 4.0 and cpu.sum().item() == 2.0
        reg.close(abort=True)
        assert not dist.is_initialized()
        with ProcessGroupRegistry(store=dist.HashStore(), rank=0, world_size=1, epoch=1, device=device) as reg:
            y = torch.ones(1, device=device)
            dist.all_reduce(y, group=reg.world)
            assert y.item() == 1.0
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
