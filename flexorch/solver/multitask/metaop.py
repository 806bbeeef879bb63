"""Tasks and MetaOps: the units Spindle allocates devices to (arXiv 2409.03365, §3 "MetaOp", §4.1).

Spindle contracts a multi-task model's operator graph into MetaOps, runs of identical operators of one task, each
with a time that depends on the devices it gets. flexorch's setting is one base model of L layers shared by several
fine-tuning tasks, each with its own batch (its own length distribution) and its own trainable part:

* MetaOp level 0 of task t: the task's pass through the L shared layers, with its adapter's extra per-token cost;
* MetaOp level 1 (when ``head_layers > 0``): the task's own extra layers (same layer shape, no adapter).

A task's MetaOps run in level order. ``MetaOp.layer_ms[k]`` is T_m(2^k), the time of one layer on 2^k devices
(``sp_estimate.layer_times_ms``), non-increasing in the device count; ``inf`` where it cannot run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from flexorch.solver.errors import PlanningError
from flexorch.solver.multitask.sp_estimate import layer_times_ms
from flexorch.solver.profiles import Profile

__all__ = ["TaskBatch", "MetaOp", "build_metaops"]


@dataclass(frozen=True, kw_only=True)
class TaskBatch:
    """One task's share of a step."""

    name: str
    """Shown in plans and reports."""
    lengths: tuple[int, ...]
    """Token counts of the task's sequences in this step."""
    adapter_rank: int = 0
    """Rank r of the task's LoRA adapter on the shared layers (0: no adapter)."""
    head_layers: int = 0
    """Layers of the task's own (a second MetaOp after the shared layers; 0: none)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "lengths", tuple(int(s) for s in self.lengths))
        if not self.lengths or min(self.lengths) < 1:
            raise PlanningError(f"task {self.name!r} needs at least one sequence of >= 1 token, got {self.lengths[:5]}")
        if self.adapter_rank < 0 or self.head_layers < 0:
            raise PlanningError(
                f"task {self.name!r}: adapter_rank={self.adapter_rank} and head_layers={self.head_layers} must be >= 0"
            )


@dataclass(frozen=True, kw_only=True)
class MetaOp:
    """A run of `layers` identical layers of one task, with its time per layer on 1, 2, 4, ... devices."""

    task: int
    """Index of the task."""
    level: int
    """Position in the task's chain: level 0 runs before level 1."""
    layers: int
    """L_m: how many identical layers."""
    layer_ms: tuple[float, ...]
    """T_m(2^k) for k = 0, 1, ...: ms per layer on 2^k devices; non-increasing; inf where it cannot run."""
    name: str = ""

    def __post_init__(self) -> None:
        t = tuple(float(x) for x in self.layer_ms)
        object.__setattr__(self, "layer_ms", t)
        where = f"MetaOp {self.name or (self.task, self.level)}"
        if self.layers < 1 or self.task < 0 or self.level < 0:
            raise PlanningError(f"{where}: layers={self.layers} must be >= 1, task and level >= 0")
        if not t or not math.isfinite(t[-1]) or min(t) <= 0:
            raise PlanningError(f"{where}: layer_ms={t} must be > 0 and finite on the most devices")
        if any(b > a for a, b in zip(t, t[1:], strict=False)):
            raise PlanningError(f"{where}: layer_ms={t} must be non-increasing in the device count")

    @property
    def counts(self) -> tuple[int, ...]:
        """The valid device counts 1, 2, 4, ... this MetaOp's table covers."""
        return tuple(1 << k for k in range(len(self.layer_ms)))

    @property
    def min_count(self) -> int:
        """The fewest devices that can run it."""
        return next(c for c, t in zip(self.counts, self.layer_ms, strict=True) if math.isfinite(t))

    def time_ms(self, count: int, layers: int | None = None) -> float:
        """Time of `layers` (default all) of its layers on `count` devices (a power of two in `counts`)."""
        k = int(count).bit_length() - 1
        if count < 1 or count != 1 << k or k >= len(self.layer_ms):
            raise PlanningError(f"{self.name or 'MetaOp'}: {count} devices is not one of {self.counts}")
        return (self.layers if layers is None else layers) * self.layer_ms[k]


def build_metaops(tasks, num_devices: int, profile: Profile) -> tuple[MetaOp, ...]:
    """The MetaOps of `tasks` (level 0: the shared layers with the adapter; level 1: the task's own layers)."""
    out = []
    for i, task in enumerate(tasks):
        shared = layer_times_ms(task.lengths, num_devices, profile, task.adapter_rank)
        if not math.isfinite(shared[-1]):
            raise PlanningError(
                f"task {task.name!r}: its longest sequence ({max(task.lengths)} tokens) does not fit on "
                f"{num_devices} devices ({profile.tokens_per_device} tokens per device); shorten it or add devices"
            )
        out.append(MetaOp(task=i, level=0, layers=profile.num_layers, layer_ms=shared, name=f"{task.name}/shared"))
        if task.head_layers:
            own = shared if task.adapter_rank == 0 else layer_times_ms(task.lengths, num_devices, profile)
            out.append(MetaOp(task=i, level=1, layers=task.head_layers, layer_ms=own, name=f"{task.name}/head"))
    return tuple(out)
