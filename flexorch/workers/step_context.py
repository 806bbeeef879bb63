"""What every executor of a step needs beside the rank's work and its token blocks, as one value.

A worker builds one :class:`StepContext` per step from the state it holds (``workers.actor.Worker._context``) and
hands it to the executor the work asks for: ``workers.step_exec.run_step`` (SP groups, whole replicas),
``workers.sharded_step.run_sharded_step`` (SP groups, FSDP2 shards) or ``workers.pipeline.executor.run_pipeline_step``
(a pipeline stage). Tests build one by hand to run an executor without Ray.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from flexorch.config.optim import OptimConfig

__all__ = ["GroupGetter", "PROBE_POINTS", "StepContext"]

PROBE_POINTS = ("join", "micro_batch", "before_sync", "after_sync")
"""Where a worker calls its probes (``Worker.add_probe``): joining a world (key: the membership epoch), after a
micro-batch's forward, before the gradient all-reduce, after it (before the optimizer step) (key: the step). The
last three are :attr:`StepContext.hook`'s points."""

GroupGetter = Callable[[tuple[int, ...]], dist.ProcessGroup]
"""``group_of(ranks)``: the process group of a set of ranks, already created for the step's rank sets."""


def _no_hook(point: str) -> None:
    return None


@dataclass
class StepContext:
    """The model state and the world one step runs on."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer | None
    """None: a sharded stage rank that holds no parameters (it only takes part in the collectives)."""
    scheduler: Any
    group_of: GroupGetter
    world: dist.ProcessGroup | None
    """The whole world's group; None when the world has one rank."""
    optim_cfg: OptimConfig
    vocab_size: int
    backend: str | None = None
    """Attention backend for the SP groups (None: the device's default, ``workers.attention.kernels``)."""
    hook: Callable[[str], None] | None = None
    """Called at ``"micro_batch"`` (after each forward), ``"before_sync"`` and ``"after_sync"`` (gradients summed,
    the optimizer not yet stepped); None: nothing is called (a test's probe sets it)."""
    gather: str = "layer"
    """Sharded SP steps: 'layer' or 'step', when FSDP gathers and reduces (``flexorch.config.sharding``)."""
    held: Any = None
    """Pipelined steps on whole replicas: the parts this rank holds (``workers.pipeline.held_params.HeldParams``)."""
    sharded: bool = False
    """Pipelined steps: the stage's parts are FSDP2 units sharded over the stage's workers."""

    def __post_init__(self) -> None:
        if self.hook is None:
            self.hook = _no_hook
