"""The model state's interface: what a worker asks of the model state it holds, whatever its kind.

Two classes implement it: ``workers.replicated_state.ReplicatedState`` (the whole model, or a pipeline stage's parts,
moved whole through the object store) and ``workers.sharded_state.ShardedState`` (FSDP2 shards, re-sharded as each
world forms). The worker actor (``workers.actor.Worker``) holds one, chosen by the run's ``[sharding] mode``, and
never branches on the mode itself. Each kind also moves its state its own way (replicated: :meth:`get_state`,
:meth:`set_state`, :meth:`export_parts`, :meth:`import_parts`; sharded: :meth:`take_handoff`, :meth:`save_sharded`,
:meth:`load_sharded`, :meth:`stage_sharded`; replicated: :meth:`write_state`; either: :meth:`finish_upload`); the
control plane calls those by the run's mode (``control.state_moves``), and the other kind refuses them.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from flexorch.config.model import ModelConfig
from flexorch.config.optim import OptimConfig

__all__ = ["ModelState", "StateSpec"]


@dataclass(frozen=True)
class StateSpec:
    """What a worker's model state is built from, fixed for the worker's life."""

    worker_id: int
    model_cfg: ModelConfig
    optim_cfg: OptimConfig
    seed: int
    sharding: dict
    """``[sharding]`` with its defaults filled in (``mode``, ``shard_size``, ``precision``, ``recompute``...)."""
    device: torch.device | None
    """The worker's CUDA device; None on CPU."""


class ModelState(abc.ABC):
    """The model, its optimizer and schedule, and the optimizer steps applied to them (:attr:`version`).

    ``world`` gives the worker's current world (a ``workers.process_groups.ProcessGroupRegistry``; None between
    worlds); ``guard`` runs a collective on it the way the worker runs its steps (``Worker._guarded``: a failure
    leaves the world and becomes a typed error)."""

    sharded: bool = False
    """Whether the model state is FSDP2 shards."""

    def __init__(self, spec: StateSpec, world: Callable[[], Any], guard: Callable[..., Any]):
        self.spec = spec
        self._world = world
        self._guard = guard
        self.model: torch.nn.Module | None = None
        self.optimizer = None
        self.scheduler = None
        self.version = 0
        """Optimizer steps applied to the state this worker holds."""
        self._upload = None
        """A checkpoint write running on a thread (``workers.checkpoint_writes.BackgroundWrite``), until waited for."""

    @abc.abstractmethod
    def holding(self):
        """What this worker holds of sharded model state, to hand off (None: nothing to move so)."""

    @abc.abstractmethod
    def holdings(self) -> list | None:
        """What this worker holds of sharded model state to re-shard into the next world: its own and any handed to
        it (None: nothing)."""

    @abc.abstractmethod
    def after_join(self, holdings: list | None, initial: bool) -> dict:
        """The new world has formed: bring the model state into it; ``{"version", "newest"}`` and, when it was
        rebuilt, its ``phases_ms`` (``Worker.join_world``)."""

    @abc.abstractmethod
    def after_leave(self) -> None:
        """The world has been left: drop what belonged to it."""

    @abc.abstractmethod
    def sp_executor(self) -> Callable:
        """The SP step's executor for this model state (``workers.step_exec.run_step`` or the sharded one)."""

    @abc.abstractmethod
    def context_fields(self) -> dict:
        """The :class:`~flexorch.workers.step_context.StepContext` fields this model state sets."""

    @abc.abstractmethod
    def parameters_digest(self) -> list:
        """Parameters held, as numpy arrays in state-dict order (tests compare copies and the reference); sharded:
        the whole parameters gathered from the shards (a collective)."""

    def stepped(self) -> None:
        """A step has updated the state: one more optimizer step applied."""
        self.version += 1

    def state_bytes(self) -> int:
        """Bytes of model state this worker keeps between steps (parameters, gradients, optimizer state)."""
        from flexorch.workers.optim import resident_bytes

        return resident_bytes(self.model, self.optimizer)

    def drop_step_memory(self) -> None:
        """After an out-of-memory step: drop the gradients it accumulated and give the allocator's cache back."""
        if self.model is not None:
            self.model.zero_grad(set_to_none=True)
        if self.spec.device is not None:
            torch.cuda.empty_cache()

    def get_state(self) -> dict:
        """Replicated state only (``ReplicatedState.get_state``)."""
        raise self._refused("get_state")

    def set_state(self, state: dict) -> None:
        """Replicated state only (``ReplicatedState.set_state``)."""
        raise self._refused("set_state")

    def export_parts(self, parts: list[str]) -> dict:
        """Replicated state only (``ReplicatedState.export_parts``)."""
        raise self._refused("export_parts")

    def import_parts(self, exported: list) -> int:
        """Replicated state only (``ReplicatedState.import_parts``)."""
        raise self._refused("import_parts")

    def take_handoff(self, handed: list) -> int:
        """Sharded state only (``ShardedState.take_handoff``)."""
        raise self._refused("take_handoff")

    def save_sharded(self, directory: str) -> None:
        """Sharded state only (``ShardedState.save_sharded``)."""
        raise self._refused("save_sharded")

    def stage_sharded(self, directory: str) -> None:
        """Sharded state only (``ShardedState.stage_sharded``)."""
        raise self._refused("stage_sharded")

    def write_state(self, directory: str, background: bool) -> dict[str, str] | None:
        """Replicated state only (``ReplicatedState.write_state``)."""
        raise self._refused("write_state")

    def finish_upload(self, timeout_s: float | None = None) -> dict:
        """What the checkpoint write in the background (:meth:`write_state` or :meth:`stage_sharded`) wrote, once
        it is done (a replicated state: each file's SHA-256; a sharded one: its files' too); raises why it
        failed. Nothing in flight: ``{}``."""
        upload, self._upload = self._upload, None
        return {} if upload is None else upload.wait(timeout_s)

    def load_sharded(self, directory: str) -> int:
        """Sharded state only (``ShardedState.load_sharded``)."""
        raise self._refused("load_sharded")

    def _refused(self, method: str) -> TypeError:
        kind = "sharded" if self.sharded else "replicated"
        return TypeError(f"worker {self.spec.worker_id} holds {kind} model state: it has no {method}")
