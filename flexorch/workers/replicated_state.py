"""A worker's replicated model state (``[sharding] mode = "replicate"``): the whole model, or with pipeline stages
and ``[pipeline] params = "stage"`` the parts this worker holds (``flexorch.workers.pipeline.held_params``), copied
whole to and from other workers and checkpoints through the object store.

:class:`ReplicatedState` is a part of :class:`~flexorch.workers.actor.Worker` (a base class); the sharded
counterpart is ``flexorch.workers.sharded_state``. It uses the worker's ``model``, ``optimizer``, ``scheduler``,
``held`` and ``version``.
"""

from __future__ import annotations

import torch

from flexorch.work.placement import ALL

__all__ = ["ReplicatedState"]


class ReplicatedState:
    """Replicated model state, as methods of the worker (see the module's docstring)."""

    def get_state(self) -> dict:
        """Model, optimizer, schedule and RNG state (CPU tensors), for checkpoints and new workers. With stage-local
        parameters only the parts held (``parts``; None: the whole model) and their optimizer state."""
        held = set(self.held.held_names())
        return {
            "model": {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items() if k in held},
            "optimizer": _to_cpu(self.optimizer.state_dict()),
            "scheduler": self.scheduler.state_dict(),
            "rng": torch.get_rng_state(),
            "parts": None if self.held.held is ALL else sorted(self.held.held),
        }

    def set_state(self, state: dict) -> None:
        """Take ``state`` (whole or partial, from :meth:`get_state` or a checkpoint): hold exactly its parts."""
        self.held.set_from(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng"])
        self.version = int(self.scheduler.last_epoch)

    def export_parts(self, parts: list[str]) -> dict:
        """The parameters and optimizer state of ``parts`` (``flexorch.work.placement``), for another worker."""
        return self.held.export(set(parts))

    def import_parts(self, exported: list) -> int:
        """Hold the parts of ``exported`` (refs to :meth:`export_parts` results); returns the bytes received
        (parameters and their optimizer state)."""
        import ray  # the actor's object store (this module imports without Ray)

        got = ray.get(list(exported))  # refs nested in a list arrive unresolved
        for item in got:
            self.held.load(item)
        tensors = [t for item in got for v in item.values() for t in (v["data"], *v["state"].values())]
        return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def _to_cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().clone()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj
