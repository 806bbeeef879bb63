"""Optimizer and learning-rate schedule settings (``flexorch.workers.optim`` builds AdamW and its schedule).

Pure data: no torch, so a run file can be read and checked without the data plane.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["OptimConfig"]


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
