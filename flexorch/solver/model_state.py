"""Model-state bytes per worker under each sharding mode: the figure the planner subtracts from a worker's memory.

Resident state is what a worker keeps between steps: fp32 parameters, their fp32 gradients and AdamW's two fp32
moments, 16 bytes per parameter it holds (ZeRO, Rajbhandari et al., arXiv 1910.02054, Sec. 3: "K = 12" optimizer
bytes plus the parameter and its gradient; here with fp32 weights, so 4 + 4 + 8). Under FSDP2 (``fully_shard``)
every parameter is split on dim 0 into ``shards`` chunks of ``ceil(rows / shards)`` rows (``torch.chunk``), so
the largest share is the first rank's, and that is the figure here (a worker never holds more).

In flight during a step (sharded modes only): the root unit (embedding, final norm, LM head) stays gathered from
its forward to its backward, and one decoder layer at a time is gathered, each with its unsharded gradient before
the reduce-scatter (in ``param_bytes`` for the weights, fp32 for the gradient).

A frozen parameter (``[model] base_trainable = false``: the base under the tasks' LoRA adapters) keeps only its
weight: no gradient, no moments (4 bytes resident, and in flight its gathered weight without a gradient).

Pure: shapes in, bytes out (the config's ``ModelConfig.param_shapes`` gives the shapes).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["ModelStateBytes", "model_state_bytes", "shard_rows"]

STATE_BYTES_PER_PARAM = 16  # fp32 weight + fp32 gradient + two fp32 AdamW moments
FROZEN_BYTES_PER_PARAM = 4  # the fp32 weight alone
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")  # ours: layers.3.x; Hugging Face: model.layers.3.x


def shard_rows(rows: int, shards: int, index: int) -> tuple[int, int]:
    """Rows ``[start, stop)`` of dim 0 that shard ``index`` of ``shards`` holds (FSDP2's ``torch.chunk`` split:
    chunks of ``ceil(rows / shards)``, the last ones shorter or empty)."""
    if shards < 1 or not 0 <= index < shards:
        raise ValueError(f"need 0 <= index < shards, got index={index} shards={shards}")
    step = math.ceil(rows / shards)
    return min(index * step, rows), min((index + 1) * step, rows)


@dataclass(frozen=True)
class ModelStateBytes:
    resident: float
    """Parameters, gradients and optimizer moments a worker keeps (the most any worker keeps)."""
    in_flight: float
    """Gathered parameters and unsharded gradients during a step (0 with whole replicas)."""

    @property
    def total(self) -> float:
        return self.resident + self.in_flight


def _numel(shape: Sequence[int]) -> int:
    return math.prod(shape)


def model_state_bytes(
    shapes: Sequence[tuple[str, Sequence[int]]],
    shards: int,
    *,
    sharded: bool,
    param_bytes: int = 4,
    gather: str = "layer",
    frozen: Callable[[str], bool] | None = None,
) -> ModelStateBytes:
    """Model-state bytes of the worker holding the most, for parameters ``shapes`` (``(name, shape)``; decoder
    layers named ``layers.<i>.``, or ``model.layers.<i>.`` in a Hugging Face model) split over ``shards`` workers;
    ``sharded`` False: whole replicas. ``gather`` 'step': every layer stays gathered, with its whole gradient, for
    the whole step. ``frozen(name)``: the parameter does not train (weight only)."""
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    frozen = frozen or (lambda name: False)

    def per(name: str) -> int:
        return FROZEN_BYTES_PER_PARAM if frozen(name) else STATE_BYTES_PER_PARAM

    if not sharded:
        return ModelStateBytes(float(sum(per(n) * _numel(s) for n, s in shapes)), 0.0)
    resident = 0
    units: dict[str, float] = {}
    for name, shape in shapes:
        start, stop = shard_rows(shape[0], shards, 0)
        resident += per(name) * (stop - start) * _numel(shape[1:])
        m = _LAYER.search(name)
        unit = f"layers.{m.group(1)}" if m else "root"
        gathered = param_bytes + (0 if frozen(name) else 4)  # the gathered weight and its unsharded fp32 gradient
        units[unit] = units.get(unit, 0) + _numel(shape) * gathered
    root = units.pop("root", 0)
    layer = max(units.values(), default=0) if gather == "layer" else sum(units.values())
    return ModelStateBytes(float(resident), float(root + layer))
