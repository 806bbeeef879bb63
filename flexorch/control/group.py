"""The worker group the control plane drives: the seam between the driver (and its elastic executor) and workers.

:class:`WorkerGroup` is every member the control plane uses on a group of workers; a class that lacks one cannot be
instantiated. :class:`~flexorch.control.worker_group.RayWorkerGroup` is the real one (one Ray actor per device);
the in-process fake of the driver tests (``tests/fake_cluster.py``) is another (``TrainingDriver(cfg,
worker_group=...)``). A call that fails because workers died, hung or saw the world break raises
:class:`~flexorch.control.failures.MembershipFailure`; :meth:`WorkerGroup.settle` returns that failure instead.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from flexorch.control.failures import Failure

__all__ = ["WorkerGroup"]


class WorkerGroup(ABC):
    """Workers keyed by stable worker id; ``worker_ids`` are the members in rank order."""

    sharded: bool = False
    """Model state sharded over the workers (FSDP2): it moves when the world re-forms, never through
    :meth:`sync_state`, and every member writes its own shard of a checkpoint (:meth:`save_sharded`)."""
    restored: dict | None = None
    """Sharded state: what the last :meth:`form_world` restored (``{"version", "newest"}``: the optimizer steps of
    the state the new world re-sharded, and of the newest state any member held); None otherwise."""
    form_phases_ms: dict | None = None
    """Where the last :meth:`form_world` went (the slowest member's ms per phase); None when not measured."""
    driver_node: str | None = None
    """The node the driver (and this group) runs on, so that a drain of it is told apart; None: not known."""

    @property
    @abstractmethod
    def size(self) -> int: ...

    @property
    @abstractmethod
    def worker_ids(self) -> tuple[int, ...]: ...

    @property
    @abstractmethod
    def joining(self) -> Mapping[int, Any]:
        """Workers started and not yet members."""

    # membership (flexorch.control.elastic executes the policy's decisions with these)
    @abstractmethod
    def start_workers(self, count: int) -> list[int]:
        """Start ``count`` workers with fresh ids; they join at :meth:`admit` once ready."""

    @abstractmethod
    def ready_joiners(self, wait_s: float = 0.0) -> list[int]:
        """Joining workers that are up (waiting up to ``wait_s``)."""

    @abstractmethod
    def admit(self, worker_ids: Iterable[int]) -> None:
        """Make ready joiners members (ranks at the next :meth:`form_world`)."""

    @abstractmethod
    def remove(self, worker_ids: Iterable[int], retiring: bool = False) -> None:
        """Drop members (dead, hung or unwanted); ``retiring``: alive and idle, they left on notice."""

    @abstractmethod
    def free_slots(self) -> int:
        """Device slots free in the cluster now."""

    @abstractmethod
    def form_world(self) -> float:
        """Every member joins a fresh world (next membership epoch); returns the seconds it took. Raises
        :class:`~flexorch.work.placement.PartsLostError` (the world formed) when sharded state lost a shard."""

    @abstractmethod
    def sync_state(self, source: int, targets: Iterable[int]) -> None:
        """Copy the whole training state of member ``source`` to ``targets``."""

    @abstractmethod
    def nodes_of(self) -> dict[int, str]:
        """{member worker id: the node it runs on}."""

    @abstractmethod
    def rank_nodes(self) -> list[str | None]:
        """Each member's node in rank order (its address where known; None: not known), for plans and records."""

    def pids_of(self) -> dict[int, int]:
        """{member worker id: its process id} where known, for the records: a user finds a slow worker's process with
        ``top`` or ``py-spy``. A group that cannot tell leaves it empty."""
        return {}

    @abstractmethod
    def draining_nodes(self) -> list:
        """Nodes being drained (``control.drains.NodeDrain`` values): the elastic executor's drain watch reads them."""

    @abstractmethod
    def leaving_notices(self) -> dict[int, float]:
        """Members whose process got SIGTERM (a notice to leave): worker id -> when (unix seconds)."""

    @abstractmethod
    def hand_off(self, leaving: Iterable[int]) -> dict:
        """Give the members that stay what only ``leaving`` hold (they go at this step boundary); returns
        ``{"handoff_bytes", "handoff_ms"}``."""

    @abstractmethod
    def missing_parts(self) -> list[str]:
        """Model parts no member holds (stage-local parameters whose every holder was lost)."""

    # steps
    @abstractmethod
    def place_params(self, needed_by_rank: Sequence[frozenset[str]]) -> dict:
        """Copy stage-local parameters where the next step needs them; returns what moved."""

    @abstractmethod
    def run_step(self, tasks: Sequence, block_specs: Sequence[dict]) -> dict:
        """Start every rank's task; returns {worker id: handle} for :meth:`settle`."""

    @abstractmethod
    def settle(self, handles: dict, timeout_s: float) -> tuple[dict, Failure | None]:
        """Wait for the handles: ({worker id: result} of those that finished, failure or None)."""

    @abstractmethod
    def detection(self, lost: Iterable[int]) -> dict | None:
        """How the last :meth:`settle`'s failure of ``lost`` was found (``{"by", "detect_ms", "since_ms"}``), or
        None when the group does not know."""

    # state
    @abstractmethod
    def get_state(self, rank: int = 0) -> dict:
        """The whole model's training state (for a checkpoint)."""

    @abstractmethod
    def set_state(self, state: dict) -> None:
        """Load ``state`` on every member."""

    @abstractmethod
    def save_sharded(self, directory: str) -> None:
        """Every member writes its shard of the model state into ``directory`` (:attr:`sharded` state only)."""

    @abstractmethod
    def stage_sharded(self, directory: str) -> Callable[[float], dict[int, dict[str, str]]]:
        """An asynchronous :meth:`save_sharded`: every member stages its shard in host memory (waited for here) and
        copies it to ``directory`` in the background; returns ``wait(timeout_s)``, which returns {worker id: its
        files and their SHA-256} once every copy is done or raises why one failed, and may be called from another
        thread."""

    @abstractmethod
    def write_whole(self, directory: str, background: bool) -> Callable[[float], dict[str, str]] | None:
        """Replicated state: a member holding the whole model writes ``model.pt`` and ``train_state.pt`` into
        ``directory`` itself (``background``: from a thread, while it trains on); returns ``wait(timeout_s)`` ->
        {file: SHA-256}, or None when no member holds the whole model (then :meth:`get_state` assembles it)."""

    @abstractmethod
    def call(self, method: str, *args) -> list:
        """Call a worker method on every rank; results in rank order."""

    @abstractmethod
    def state_versions(self, timeout_s: float) -> dict[int, int]:
        """{worker id: optimizer steps applied to the state it holds} of the members that answer within
        ``timeout_s`` (after a failure, to find who holds the state after the last completed step)."""

    @abstractmethod
    def shutdown(self) -> None: ...
