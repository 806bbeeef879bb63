"""A worker's sharded model state (``[sharding] mode`` fsdp or hsdp, FSDP2): built for each world as it forms and
re-sharded from what the members hold (``flexorch.workers.reshard``), written to and read from sharded checkpoints
(``torch.distributed.checkpoint``), and taken from a worker that leaves when its node is drained
(``Worker.hand_off`` gives, :meth:`ShardedState.take_handoff` takes).

:class:`ShardedState` implements the model-state interface (``workers.model_state.ModelState``); the replicated
counterpart is ``flexorch.workers.replicated_state``. Its collectives run on the world the worker gives it, under the
worker's guard. It imports without Ray; DTensor (slow to import) only when a world forms.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from flexorch.workers.errors import PeerLostError
from flexorch.workers.model_state import ModelState
from flexorch.workers.recompute import built_mode

__all__ = ["ShardedState", "holding_bytes"]


class ShardedState(ModelState):
    """Sharded model state (see the module's docstring). The model is None until the first world forms."""

    sharded = True

    def __init__(self, spec, world, guard):
        super().__init__(spec, world, guard)
        self._handed: list = []
        """Holdings handed to this worker by workers that left (:meth:`take_handoff`), until a re-shard takes them."""
        self._positions: dict = {}

    def holding(self):
        return self._holding()

    def holdings(self) -> list | None:
        return [h for h in (self._holding(), *self._handed) if h is not None] or None

    def after_join(self, holdings, initial: bool) -> dict:
        out = self._guard(self._reshard, holdings, initial)
        if out["version"] is not None:
            self._handed = []  # re-sharded into this world: the handed holdings are in it now
        return out

    def after_leave(self) -> None:
        from flexorch.workers.fsdp import forget_closed_meshes

        forget_closed_meshes()  # DTensor's caches would give the closed world's meshes to the next one

    def sp_executor(self):
        from flexorch.workers.sharded_step import run_sharded_step

        return run_sharded_step

    def context_fields(self) -> dict:
        return {"sharded": True, "gather": self.spec.sharding.get("gather", "layer")}

    def parameters_digest(self) -> list:
        from flexorch.workers.fsdp import gathered_parameters

        return self._guard(gathered_parameters, self.model)

    def take_handoff(self, handed: list) -> int:
        """Keep the holdings of workers that are leaving (refs to their ``hand_off``) until the next world's
        re-shard takes them in (``Worker.join_world``); returns the bytes received. A holding that is gone (its node
        went first) is a :class:`PeerLostError`: the driver's recovery sorts out who is left."""
        import ray  # the actor's object store (this module imports without Ray)

        try:
            got = ray.get(list(handed))  # refs nested in a list arrive unresolved: fetched now, before the leavers go
        except ray.exceptions.RayError as e:
            raise PeerLostError(
                f"worker {self.spec.worker_id}: a handed-off shard is gone ({str(e).splitlines()[0]})"
            ) from None
        self._handed = [*self._handed, *got]
        return sum(holding_bytes(h) for h in got)

    def _holding(self):
        if self.model is None:
            return None
        from flexorch.workers.reshard import holding_of

        return holding_of(self.model, self.optimizer, self.scheduler, self.version, self._positions)

    def _reshard(self, holding, initial: bool) -> dict:
        from flexorch.workers.fsdp import fill_initial, shard_position
        from flexorch.workers.reshard import exchange

        reg = self._world()
        t0 = time.perf_counter()
        with reg.tracking():  # the mesh's groups are this world's too: abort_world must reach their sockets
            self.model = self._build_sharded()
        params = list(self.model.parameters())
        from flexorch.workers.shard_optim import build_shard_optimizer

        opt = build_shard_optimizer(self.model, self.spec.optim_cfg) if params else (None, None)
        self.optimizer, self.scheduler = opt
        self._positions = {n: shard_position(p) for n, p in self.model.named_parameters()}
        t_built = time.perf_counter()
        if initial:
            fill_initial(self.model, self.spec.model_cfg, self.spec.seed)
            self.version = 0
            phases = _phases(build=t_built - t0, fill=time.perf_counter() - t_built)
            return {"version": 0, "newest": 0, "phases_ms": phases}
        newest = [None] * reg.world_size
        mine = max((h.version for h in holding), default=None) if holding is not None else None
        dist.all_gather_object(newest, mine, group=reg.world)
        shapes = self.spec.model_cfg.param_shapes()
        version = exchange(holding, self.model, self.optimizer, self.scheduler, reg.world, shapes)
        if version is not None:
            self.version = version
        newest_v = max((v for v in newest if v is not None), default=None)
        phases = _phases(build=t_built - t0, exchange=time.perf_counter() - t_built)
        return {"version": version, "newest": newest_v, "phases_ms": phases}

    def _build_sharded(self):
        """This world's sharded decoder: over the whole mesh, or (pipeline stages) this rank's stage's parts over
        the stage's workers (stage r is ranks ``[r*d, (r+1)*d)``, ``d = world // stages``, as the planner maps
        them; ranks left over hold nothing)."""
        from flexorch.solver.pipeline.stage_model import stage_layers
        from flexorch.workers.fsdp import build_mesh, sharded_decoder, stage_sharded_decoder

        reg, spec = self._world(), self.spec
        sh, cfg = spec.sharding, spec.model_cfg
        device_type = "cuda" if spec.device else "cpu"
        stages = sh.get("stages", 1)
        if stages == 1:
            mesh = build_mesh(sh["mode"], reg.world_size, sh["shard_size"], device_type)
            return sharded_decoder(
                cfg,
                mesh,
                precision=sh["precision"],
                recompute=built_mode(sh),
                device=spec.device,
            )
        from torch.distributed.device_mesh import DeviceMesh

        d = reg.world_size // stages
        sets = [tuple(range(r * d, (r + 1) * d)) for r in range(stages)]
        reg.ensure(sets)  # every rank, the same sets (a collective)
        stage = reg.rank // d if reg.rank < stages * d else None
        if stage is None:
            return _NoParams()
        layers = stage_layers(cfg.num_layers, stages)
        first = sum(layers[:stage])
        mesh = DeviceMesh.from_group(reg.group(sets[stage]), device_type, mesh_dim_names=("shard",))
        return stage_sharded_decoder(
            cfg, mesh, first, first + layers[stage], is_first=stage == 0, is_last=stage == stages - 1,
            precision=sh["precision"], device=spec.device,
        )  # fmt: skip

    def save_sharded(self, directory: str) -> None:
        """Write this worker's shard of the model and optimizer state into ``directory`` (a collective over the
        world: ``torch.distributed.checkpoint``, one file per worker; ``flexorch.workers.sharded_checkpoint``)."""
        from flexorch.workers.sharded_checkpoint import save_sharded

        self._guard(save_sharded, directory, self.model, self.optimizer, self.scheduler, self.version)

    def stage_sharded(self, directory: str) -> None:
        """Stage this worker's shard in host memory (a collective, as :meth:`save_sharded`) and copy it to
        ``directory`` in the background (``sharded_checkpoint.stage_sharded``); :meth:`finish_upload` waits for it.
        A copy still running from the save before is waited for first (at most one in flight)."""
        from flexorch.workers.shard_staging import stage_sharded

        if self._upload is not None:
            self.finish_upload()
        self._upload = self._guard(stage_sharded, directory, self.model, self.optimizer, self.scheduler, self.version)

    def load_sharded(self, directory: str) -> int:
        """Load a sharded checkpoint written on any number of workers (a collective: each worker reads the rows
        of its shard); returns the state version loaded."""
        from flexorch.workers.sharded_checkpoint import load_sharded

        self.version = self._guard(load_sharded, directory, self.model, self.optimizer, self.scheduler)
        return self.version


class _NoParams(torch.nn.Module):
    """What a rank on no pipeline stage holds of a sharded model: nothing."""


def _phases(**seconds: float) -> dict[str, float]:
    """Where building this world's state went, in ms: ``build`` (mesh, sharded decoder, optimizer), then ``exchange``
    (the re-shard from the members' holdings) or ``fill`` (the initial values)."""
    return {k: v * 1e3 for k, v in seconds.items()}


def holding_bytes(held) -> int:
    """Bytes of the tensors of a :class:`~flexorch.workers.reshard.Holding`."""
    return sum(t.numel() * t.element_size() for e in held.tensors.values() for t in e.values())
