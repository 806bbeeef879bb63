"""AdamW with linear warm-up and optional cosine decay, identical on every process.

AdamW with decoupled weight decay (Loshchilov & Hutter, arXiv 1711.05101) applied to weight matrices and
embeddings only (not norm weights); ``foreach=False`` and ``fused=False`` so every replica runs the same
per-parameter loop and stays bitwise in step. The learning rate of optimizer step ``s`` (0-based) is
:func:`lr_at`: linear warm-up over ``warmup_steps``, then cosine (SGDR, Loshchilov & Hutter, arXiv 1608.03983,
eq. 5, one cycle) down to ``min_lr_ratio * lr`` over ``decay_steps`` and constant after, or constant if
``decay_steps`` is None.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable

import torch
from torch import nn

from flexorch.config.optim import OptimConfig

__all__ = ["build_optimizer", "clip_grad_norm_", "lr_at", "lr_factor", "resident_bytes"]


def lr_factor(step: int, cfg: OptimConfig) -> float:
    """Multiplier of ``cfg.lr`` at optimizer step ``step`` (0-based); what ``LambdaLR`` calls."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.decay_steps is None:
        return 1.0
    progress = min((step - cfg.warmup_steps) / cfg.decay_steps, 1.0)
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def lr_at(step: int, cfg: OptimConfig) -> float:
    """Learning rate of optimizer step ``step`` (0-based); bitwise what the scheduler sets for that step."""
    return cfg.lr * lr_factor(step, cfg)


def build_optimizer(
    model: nn.Module, cfg: OptimConfig, *, foreach: bool = False, cls: type[torch.optim.AdamW] = torch.optim.AdamW
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW (weight decay only on >= 2-D parameters) and its LambdaLR; call ``scheduler.step()`` after each
    ``optimizer.step()``. ``foreach``: the multi-tensor implementation (the same math up to float reordering);
    ``cls``: AdamW or a subclass (sharded state: ``flexorch.workers.shard_optim.ShardAdamW``)."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    optimizer = cls(
        [g for g in groups if g["params"]], lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, foreach=foreach, fused=False
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(lr_factor, cfg=cfg))
    return optimizer, scheduler


def clip_grad_norm_(params: Iterable[torch.Tensor], max_norm: float) -> float:
    """Scale gradients in place so their global 2-norm is at most ``max_norm``; returns the norm before."""
    norm = torch.nn.utils.clip_grad_norm_(list(params), max_norm, foreach=False)
    return float(norm)


def resident_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> int:
    """Bytes of model state this worker keeps between steps: its parameters, their gradients and the optimizer's
    state tensors (with FSDP2, the local shards of each: ``DTensor.to_local()``)."""

    def local(t) -> int:
        if not isinstance(t, torch.Tensor):
            return 0
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    total = sum(local(p) + local(p.grad) for p in model.parameters())
    for state in optimizer.state.values() if optimizer is not None else ():
        total += sum(local(v) for v in state.values())
    return total
