"""What a worker measures for the driver at start: calibration probes, its device's memory, the activation bytes a
token costs on its model (``flexorch.workers.calibrate``). A component of the worker actor
(``flexorch.workers.actor.Worker``), which answers the driver's calls with it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from flexorch.workers.lora import probing_task
from flexorch.workers.model import init_model
from flexorch.workers.model_source import set_activation_checkpointing
from flexorch.workers.model_state import ModelState, StateSpec
from flexorch.workers.recompute import built_mode

__all__ = ["WorkerMeasurements"]


class WorkerMeasurements:
    """Measures on the worker's model state (``state``) in its current world (``world()``: a
    ``ProcessGroupRegistry``, None between worlds). ``memory``: the device's memory when the worker started, before
    it allocated anything (``workers.devices.device_memory``; None on a CPU)."""

    def __init__(self, spec: StateSpec, state: ModelState, world: Callable[[], Any], memory: dict | None):
        self.spec, self.state, self._world, self._memory = spec, state, world, memory
        self._whole_for_probes = None
        """With sharded pipeline stages: ``(world, whole sharded decoder)`` the probes ran on (:meth:`_probe_model`)."""

    def drop_probe_model(self) -> None:
        """Give back the whole model built for calibration (:meth:`_probe_model`): its world closed, or a step runs
        (calibration is over)."""
        self._whole_for_probes = None

    def probe(self, probes: list) -> list[float]:
        """Run calibration probes (``flexorch.workers.calibrate.Probe``) with every rank of the world; median ms
        each."""
        from flexorch.workers.calibrate import probe_groups, run_probes

        reg = self._world()
        if reg is None:
            raise RuntimeError(f"worker {self.spec.worker_id} has not joined a world")
        n = reg.world_size
        sets = [g for p in probes if p.degree > 1 for g in probe_groups(p, n)]
        reg.ensure(sets)
        world = reg.world if n > 1 else None
        model, vocab = self._probe_model(), self.spec.model_cfg.vocab_size
        with probing_task(model):  # [[tasks]]: probes run through the costliest adapter
            return run_probes(model, probes, reg.rank, n, reg.group, world, vocab, every_rank=self.state.sharded)

    def _probe_model(self):
        """The model probes and measurements run on: this worker's, or with sharded pipeline stages (a stage's
        shard cannot run a whole forward) a whole decoder sharded over the world as ``fsdp`` holds it (a
        collective: every rank builds it), kept for calibration's calls and dropped at the first step or when the
        world closes (:meth:`drop_probe_model`)."""
        spec = self.spec
        if not (self.state.sharded and spec.sharding.get("stages", 1) > 1):
            return self.state.model
        reg = self._world()
        kept = self._whole_for_probes
        if kept is not None and kept[0] is reg:
            return kept[1]
        from flexorch.workers.fsdp import build_mesh, fill_initial, sharded_decoder

        with reg.tracking():  # its mesh's groups are this world's: abort_world must reach their sockets
            mesh = build_mesh("fsdp", reg.world_size, None, "cuda" if spec.device else "cpu")
            sh = spec.sharding
            model = sharded_decoder(
                spec.model_cfg, mesh, precision=sh["precision"], recompute=built_mode(sh), device=spec.device
            )
        fill_initial(model, spec.model_cfg, spec.seed)
        self._whole_for_probes = (reg, model)
        return model

    def recompute_times(self, tokens: int, modes=("none", "full"), repeats: int = 3) -> list[float]:
        """Ms of forward + backward of one document of ``tokens`` tokens in each recompute mode of ``modes``, on this
        worker alone (every rank of the world at once, as calibration's degree-1 probes run; medians of ``repeats``
        after a warm-up), for 'auto' recompute's time model (``flexorch.control.recompute_choice``). Gradients are
        dropped; the model is back in its built mode after."""
        from flexorch.workers.calibrate import Probe

        probe = [Probe(1, "ulysses", (int(tokens),), repeats=repeats)]
        out = []
        model = self._probe_model()
        try:
            for mode in modes:
                set_activation_checkpointing(model, mode)
                out.append(self.probe(probe)[0])
        finally:
            set_activation_checkpointing(model, built_mode(self.spec.sharding))
        return out

    def device_memory(self) -> dict | None:
        """``{"free_at_start", "total"}`` bytes of this worker's CUDA device when it started; None on a CPU."""
        return self._memory

    def activation_bytes_per_token(self, mode: str | None = None) -> float:
        """Activation bytes one token costs on this worker's model, in its own recompute mode or in ``mode``: what
        its forward keeps for the backward, and with recompute ('full', 'selective') also what the backward
        re-creates for one layer at a time (:func:`~flexorch.workers.calibrate.with_recompute_transient`, from a
        second measurement without recompute).

        The measurement is a forward without a backward. On a sharded model that leaves FSDP2's root unit with its
        gathered parameters registered and in its forward state, and the next step would train with the root's
        parameters of one update before (its losses then leave the reference's; calibration makes this call in every
        calibrated run), so the units are put back to their shards after it (``reshard_after_failure``: local, no
        collective)."""
        from flexorch.workers.calibrate import activation_bytes_per_token, with_recompute_transient

        model = self._probe_model()
        built = built_mode(self.spec.sharding)
        mode = mode or built
        vocab = self.spec.model_cfg.vocab_size
        try:
            with probing_task(model):
                set_activation_checkpointing(model, mode)
                kept = activation_bytes_per_token(model, vocab)
                if mode == "none" or not self.spec.model_cfg.num_layers:
                    return kept
                set_activation_checkpointing(model, "none")
                return with_recompute_transient(kept, activation_bytes_per_token(model, vocab), model)
        finally:
            set_activation_checkpointing(model, built)
            self._after_forward_only(model)

    def _after_forward_only(self, model) -> None:
        if self.state.sharded:
            from flexorch.workers.fsdp import reshard_after_failure

            reshard_after_failure(model)

    def stage_activation_bytes(self) -> tuple[float, float]:
        """(bytes per token per layer, bytes per token of the LM head) pipeline stages hold
        (``flexorch.workers.calibrate``)."""
        from flexorch.workers.calibrate import stage_activation_bytes

        cfg, model = self.spec.model_cfg, self.state.model
        if self.state.sharded:  # a stage's shard cannot run alone: measure on a 2-layer model (bytes per layer, head)
            model = init_model(dataclasses.replace(cfg, num_layers=2), self.spec.seed)
        return stage_activation_bytes(model, cfg.vocab_size)
