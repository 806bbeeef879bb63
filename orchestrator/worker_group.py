"""The driver's handle on its worker actors: a placement group of N bundles, one WorkerActor per bundle.

The driver talks to workers only through this class (the seam where membership changes will plug in): create
them, form a world (rendezvous on a TCPStore the driver hosts; one store serves every membership epoch, each
epoch under its own prefix), send each rank its task, fetch and push state.
"""

from __future__ import annotations

import dataclasses
import time

import ray
import torch.distributed as dist
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from workers.actor import WorkerActor

__all__ = ["RayWorkerGroup", "WorkerGroupError"]


class WorkerGroupError(RuntimeError):
    """Workers could not be placed, could not form a world, or failed a step."""


class RayWorkerGroup:
    """N worker actors in one placement group, ranks 0..N-1 in creation order."""

    def __init__(
        self,
        num_workers: int,
        *,
        model_cfg: dict,
        optim_cfg: dict,
        seed: int,
        use_gpu: bool = False,
        threads: int = 1,
        collective_timeout_s: float = 120.0,
        placement_timeout_s: float = 60.0,
    ):
        self.timeout_s = collective_timeout_s
        bundle = {"GPU": 1, "CPU": 1} if use_gpu else {"CPU": 1}
        self.pg = placement_group([bundle] * num_workers, strategy="PACK")
        try:
            ray.get(self.pg.ready(), timeout=placement_timeout_s)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(self.pg)
            have = ray.cluster_resources()
            raise WorkerGroupError(
                f"could not place {num_workers} workers of {bundle} within {placement_timeout_s:.0f} s; the cluster "
                f"has CPU={have.get('CPU', 0):g} GPU={have.get('GPU', 0):g}. Lower `workers`, or start Ray with more "
                "slots (e.g. `ray start --num-cpus N`)"
            ) from None
        self.actors = [
            WorkerActor.options(
                num_cpus=1,
                num_gpus=1 if use_gpu else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self.pg, placement_group_bundle_index=i
                ),
            ).remote(i, model_cfg, optim_cfg, seed, threads)
            for i in range(num_workers)
        ]
        self.host = ray.util.get_node_ip_address()
        self.store = dist.TCPStore(self.host, 0, is_master=True, wait_for_workers=False)
        self.epoch = 0

    @classmethod
    def from_config(cls, cfg) -> RayWorkerGroup:
        """The workers a ``TrainConfig`` asks for (its model, optimizer, seed, device kind and timeouts)."""
        return cls(
            cfg.workers,
            model_cfg=cfg.model.to_dict(),
            optim_cfg=dataclasses.asdict(cfg.optim),
            seed=cfg.seed,
            use_gpu=cfg.use_gpu,
            threads=cfg.worker_threads,
            collective_timeout_s=cfg.collective_timeout_s,
        )

    @property
    def size(self) -> int:
        return len(self.actors)

    def form_world(self) -> float:
        """Every worker joins a fresh world (the next membership epoch); returns the seconds it took."""
        self.epoch += 1
        t0 = time.perf_counter()
        refs = [
            a.join_world.remote(self.host, self.store.port, rank, self.size, self.epoch, self.timeout_s)
            for rank, a in enumerate(self.actors)
        ]
        self._get(refs, "form a torch.distributed world")
        return time.perf_counter() - t0

    def run_step(self, tasks, block_refs: list[dict]) -> list:
        """Start every rank's step; returns the object refs of their outcomes (the caller waits on them)."""
        return [a.run_step.remote(t, refs) for a, t, refs in zip(self.actors, tasks, block_refs, strict=True)]

    def wait(self, refs: list, what: str, timeout_s: float | None = None) -> list:
        return self._get(refs, what, timeout_s)

    def get_state(self, rank: int = 0) -> dict:
        return self._get([self.actors[rank].get_state.remote()], "fetch the model state")[0]

    def set_state(self, state: dict) -> None:
        ref = ray.put(state)
        self._get([a.set_state.remote(ref) for a in self.actors], "load the model state")

    def call(self, method: str, *args) -> list:
        """Call a worker method on every rank and wait (e.g. 'parameters_digest')."""
        return self._get([getattr(a, method).remote(*args) for a in self.actors], method)

    def _get(self, refs: list, what: str, timeout_s: float | None = None) -> list:
        """Wait for all refs; fail fast on the first error (the others may be stuck in a collective)."""
        timeout = timeout_s if timeout_s is not None else self.timeout_s + 30.0
        deadline = time.monotonic() + timeout
        pending = list(refs)
        try:
            while pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise WorkerGroupError(f"workers did not {what} within {timeout:.0f} s")
                ready, pending = ray.wait(pending, num_returns=1, timeout=left)
                ray.get(ready)  # raises the worker's error now, not after the survivors time out
            return ray.get(refs)
        except ray.exceptions.RayActorError as e:
            raise WorkerGroupError(f"a worker died while trying to {what}: {e}") from e
        except ray.exceptions.RayTaskError as e:
            raise WorkerGroupError(f"a worker failed to {what}: {e.cause if e.cause else e}") from e

    def shutdown(self) -> None:
        for a in self.actors:
            ray.kill(a)
        self.actors = []
        remove_placement_group(self.pg)
