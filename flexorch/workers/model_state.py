"""The model state's interface: what a worker asks of the model state it holds, whatever its kind.

Two classes implement it: ``workers.replicated_state.ReplicatedState`` (the whole model, or a pipeline stage's parts,
moved whole through the object store) and ``workers.sharded_state.ShardedState`` (FSDP2 shards, re-sharded as each
world forms). ``workers.actor`` puts each beside the common :class:`~flexorch.workers.actor.Worker`
(``ReplicatedWorker``, ``ShardedWorker``), so the worker never branches on the sharding mode. The state's own
remote methods stay with their class (replicated: ``get_state``, ``set_state``, ``export_parts``, ``import_parts``;
sharded: ``take_handoff``, ``save_sharded``, ``load_sharded``); the control plane calls those by the run's mode
(``control.state_moves``).
"""

from __future__ import annotations

__all__ = ["ModelState"]


class ModelState:
    """The interface; each method is called by :class:`~flexorch.workers.actor.Worker` at the point it names."""

    sharded = False
    """Whether the model state is FSDP2 shards."""

    def _state_init(self) -> None:
        """Build the model state this worker starts with (the constructor's last step)."""
        raise NotImplementedError

    def _state_holding(self):
        """What this worker holds of sharded model state, to re-shard or hand off (None: nothing to move so)."""
        raise NotImplementedError

    def _state_after_join(self, holding, initial: bool) -> dict:
        """The new world has formed: bring the model state into it; ``{"version", "newest"}`` (``join_world``)."""
        raise NotImplementedError

    def _state_after_leave(self) -> None:
        """The world has been left: drop what belonged to it."""
        raise NotImplementedError

    def _state_sp_executor(self):
        """The SP step's executor for this model state (``workers.step_exec.run_step`` or the sharded one)."""
        raise NotImplementedError

    def _state_context(self) -> dict:
        """The :class:`~flexorch.workers.step_context.StepContext` fields this model state sets."""
        raise NotImplementedError

    def parameters_digest(self) -> list:
        """Parameters held, as numpy arrays in state-dict order (tests compare copies and the reference); sharded:
        the whole parameters gathered from the shards (a collective)."""
        raise NotImplementedError
