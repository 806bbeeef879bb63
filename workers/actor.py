"""The worker actor: one per device (a GPU, or a CPU slot), holding a model replica and its optimizer.

The driver creates N of these in a placement group, tells them the world to join (rendezvous on the driver's
TCPStore, one world per membership epoch), and sends each one its :class:`~workers.step_task.StepTask` plus the
object refs of the token blocks its documents live in. The actor builds the process groups the plan names
(collectively, in the same order on every rank), runs its micro-batches and steps the optimizer. One thread
per worker on CPU (DESIGN.md §7).
"""

from __future__ import annotations

import os
import socket
import time

import ray
import torch
import torch.distributed as dist

from workers.model import ModelConfig, init_model
from workers.optim import OptimConfig, build_optimizer
from workers.process_groups import ProcessGroupRegistry
from workers.step_exec import StepOutcome, run_step
from workers.step_task import StepTask

__all__ = ["WorkerActor", "Worker"]


class Worker:
    """The worker's state and methods, usable in-process (tests) or as a Ray actor (:data:`WorkerActor`)."""

    def __init__(self, worker_id: int, model_cfg: dict, optim_cfg: dict, seed: int, num_threads: int = 1):
        if num_threads > 0:
            torch.set_num_threads(num_threads)
        self.worker_id = worker_id
        self.model_cfg = ModelConfig.from_dict(model_cfg)
        self.optim_cfg = OptimConfig(**optim_cfg)
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        self.model = init_model(self.model_cfg, seed)
        if self.device is not None:
            self.model.to(self.device)
        self.optimizer, self.scheduler = build_optimizer(self.model, self.optim_cfg)
        self.registry: ProcessGroupRegistry | None = None
        self._store: dist.Store | None = None

    def info(self) -> dict:
        """Where this worker runs."""
        return {
            "worker_id": self.worker_id,
            "pid": os.getpid(),
            "hostname": socket.gethostname(),
            "node_id": ray.get_runtime_context().get_node_id() if ray.is_initialized() else None,
            "device": str(self.device or "cpu"),
        }

    def join_world(self, host: str, port: int, rank: int, world_size: int, epoch: int, timeout_s: float) -> float:
        """Join the torch.distributed world of membership ``epoch`` (blocks until every rank joined)."""
        t0 = time.perf_counter()
        self.leave_world()
        self._store = dist.TCPStore(host, port, is_master=False, timeout=_td(timeout_s))
        self.registry = ProcessGroupRegistry(
            store=self._store, rank=rank, world_size=world_size, epoch=epoch, timeout_s=timeout_s
        )
        return time.perf_counter() - t0

    def leave_world(self) -> None:
        if self.registry is not None:
            self.registry.close()
            self.registry = None
        self._store = None

    def run_step(self, task: StepTask, block_refs: dict) -> StepOutcome:
        """Run this rank's part of a step. ``block_refs`` maps block index -> ObjectRef of an int32 token array."""
        if self.registry is None or self.registry.rank != task.rank or self.registry.world_size != task.world_size:
            raise RuntimeError(f"worker {self.worker_id} is not rank {task.rank} of a world of {task.world_size}")
        keys = sorted(block_refs)
        values = ray.get([block_refs[k] for k in keys]) if keys else []  # refs nested in a dict arrive unresolved
        blocks = dict(zip(keys, values, strict=True))
        self.registry.ensure(task.rank_sets)
        world = self.registry.world if task.world_size > 1 else None
        return run_step(
            self.model,
            self.optimizer,
            self.scheduler,
            task,
            blocks,
            self.registry.group,
            world,
            self.optim_cfg,
            vocab_size=self.model_cfg.vocab_size,
        )

    def probe(self, probes: list) -> list[float]:
        """Run calibration probes (``workers.calibrate.Probe``) with every rank of the world; median ms each."""
        from workers.calibrate import run_probes

        reg = self.registry
        if reg is None:
            raise RuntimeError(f"worker {self.worker_id} has not joined a world")
        n = reg.world_size
        sets = [
            tuple(range(f, f + p.degree)) for p in probes if p.degree > 1 for f in range(0, n - n % p.degree, p.degree)
        ]
        reg.ensure(sets)
        world = reg.world if n > 1 else None
        return run_probes(self.model, probes, reg.rank, n, reg.group, world, self.model_cfg.vocab_size)

    def activation_bytes_per_token(self) -> float:
        from workers.calibrate import activation_bytes_per_token

        return activation_bytes_per_token(self.model, self.model_cfg.vocab_size)

    def get_state(self) -> dict:
        """Model, optimizer, schedule and RNG state (CPU tensors), for checkpoints and new workers."""
        return {
            "model": {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()},
            "optimizer": _to_cpu(self.optimizer.state_dict()),
            "scheduler": self.scheduler.state_dict(),
            "rng": torch.get_rng_state(),
        }

    def set_state(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng"])

    def parameters_digest(self) -> list:
        """Parameters as numpy arrays in state-dict order (tests compare replicas and the reference)."""
        return [(k, v.detach().cpu().numpy().copy()) for k, v in self.model.state_dict().items()]


def _to_cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().clone()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def _td(seconds: float):
    from datetime import timedelta

    return timedelta(seconds=seconds)


WorkerActor = ray.remote(Worker)
"""``Worker`` as a Ray actor class; the driver sets resources with ``.options(num_cpus=..., num_gpus=...)``."""
