"""The worker group the control plane drives: the seam between the driver (and its elastic executor) and workers.

:class:`~flexorch.control.worker_group.RayWorkerGroup` is the real one (one Ray actor per device). Anything with
these members can stand in (``TrainingDriver(cfg, worker_group=...)``), e.g. the in-process fake of the driver tests
(``tests/fake_cluster.py``). A call that fails because workers died, hung or saw the world break raises
:class:`~flexorch.control.settle.MembershipFailure`; :meth:`WorkerGroup.settle` returns that failure instead.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

from flexorch.control.membership import Failure

__all__ = ["WorkerGroup"]


class WorkerGroup(Protocol):
    """Workers keyed by stable worker id; ``worker_ids`` are the members in rank order."""

    @property
    def size(self) -> int: ...

    @property
    def worker_ids(self) -> tuple[int, ...]: ...

    joining: Mapping[int, Any]
    """Workers started and not yet members."""

    # membership (flexorch.control.elastic executes the policy's decisions with these)
    def start_workers(self, count: int) -> list[int]:
        """Start ``count`` workers with fresh ids; they join at :meth:`admit` once ready."""
        ...

    def ready_joiners(self, wait_s: float = 0.0) -> list[int]:
        """Joining workers that are up (waiting up to ``wait_s``)."""
        ...

    def admit(self, worker_ids: Iterable[int]) -> None:
        """Make ready joiners members (ranks at the next :meth:`form_world`)."""
        ...

    def remove(self, worker_ids: Iterable[int], retiring: bool = False) -> None:
        """Drop members (dead, hung or unwanted); ``retiring``: alive and idle, they left on notice."""
        ...

    def free_slots(self) -> int:
        """Device slots free in the cluster now."""
        ...

    def form_world(self) -> float:
        """Every member joins a fresh world (next membership epoch); returns the seconds it took."""
        ...

    def sync_state(self, source: int, targets: Iterable[int]) -> None:
        """Copy the whole training state of member ``source`` to ``targets``."""
        ...

    def nodes_of(self) -> dict[int, str]:
        """{member worker id: the node it runs on}."""
        ...

    def rank_nodes(self) -> list[str | None]:
        """Each member's node in rank order (its address where known), for the step records."""
        ...

    def draining_nodes(self) -> list:
        """Nodes being drained (``control.drains.NodeDrain`` values): the elastic executor's drain watch reads them."""
        ...

    def hand_off(self, leaving: Iterable[int]) -> dict:
        """Give the members that stay what only ``leaving`` hold (they go at this step boundary); returns
        ``{"handoff_bytes", "handoff_ms"}``."""
        ...

    def missing_parts(self) -> list[str]:
        """Model parts no member holds (stage-local parameters whose every holder was lost)."""
        ...

    # steps
    def place_params(self, needed_by_rank: Sequence[frozenset[str]]) -> dict:
        """Copy stage-local parameters where the next step needs them; returns what moved."""
        ...

    def run_step(self, tasks: Sequence, block_refs: Sequence[dict]) -> dict:
        """Start every rank's task; returns {worker id: handle} for :meth:`settle`."""
        ...

    def settle(self, handles: dict, timeout_s: float) -> tuple[dict, Failure | None]:
        """Wait for the handles: ({worker id: result} of those that finished, failure or None)."""
        ...

    # state
    def get_state(self, rank: int = 0) -> dict:
        """The whole model's training state (for a checkpoint)."""
        ...

    def set_state(self, state: dict) -> None:
        """Load ``state`` on every member."""
        ...

    def call(self, method: str, *args) -> list:
        """Call a worker method on every rank; results in rank order."""
        ...

    def state_versions(self, timeout_s: float) -> dict[int, int]:
        """{worker id: optimizer steps applied to the state it holds} of the members that answer within
        ``timeout_s`` (after a failure, to find who holds the state after the last completed step)."""
        ...

    def shutdown(self) -> None: ...
