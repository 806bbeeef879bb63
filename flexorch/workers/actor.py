"""The worker actor: one per device (a GPU, or a CPU slot), holding the model and its optimizer.

The driver creates N of these in a placement group, tells them the world to join (rendezvous on the driver's
TCPStore, one world per membership epoch), and sends each one its :class:`~flexorch.work.step.StepWork` plus the
specs of the stored blocks its documents live in (it reads its own documents from them). The actor builds the
process groups the plan names (collectively, in the same order on every rank), runs its micro-batches and steps the
optimizer. With pipeline stages and ``[pipeline] params = "stage"`` it holds only its stage's parts
(``flexorch.workers.pipeline.held_params``). One thread per worker on CPU (docs/design.md §7).

:class:`Worker` owns the world (joining, leaving, aborting it, and :meth:`Worker._guarded`, where a failure inside it
becomes a typed error of ``workers.errors``) and is built from components, each owning its state:

* ``state``: the model state, behind one interface (``workers.model_state.ModelState``), chosen by the run's
  ``[sharding] mode``: ``workers.replicated_state.ReplicatedState`` (the whole model, or a pipeline stage's parts)
  or ``workers.sharded_state.ShardedState`` (FSDP2 shards, re-sharded as each world forms);
* ``measure``: calibration's measurements (``workers.measurements.WorkerMeasurements``);
* ``life``: the heartbeat, SIGTERM notice and retirement (``workers.lifecycle.WorkerLifecycle``).

Its remote methods are what the driver calls; those of a component delegate to it. :func:`worker_actor` gives the Ray
actor class. Tests add probes called at :data:`PROBE_POINTS` (:meth:`Worker.add_probe`).
"""

from __future__ import annotations

import os
import socket
import time
import traceback
from collections.abc import Sequence
from datetime import timedelta

import ray
import torch
import torch.distributed as dist

from flexorch.config.model import ModelConfig
from flexorch.config.optim import OptimConfig
from flexorch.data.store.blocks import open_blocks
from flexorch.work.pipeline import PipelineWork
from flexorch.work.step import StepWork
from flexorch.workers.attention.choice import set_attention
from flexorch.workers.compile import compile_seconds, compiled_layers
from flexorch.workers.devices import device_memory, pin_device
from flexorch.workers.errors import PeerLostError, drop_frames, typed_failure
from flexorch.workers.lifecycle import HEARTBEAT_S, WorkerLifecycle
from flexorch.workers.measurements import WorkerMeasurements
from flexorch.workers.model_state import ModelState, StateSpec
from flexorch.workers.network import Binding, bind_collectives, check_reachable
from flexorch.workers.pipeline.executor import run_pipeline_step
from flexorch.workers.process_groups import ProcessGroupRegistry, abort_world, backend_for
from flexorch.workers.replicated_state import ReplicatedState
from flexorch.workers.sharded_state import ShardedState, holding_bytes
from flexorch.workers.step_context import PROBE_POINTS, StepContext
from flexorch.workers.step_exec import StepOutcome

__all__ = ["HEARTBEAT_S", "PROBE_POINTS", "Worker", "worker_actor"]

STORE_CONNECT_S = 10.0
"""How long joining a world may take to reach the driver's rendezvous store (a closed one is refused at once)."""

SHARDING_DEFAULTS = {"mode": "replicate", "shard_size": None, "precision": "fp32", "recompute": "none"}
"""``[sharding]`` as a worker reads it when the driver leaves a key out."""


def _in_actor() -> bool:
    """True inside a Ray actor's process (not a test's in-process worker, whose signals are the test's own)."""
    return ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None


def model_state_class(sharding: dict | None) -> type[ModelState]:
    """The model state of a run's ``[sharding]`` settings (None: replicate)."""
    return ShardedState if (sharding or {}).get("mode", "replicate") != "replicate" else ReplicatedState


class Worker:
    """What every worker does, usable in-process (tests) or as a Ray actor (:func:`worker_actor`); see the module's
    docstring for its components."""

    def __init__(
        self,
        worker_id: int,
        model_cfg: dict,
        optim_cfg: dict,
        seed: int,
        num_threads: int = 1,
        sharding: dict | None = None,
        use_gpu: bool | None = None,
    ):
        if num_threads > 0:
            torch.set_num_threads(num_threads)
        self.device = pin_device(_wants_gpu(use_gpu))
        """This worker's CUDA device, made current (``flexorch.workers.devices``); None on CPU. ``use_gpu`` None:
        a GPU exactly when Ray gave this actor one (``num_gpus``), or, outside a Ray actor, when CUDA is
        available."""
        memory = device_memory(self.device)  # before this worker allocates anything
        self.worker_id = worker_id
        spec = StateSpec(
            worker_id=worker_id,
            model_cfg=ModelConfig.from_dict(model_cfg),
            optim_cfg=OptimConfig(**optim_cfg),
            seed=seed,
            sharding={**SHARDING_DEFAULTS, **(sharding or {})},
            device=self.device,
        )
        self.spec = spec
        self.attention = set_attention(spec.model_cfg, self.device, spec.sharding["precision"])
        """What ``[model] attention`` chose here, in words (``flexorch.workers.attention.choice``)."""
        self.registry: ProcessGroupRegistry | None = None
        """The world this worker is in (None: between worlds)."""
        self._store: dist.Store | None = None
        self.binding: Binding | None = None
        """The address this worker's collectives announce, chosen at its first world (``workers.network``)."""
        self.reach_s: float | None = None
        """Seconds the last world's reachability check took (``workers.network.check_reachable``)."""
        self._aborted_epoch: int | None = None  # the epoch abort_world shut down last
        self._probes: list = []  # called at PROBE_POINTS (add_probe); none in a run
        self.state: ModelState = model_state_class(spec.sharding)(spec, self._world, self._guarded)
        if isinstance(self.state, ShardedState):
            from flexorch.workers.shard_staging import sweep_staging

            sweep_staging()  # the shards a worker of this node killed mid-save left staged in host memory
        self.measure = WorkerMeasurements(spec, self.state, self._world, memory)
        self.life = WorkerLifecycle(worker_id, _in_actor())

    def _world(self) -> ProcessGroupRegistry | None:
        return self.registry

    @ray.method(concurrency_group="control")
    def stop_heartbeat(self, timeout_s: float = 5.0) -> bool:
        """:meth:`~flexorch.workers.lifecycle.WorkerLifecycle.stop_heartbeat`, on the control thread."""
        return self.life.stop_heartbeat(timeout_s)

    @ray.method(concurrency_group="control")
    def retire(self) -> int:
        """:meth:`~flexorch.workers.lifecycle.WorkerLifecycle.freeze_for_exit`, on the control thread: this worker
        left on notice and is killed next."""
        return self.life.freeze_for_exit()

    @ray.method(concurrency_group="control")
    def abort_world(self, epoch: int | None = None) -> int:
        """Shut down the sockets of the world of membership ``epoch`` (None: the current one) from the control
        thread, while the step's thread may be blocked in a collective on a peer that is gone or frozen: that
        collective fails now (and the step with PeerLostError) instead of at the collective timeout. An abort that
        arrives once this worker is in a newer world does nothing (it was queued behind the step's failure, and the
        new world is healthy). Returns the sockets shut down (0: none)."""
        reg = self.registry
        if reg is None or (epoch is not None and reg.epoch != epoch):
            return 0
        self._aborted_epoch = reg.epoch  # whatever the step's thread raises on this world now is the abort's doing
        return reg.abort_sockets()

    @ray.method(concurrency_group="control")
    def add_probe(self, probe) -> None:
        """Call ``probe.at(point, key)`` at each of :data:`PROBE_POINTS` from now on (tests add a
        ``flexorch.testing.faults.WorkerFault``)."""
        self._probes.append(probe)

    def _at(self, point: str, key: int) -> None:
        for probe in self._probes:
            probe.at(point, key)

    def state_version(self) -> int:
        """Optimizer steps applied to the state this worker holds (0: none; a worker that has not joined yet).
        Answered on the control thread, so also while a call on the step's thread is still blocked."""
        return self.state.version

    def info(self) -> dict:
        """Where this worker runs."""
        model = self.state.model
        return {
            "worker_id": self.worker_id,
            "pid": os.getpid(),
            "hostname": socket.gethostname(),
            "node_id": ray.get_runtime_context().get_node_id() if ray.is_initialized() else None,
            "node_ip": ray.util.get_node_ip_address() if ray.is_initialized() else None,
            "device": str(self.device or "cpu"),
            "attention": self.attention,
            "compiled_layers": compiled_layers(model) if model is not None else 0,
        }

    def start_heartbeat(self, host: str, port: int, period_s: float = HEARTBEAT_S) -> None:
        """:meth:`~flexorch.workers.lifecycle.WorkerLifecycle.start_heartbeat`."""
        self.life.start_heartbeat(host, port, period_s)

    def join_world(
        self, host: str, port: int, rank: int, world_size: int, epoch: int, timeout_s: float, initial: bool = False
    ) -> dict:
        """Join the torch.distributed world of membership ``epoch`` (blocks until every rank joined). Sharded
        state is then re-sharded for the new world (a collective, ``flexorch.workers.reshard``): from the initial
        values when ``initial`` (the run's first world), else from what the members hold. Returns ``{"seconds",
        "phases_ms", "version", "newest"}``: ms leaving the last world, meeting, building the state (sharded:
        ``build`` and ``exchange``); the state version now held (None: no version's shards are all held any more,
        nothing was restored) and the newest version any member held."""
        t0 = time.perf_counter()
        holdings = self.state.holdings()  # its own and those handed to it (take_handoff)
        # Membership changed since the last world, maybe because a peer died after this rank's step had finished:
        # abort (NCCL) rather than destroy, which could wait on that peer. No collective is pending between steps.
        self.leave_world(abort=True)
        t_left = time.perf_counter()
        self._at("join", epoch)
        self._guarded(self._join, host, port, rank, world_size, epoch, timeout_s)
        t_joined = time.perf_counter()
        out = self.state.after_join(holdings, initial)
        t_end = time.perf_counter()
        state = out.pop("phases_ms", None) or {"state": (t_end - t_joined) * 1e3}  # sharded: build, exchange
        phases = {"leave": (t_left - t0) * 1e3, "rendezvous": (t_joined - t_left) * 1e3, **state}
        return {"seconds": t_end - t0, "phases_ms": phases, **out}

    def _join(self, host, port, rank, world_size, epoch, timeout_s) -> None:
        # The store is up when the driver asks us to join; when the driver has already closed it (the world broke
        # before we got here), TCPStore's connect retries past its timeout, so a survivor would sit it out and be
        # killed as hung, its state lost. A plain connect says at once that it is gone.
        try:
            socket.create_connection((host, port), timeout=STORE_CONNECT_S).close()
        except OSError as e:
            gone = f"the rendezvous store of epoch {epoch} is gone ({e}): the world broke"
            raise PeerLostError(f"worker {self.worker_id}: the world broke ({gone})") from None
        # connecting is bounded by STORE_CONNECT_S too: a store closed between the check above and here is refused
        # within it, not retried for the collective timeout; the world's waits then get the collective timeout
        self._store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=STORE_CONNECT_S))
        self._store.set_timeout(timedelta(seconds=timeout_s))
        if self.binding is None:  # once per process: later worlds keep the interface it set
            self.binding = bind_collectives(ray.util.get_node_ip_address() if ray.is_initialized() else host)
        self.reach_s = check_reachable(self._store, rank, world_size, epoch, self.binding, timeout_s)
        self.registry = ProcessGroupRegistry(
            store=self._store,
            rank=rank,
            world_size=world_size,
            epoch=epoch,
            timeout_s=timeout_s,
            backend=backend_for(self.device),
            device=self.device,
        )

    def leave_world(self, abort: bool = False) -> None:
        """Drop the current world (idempotent; safe after a failed collective). ``abort``: the world failed, so
        NCCL communicators are aborted instead of destroyed (``ProcessGroupRegistry.close``); gloo is unaffected."""
        if self.registry is not None:
            try:
                self.registry.close(abort=abort)
            except Exception:  # noqa: BLE001 - a broken world may not close cleanly; it is dropped either way
                pass
            self.registry = None
        if dist.is_initialized():  # a half-made world (a join that failed), or a close that raised
            try:
                abort_world() if abort else dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass
        self._store = None
        self.state.after_leave()
        self.measure.drop_probe_model()  # built on the closed world

    def _guarded(self, fn, *args, **kwargs):
        """Run ``fn`` in this worker's world; on any error leave the world first (closing its connections, so peers
        blocked on this worker fail at once instead of at their timeout), then raise the typed error it stands for
        (``workers.errors.typed_failure``: out of memory, the step's memory dropped first; a lost peer; a collective
        timeout) or else the original error, the worker's own, with its traceback as a note."""
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - re-raised below
            err, text = e, traceback.format_exc()
        drop_frames(err)  # release the failed collective's frames, so leaving the world closes sockets
        epoch = self.registry.epoch if self.registry is not None else None
        aborted = epoch is not None and self._aborted_epoch == epoch
        self.leave_world(abort=True)  # the step failed: the world's state is unknown, a destroy could wait forever
        if isinstance(err, torch.OutOfMemoryError):
            self.state.drop_step_memory()
        typed = typed_failure(err, f"worker {self.worker_id}", aborted)  # aborted: any error is the broken world's
        if typed is not None:
            raise typed
        err.add_note(text)
        raise err

    def run_step(self, step: Sequence[tuple[StepWork | PipelineWork, dict]], index: int) -> StepOutcome:
        """Run this rank's part of a step (SP micro-batches, or a pipeline stage's ops): ``step[index]``, of the
        step's ``(rank work, block specs)`` pairs that every rank is handed once (``RayWorkerGroup.run_step``).
        The block specs map block index -> ``flexorch.data.store.blocks.BlockSpec`` of the stored block it reads."""
        rank_work, block_specs = step[index]
        reg, n = self.registry, rank_work.world_size
        if reg is None or reg.rank != rank_work.rank or reg.world_size != n:
            raise RuntimeError(f"worker {self.worker_id} is not rank {rank_work.rank} of a world of {n}")
        blocks = open_blocks(block_specs)  # each block opened once per process, read where the documents are
        return self._guarded(self._run_step, rank_work, blocks)

    def _run_step(self, rank_work: StepWork | PipelineWork, blocks: dict) -> StepOutcome:
        self.registry.ensure(rank_work.rank_sets)
        compiled_before = compile_seconds()
        out = self._executor(rank_work)(self._context(rank_work), rank_work, blocks)
        out.compile_s = max(0.0, compile_seconds() - compiled_before)
        self.state.stepped()
        return out

    def _executor(self, rank_work: StepWork | PipelineWork):
        """The executor of this kind of work on this worker's kind of model state."""
        return run_pipeline_step if isinstance(rank_work, PipelineWork) else self.state.sp_executor()

    def _context(self, rank_work: StepWork | PipelineWork) -> StepContext:
        """The model state and the world this step runs on (``workers.step_context``)."""
        self.measure.drop_probe_model()  # calibration is over once a step runs: its memory goes back
        st = self.state
        return StepContext(
            st.model,
            st.optimizer,
            st.scheduler,
            self.registry.group,
            self.registry.world if rank_work.world_size > 1 else None,
            self.spec.optim_cfg,
            vocab_size=self.spec.model_cfg.vocab_size,
            hook=(lambda point: self._at(point, rank_work.step)) if self._probes else None,
            **st.context_fields(),
        )

    def state_bytes(self) -> int:
        """Bytes of model state this worker keeps between steps (parameters, gradients, optimizer state)."""
        return self.state.state_bytes()

    def parameters_digest(self) -> list:
        """:meth:`~flexorch.workers.model_state.ModelState.parameters_digest`."""
        return self.state.parameters_digest()

    def get_state(self) -> dict:
        """:meth:`~flexorch.workers.replicated_state.ReplicatedState.get_state`."""
        return self.state.get_state()

    def set_state(self, state: dict) -> None:
        """:meth:`~flexorch.workers.replicated_state.ReplicatedState.set_state`."""
        self.state.set_state(state)

    def export_parts(self, parts: list[str]) -> dict:
        """:meth:`~flexorch.workers.replicated_state.ReplicatedState.export_parts`."""
        return self.state.export_parts(parts)

    def import_parts(self, exported: list) -> int:
        """:meth:`~flexorch.workers.replicated_state.ReplicatedState.import_parts`."""
        return self.state.import_parts(exported)

    @ray.method(num_returns=2)
    def hand_off(self):
        """``(bytes, holding)``: what this worker holds of the sharded model state (a
        :class:`~flexorch.workers.reshard.Holding`, on the CPU) and its size, for one that stays: this worker's node
        is being drained and it leaves the world at this step boundary. Two returns, so the driver waits on the
        small one and the holding goes from this worker to the stayer without passing through the driver."""
        from flexorch.workers.reshard import on_cpu

        holding = self.state.holding()
        if holding is None:
            raise RuntimeError(f"worker {self.worker_id} holds no sharded state to hand off")
        held = on_cpu(holding)
        return holding_bytes(held), held

    def take_handoff(self, handed: list) -> int:
        """:meth:`~flexorch.workers.sharded_state.ShardedState.take_handoff`."""
        return self.state.take_handoff(handed)

    def save_sharded(self, directory: str) -> None:
        """:meth:`~flexorch.workers.sharded_state.ShardedState.save_sharded`."""
        self.state.save_sharded(directory)

    def stage_sharded(self, directory: str) -> None:
        """:meth:`~flexorch.workers.sharded_state.ShardedState.stage_sharded`."""
        self.state.stage_sharded(directory)

    def write_state(self, directory: str, background: bool) -> dict[str, str] | None:
        """:meth:`~flexorch.workers.replicated_state.ReplicatedState.write_state`."""
        return self.state.write_state(directory, background)

    @ray.method(concurrency_group="io")
    def finish_upload(self, timeout_s: float | None = None) -> dict:
        """:meth:`~flexorch.workers.model_state.ModelState.finish_upload`: on a thread of its own, so the driver
        waits for a checkpoint's write while this worker trains the next steps."""
        return self.state.finish_upload(timeout_s)

    def load_sharded(self, directory: str) -> int:
        """:meth:`~flexorch.workers.sharded_state.ShardedState.load_sharded`."""
        return self.state.load_sharded(directory)

    def probe(self, probes: list) -> list[float]:
        """:meth:`~flexorch.workers.measurements.WorkerMeasurements.probe`."""
        return self.measure.probe(probes)

    def recompute_times(self, tokens: int, modes=("none", "full"), repeats: int = 3) -> list[float]:
        """:meth:`~flexorch.workers.measurements.WorkerMeasurements.recompute_times`."""
        return self.measure.recompute_times(tokens, modes, repeats)

    def device_memory(self) -> dict | None:
        """:meth:`~flexorch.workers.measurements.WorkerMeasurements.device_memory`."""
        return self.measure.device_memory()

    def activation_bytes_per_token(self, mode: str | None = None) -> float:
        """:meth:`~flexorch.workers.measurements.WorkerMeasurements.activation_bytes_per_token`."""
        return self.measure.activation_bytes_per_token(mode)

    def stage_activation_bytes(self) -> tuple[float, float]:
        """:meth:`~flexorch.workers.measurements.WorkerMeasurements.stage_activation_bytes`."""
        return self.measure.stage_activation_bytes()


def _wants_gpu(use_gpu: bool | None) -> bool:
    """``use_gpu`` if given; else whether Ray gave this actor GPUs (``ray.get_gpu_ids()``, meaningful only inside an
    actor), or outside a Ray actor whether CUDA is available."""
    if use_gpu is not None:
        return use_gpu
    if _in_actor():
        return bool(ray.get_gpu_ids())
    return torch.cuda.is_available()


_ACTOR = ray.remote(concurrency_groups={"control": 1, "io": 1})(Worker)


def worker_actor(sharding: dict | None):
    """The Ray actor class that starts a worker of a run's ``[sharding]`` settings (the worker picks its model state
    from the ``sharding`` it is given; :func:`model_state_class`); the driver sets resources with
    ``.options(num_cpus=..., num_gpus=...)``. Calls run one at a time on the default group's thread; the control
    group's (``stop_heartbeat``, ``retire``, ``abort_world``, ``add_probe``) on their own beside them."""
    return _ACTOR
