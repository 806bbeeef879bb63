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
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["OptimConfig", "build_optimizer", "clip_grad_norm_", "lr_at", "lr_factor"]


def _number(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """Optimizer and learning-rate schedule; validated on construction."""

    lr: float = 3e-3
    """Peak learning rate (reached at the end of warm-up)."""
    weight_decay: float = 0.1
    """Decoupled weight decay on >= 2-D parameters (matrices, embeddings); 0 for norm weights."""
    betas: tuple[float, float] = (0.9, 0.95)
    """Adam's moment decay rates, each in [0, 1)."""
    eps: float = 1e-8
    """Adam's denominator epsilon."""
    warmup_steps: int = 10
    """Steps of linear warm-up: step s uses lr * (s + 1) / warmup_steps."""
    decay_steps: int | None = None
    """Steps of cosine decay after warm-up down to ``min_lr_ratio * lr``; None keeps lr constant."""
    min_lr_ratio: float = 0.1
    """Final learning rate of the cosine decay as a fraction of ``lr``."""
    grad_clip: float | None = 1.0
    """Clip the global gradient 2-norm to this value; None disables clipping."""

    def __post_init__(self) -> None:
        if not _number(self.lr) or self.lr <= 0:
            raise ValueError(f"OptimConfig.lr must be a finite number > 0, got {self.lr!r}")
        if not _number(self.weight_decay) or self.weight_decay < 0:
            raise ValueError(f"OptimConfig.weight_decay must be >= 0, got {self.weight_decay!r}")
        betas = tuple(self.betas) if isinstance(self.betas, list | tuple) else None
        if betas is None or len(betas) != 2 or not all(_number(b) and 0 <= b < 1 for b in betas):
            raise ValueError(f"OptimConfig.betas must be two numbers in [0, 1), got {self.betas!r}")
        object.__setattr__(self, "betas", (float(betas[0]), float(betas[1])))  # a TOML list becomes a tuple
        if not _number(self.eps) or self.eps <= 0:
            raise ValueError(f"OptimConfig.eps must be > 0, got {self.eps!r}")
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"OptimConfig.warmup_steps must be an integer >= 0, got {self.warmup_steps!r}")
        if self.decay_steps is not None and (
            isinstance(self.decay_steps, bool) or not isinstance(self.decay_steps, int) or self.decay_steps < 1
        ):
            raise ValueError(f"OptimConfig.decay_steps must be None or an integer >= 1, got {self.decay_steps!r}")
        if not _number(self.min_lr_ratio) or not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"OptimConfig.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio!r}")
        if self.grad_clip is not None and (not _number(self.grad_clip) or self.grad_clip <= 0):
            raise ValueError(f"OptimConfig.grad_clip must be None or a number > 0, got {self.grad_clip!r}")


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


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW (weight decay only on >= 2-D parameters) and its LambdaLR; call ``scheduler.step()`` after each
    ``optimizer.step()``."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(
        [g for g in groups if g["params"]], lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, foreach=False, fused=False
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(lr_factor, cfg=cfg))
    return optimizer, scheduler


def clip_grad_norm_(params: Iterable[torch.Tensor], max_norm: float) -> float:
    """Scale gradients in place so their global 2-norm is at most ``max_norm``; returns the norm before."""
    norm = torch.nn.utils.clip_grad_norm_(list(params), max_norm, foreach=False)
    return float(norm)
