"""A worker's replicated model state (``[sharding] mode = "replicate"``): the whole model, or with pipeline stages
and ``[pipeline] params = "stage"`` the parts this worker holds (``flexorch.workers.pipeline.held_params``), copied
whole to and from other workers and checkpoints through the object store.

:class:`ReplicatedState` implements the model-state interface (``workers.model_state.ModelState``); the sharded
counterpart is ``flexorch.workers.sharded_state``. It builds the ``model``, ``optimizer``, ``scheduler`` and
``held`` at once and keeps them for the worker's life; a new world leaves them as they are.
"""

from __future__ import annotations

import torch

from flexorch.work.placement import ALL
from flexorch.workers.compile import compile_layers, wants_compile
from flexorch.workers.model_source import build_model, set_activation_checkpointing
from flexorch.workers.model_state import ModelState
from flexorch.workers.optim import build_optimizer
from flexorch.workers.pipeline.held_params import HeldParams
from flexorch.workers.recompute import built_mode
from flexorch.workers.step_exec import run_step

__all__ = ["ReplicatedState"]


class ReplicatedState(ModelState):
    """Replicated model state (see the module's docstring)."""

    def __init__(self, spec, world, guard):
        super().__init__(spec, world, guard)
        self.model = build_model(spec.model_cfg, spec.seed)
        set_activation_checkpointing(self.model, built_mode(spec.sharding))
        if spec.device is not None:
            self.model.to(spec.device)
        if wants_compile(spec.model_cfg.compile, spec.device):
            compile_layers(self.model)
        self.optimizer, self.scheduler = build_optimizer(self.model, spec.optim_cfg)
        self.held = HeldParams(self.model, self.optimizer)  # the whole model until a stage-local step drops parts
        self._staging = None
        """Host buffers of asynchronous checkpoints (``workers.host_staging.HostStaging``), made at the first."""

    def holding(self):
        return None  # a replica moves whole, through the driver (get_state, export_parts), never re-sharded

    def holdings(self) -> list | None:
        return None

    def after_join(self, holdings, initial: bool) -> dict:
        return {"version": self.version, "newest": self.version}  # the replica is unchanged by a new world

    def after_leave(self) -> None:
        return None

    def sp_executor(self):
        return run_step

    def context_fields(self) -> dict:
        return {"held": self.held}  # stage-local parameters: the parts this worker holds

    def parameters_digest(self) -> list:
        held = set(self.held.held_names())
        return [(k, v.detach().cpu().numpy().copy()) for k, v in self.model.state_dict().items() if k in held]

    def get_state(self) -> dict:
        """Model, optimizer, schedule and RNG state (CPU tensors), for checkpoints and new workers. With stage-local
        parameters only the parts held (``parts``; None: the whole model) and their optimizer state."""
        state = self._live_state()
        return {**state, "model": _to_cpu(state["model"]), "optimizer": _to_cpu(state["optimizer"])}

    def _live_state(self) -> dict:
        """:meth:`get_state`'s tree with the live tensors themselves (no copies)."""
        held = set(self.held.held_names())
        return {
            "model": {k: v.detach() for k, v in self.model.state_dict().items() if k in held},
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "rng": torch.get_rng_state(),
            "parts": None if self.held.held is ALL else sorted(self.held.held),
        }

    def write_state(self, directory: str, background: bool) -> dict[str, str] | None:
        """Write this worker's whole state into the checkpoint directory ``directory`` as ``model.pt`` and
        ``train_state.pt`` (``workers.checkpoint_writes``): their SHA-256 now, or with ``background`` None at once,
        the write on a thread from a copy in host buffers kept from save to save (``workers.host_staging``), so
        training may go on (:meth:`finish_upload` waits for it; one still running is waited for first)."""
        from flexorch.workers.checkpoint_writes import BackgroundWrite, write_state_files
        from flexorch.workers.host_staging import HostStaging

        if self.held.held is not ALL:
            raise RuntimeError(f"worker {self.spec.worker_id} holds only some parts of the model: it cannot write it")
        if self._upload is not None:
            self.finish_upload()
        if not background:  # nothing runs meanwhile: the live tensors are written as they are (from a GPU: copies)
            return write_state_files(
                directory, self.get_state() if self.spec.device is not None else self._live_state()
            )
        if self._staging is None:
            self._staging = HostStaging()
        state = self._staging.copy(self._live_state())
        self._upload = BackgroundWrite(lambda: write_state_files(directory, state), directory)
        return None

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
