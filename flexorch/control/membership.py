"""Membership of a run and the elastic policy: pure values, no Ray, so every decision is unit-testable.

A worker has a stable ``worker_id`` (never reused, kept in records and logs) and a ``rank`` (its position in the
current torch.distributed world, which changes whenever the world is re-formed). :class:`Membership` keeps the
two apart; the ranks of epoch ``e`` are the alive worker ids, contiguous per node (:class:`Membership`).

:class:`ElasticPolicy` turns what the driver observed into a decision value (docs/design.md §4):

* after a failed attempt at a step: :class:`Shrink` (re-form the world on the survivors and re-run the same batch,
  re-planned for the new size), :class:`WaitForCapacity` (survivors are below ``min_workers``: wait, bounded, for
  replacements), :class:`Retry` (a collective failed but every worker is alive) or :class:`Fail` (a deterministic
  error, every worker lost, or too many attempts);
* at a step boundary: :class:`Grow` (start this many workers; they join when ready) or ``None``;
* when a node holding workers is being drained (``control.drains``): :class:`Leave` (at the next step boundary its
  workers hand off what only they hold and the world re-forms without them: nothing is re-run) or :class:`Stay`
  (they stay until the node goes, and the lost-node path recovers then), with why;
* when workers stayed slow (``[elastic] retire_below_speed``, ``control.slow_retire``): :class:`Retire` (at the
  step boundary they leave as a drained node's workers do, never taking the world below ``min_workers``: the
  slowest go first, the others are ``kept``, with why);
* when some model state lost its every holder (stage-local parameters, or a shard without a copy):
  :class:`RollBack` (load the last checkpoint and train again from its step);
* when workers ran out of device memory in a step: :class:`ReplanForMemory` (plan the step again with a smaller
  memory budget, ``control.memory_budget.lowered_after_oom``), beside the decision on the failure.

:class:`Recovery` is what executing a decision after a failure came to: the recovery record of the step.
Only the driver executes decisions (``flexorch/control/elastic.py``, ``flexorch/control/driver.py``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from flexorch.control.failures import Failure
from flexorch.solver.topology import Topology

__all__ = [
    "Membership",
    "ElasticPolicy",
    "Shrink",
    "Grow",
    "Retry",
    "WaitForCapacity",
    "Fail",
    "Decision",
    "Leave",
    "Stay",
    "Retire",
    "RollBack",
    "ReplanForMemory",
    "Recovery",
    "world_topology",
]


class Membership:
    """Alive worker ids in rank order, the node each runs on, and the membership epoch.

    Ranks are contiguous per node: the nodes in the order of their smallest alive worker id, and inside a node the
    ids in ascending order, so a group of consecutive ranks no larger than a node's live workers can lie inside that
    node (``flexorch.solver.topology``), after every membership change. Workers of no known node count as one node;
    with ``by_node=False`` (``[plan] topology = "blind"``) ranks are the ids in ascending order, whatever their
    nodes."""

    def __init__(self, worker_ids: Iterable[int] = (), nodes: Mapping[int, str] | None = None, by_node: bool = True):
        self._nodes: dict[int, str | None] = {}
        self.by_node = by_node
        self._alive: list[int] = []
        self._next_id = 0
        self.add(worker_ids, nodes)
        self.epoch = 0

    @property
    def worker_ids(self) -> tuple[int, ...]:
        """Alive worker ids in rank order."""
        return tuple(self._alive)

    @property
    def size(self) -> int:
        return len(self._alive)

    def rank_of(self, worker_id: int) -> int:
        return self._alive.index(worker_id)

    def node_of(self, worker_id: int) -> str | None:
        """The node a member runs on (None: not known)."""
        return self._nodes.get(worker_id)

    def node_sizes(self) -> list[tuple[str | None, int]]:
        """(node, live workers) in rank order: consecutive ranks on one node form one entry (with ``by_node`` every
        node appears once; blind, a node can appear again further on)."""
        out: list[tuple[str | None, int]] = []
        for w in self._alive:
            node = self._nodes.get(w)
            if out and out[-1][0] == node:
                out[-1] = (node, out[-1][1] + 1)
            else:
                out.append((node, 1))
        return out

    def _order(self, ids: Iterable[int]) -> list[int]:
        ids = sorted(set(ids))
        if not self.by_node:
            return ids
        first: dict[str | None, int] = {}
        for w in ids:  # ascending: each node's smallest id comes first
            first.setdefault(self._nodes.get(w), w)
        return sorted(ids, key=lambda w: (first[self._nodes.get(w)], w))

    def new_ids(self, count: int) -> list[int]:
        """Reserve ``count`` fresh worker ids (for workers about to start); they are not members yet."""
        ids = list(range(self._next_id, self._next_id + count))
        self._next_id += count
        return ids

    def add(self, worker_ids: Iterable[int], nodes: Mapping[int, str] | None = None) -> None:
        """Make ``worker_ids`` members; ``nodes``: the node each runs on (the next world's ranks follow them)."""
        ids = set(worker_ids)
        for w in ids:
            self._nodes[w] = (nodes or {}).get(w)
        self._alive = self._order(set(self._alive) | ids)
        if ids:
            self._next_id = max(self._next_id, max(ids) + 1)

    def remove(self, worker_ids: Iterable[int]) -> None:
        gone = set(worker_ids)
        unknown = gone - set(self._alive)
        if unknown:
            raise KeyError(f"workers {sorted(unknown)} are not members (alive: {self._alive})")
        for w in gone:
            self._nodes.pop(w, None)
        self._alive = self._order(w for w in self._alive if w not in gone)

    def next_epoch(self) -> int:
        """Start a new world: ranks are re-assigned from the alive ids."""
        self.epoch += 1
        return self.epoch


def world_topology(worker_ids, rank_nodes, n: int, without=()) -> Topology | None:
    """The planner's view of a world of ``n`` workers: the members ``worker_ids`` (rank order) less ``without``, by
    their nodes ``rank_nodes`` (rank order): live workers per node in rank order. None, planned as one node, when
    every member is on one node, when ranks are not contiguous per node (``by_node=False``), or when the world is not
    the members' (joiners not admitted yet)."""
    gone = set(without)
    nodes = [str(node) for w, node in zip(worker_ids, rank_nodes, strict=True) if w not in gone]
    if len(nodes) != n or len(set(nodes)) <= 1:
        return None
    sizes: list[int] = []
    names: list[str] = []
    for node in nodes:
        if names and names[-1] == node:
            sizes[-1] += 1
        else:
            sizes.append(1)
            names.append(node)
    return Topology(tuple(sizes), tuple(names)) if len(set(names)) == len(names) else None


@dataclass(frozen=True)
class Shrink:
    lost: tuple[int, ...]
    survivors: tuple[int, ...]


@dataclass(frozen=True)
class Grow:
    count: int


@dataclass(frozen=True)
class Retry:
    reason: str


@dataclass(frozen=True)
class WaitForCapacity:
    lost: tuple[int, ...]
    survivors: tuple[int, ...]
    need: int
    """Workers to add before the run may go on (to reach ``min_workers``)."""
    timeout_s: float


@dataclass(frozen=True)
class Fail:
    reason: str


Decision = Shrink | Grow | Retry | WaitForCapacity | Fail


@dataclass(frozen=True)
class Leave:
    """The workers of a draining node leave at a step boundary: they hand off what only they hold, then the
    world re-forms on ``survivors``."""

    leaving: tuple[int, ...]
    survivors: tuple[int, ...]


@dataclass(frozen=True)
class Stay:
    """The workers of a draining node stay until the node goes (then the lost-node path recovers): ``reason``."""

    leaving: tuple[int, ...]
    reason: str


@dataclass(frozen=True)
class Retire:
    """Slow workers retired as failed at a step boundary: ``leaving`` hand off what only they hold and go, and the
    world re-forms on ``survivors`` (nothing re-run). ``kept``: slow workers that stay, and ``reason`` why (the world
    would drop below ``min_workers``); both empty when every slow worker goes."""

    leaving: tuple[int, ...]
    survivors: tuple[int, ...]
    kept: tuple[int, ...] = ()
    reason: str = ""


@dataclass(frozen=True)
class RollBack:
    """Some model state lost its every holder: the driver loads its last checkpoint on the workers alive and trains
    again from its step."""

    lost: tuple[int, ...]
    """The lost workers that held it (ascending)."""
    reason: str
    """What was lost, in words (the error that showed it)."""
    what: str | None = None
    """What the run was doing when it showed (e.g. a drained node's leave); None: the driver names it (the step it
    was running, or the admission of joining workers at a step boundary)."""
    drain: dict | None = None
    """The lost workers' node was being drained (``NodeDrain.fields()`` and why they did not leave in time)."""


@dataclass(frozen=True)
class ReplanForMemory:
    """Workers ran out of device memory in a step: plan it again for a smaller memory budget, then run it again."""

    workers: frozenset[int]
    messages: tuple[tuple[int, str], ...] = ()
    """(worker id, the first line of its out-of-memory error)."""


@dataclass(frozen=True)
class Recovery:
    """What a recovery after a failed attempt came to: the decisions executed, who was lost, the world before and
    after, whether the failed step stands (``step_completed``: some survivor finished its update) and what it
    cost. :meth:`to_record` is its entry in the step record's ``recoveries``."""

    what: str
    attempt: int
    decisions: tuple[str, ...]
    lost: tuple[int, ...]
    reason: str
    world_before: tuple[int, ...]
    world_after: tuple[int, ...]
    step_completed: bool
    recovery_ms: float
    detected_by: str | None = None
    """How the failure was found ("heartbeat" or "ray"; None: not known) and ``detect_ms`` after the lost workers'
    last sign of life."""
    detect_ms: float | None = None
    drain: dict | None = None
    """The lost workers' node was being drained (``NodeDrain.fields()`` and why they did not leave in time)."""
    layout: str | None = None
    """What the sharding does differently with the new world's size, when that changed."""
    out_of_memory: dict | None = None
    """The memory budget lowered for the re-plan (``control.memory_budget.lowered_after_oom``'s record)."""

    def to_record(self) -> dict:
        rec = {
            "what": self.what,
            "attempt": self.attempt,
            "decisions": list(self.decisions),
            "lost": list(self.lost),
            "reason": self.reason,
            "world_before": list(self.world_before),
            "world_after": list(self.world_after),
            "step_completed": self.step_completed,
            "recovery_ms": self.recovery_ms,
        }
        if self.detected_by is not None:
            rec["detected_by"], rec["detect_ms"] = self.detected_by, self.detect_ms
        if self.drain is not None:
            rec["drain"] = self.drain
        if self.layout:
            rec["layout"] = self.layout
        if self.out_of_memory is not None:
            rec["out_of_memory"] = self.out_of_memory
        return rec


@dataclass(frozen=True)
class ElasticPolicy:
    """When to shrink, grow, retry, wait or give up."""

    min_workers: int
    max_workers: int
    wait_s: float = 60.0
    """How long to wait for capacity when fewer than ``min_workers`` survive."""
    max_attempts: int = 5
    """Attempts at one step (each failure that leaves a usable world costs one) before giving up."""

    def __post_init__(self) -> None:
        if not 1 <= self.min_workers <= self.max_workers:
            raise ValueError(f"need 1 <= min_workers <= max_workers, got {self.min_workers}, {self.max_workers}")

    def on_failure(self, alive: Iterable[int], failure: Failure, attempt: int) -> Decision:
        """The decision after attempt number ``attempt`` (0-based) failed with ``failure``."""
        alive = tuple(sorted(alive))
        if failure.errors:
            wid, msg = failure.errors[0]
            return Fail(f"worker {wid} failed (not a membership problem, so not retried): {msg}")
        survivors = tuple(w for w in alive if w not in failure.lost)
        if not survivors:
            return Fail(f"all {len(alive)} workers were lost (ids {list(alive)}); the model state lived only on them")
        if attempt + 1 >= self.max_attempts:
            return Fail(f"gave up after {attempt + 1} failed attempts at one step (elastic.max_attempts)")
        if not failure.lost and failure.out_of_memory:
            return Retry(
                f"workers {sorted(failure.out_of_memory)} ran out of device memory: re-plan the step with a smaller "
                "memory budget and run it again"
            )
        if not failure.lost:
            return Retry("a collective failed but every worker is alive: re-form the world and run again")
        lost = tuple(sorted(failure.lost))
        if len(survivors) < self.min_workers:
            return WaitForCapacity(lost, survivors, self.min_workers - len(survivors), self.wait_s)
        return Shrink(lost, survivors)

    def on_drain(
        self, alive: Iterable[int], leaving: Iterable[int], left_s: float | None, needed_s: float
    ) -> Leave | Stay:
        """A node holding ``leaving`` is being drained, its deadline ``left_s`` seconds away (None: none); a
        planned leave (handoff and re-form) is expected to take ``needed_s``."""
        alive, leaving = tuple(sorted(alive)), tuple(sorted(set(leaving)))
        unknown = set(leaving) - set(alive)
        if unknown:
            raise ValueError(f"workers {sorted(unknown)} are leaving but not members (alive: {list(alive)})")
        survivors = tuple(w for w in alive if w not in leaving)
        if not survivors:
            return Stay(leaving, "every worker is on draining nodes: no one is left to hand the state to")
        if len(survivors) < self.min_workers:
            return Stay(leaving, f"{len(survivors)} workers would be left, below min_workers={self.min_workers}")
        if left_s is not None and left_s < needed_s:
            return Stay(
                leaving,
                f"the deadline is {max(left_s, 0.0):.1f} s away and a handoff needs about {needed_s:.1f} s",
            )
        return Leave(leaving, survivors)

    def on_slow(self, alive: Iterable[int], slow: Iterable[int]) -> Retire:
        """Members ``slow`` (slowest first) stayed below ``[elastic] retire_below_speed``: retire the slowest that the
        world can lose without dropping below ``min_workers``; the rest are kept, with why."""
        alive, slow = tuple(sorted(alive)), tuple(dict.fromkeys(slow))
        unknown = set(slow) - set(alive)
        if unknown:
            raise ValueError(f"workers {sorted(unknown)} are slow but not members (alive: {list(alive)})")
        room = max(0, len(alive) - self.min_workers)
        leaving, kept = tuple(sorted(slow[:room])), slow[room:]
        survivors = tuple(w for w in alive if w not in leaving)
        reason = ""
        if kept:
            reason = (
                f"retiring {'it' if len(kept) == 1 else 'them'} would leave {len(survivors) - len(kept)} workers, "
                f"below min_workers={self.min_workers}"
            )
        return Retire(leaving, survivors, tuple(sorted(kept)), reason)

    def on_parts_lost(
        self, lost: Iterable[int], reason: str, what: str | None = None, drain: dict | None = None
    ) -> RollBack:
        """Model state whose every holder was lost (``lost``; ``reason``: what was lost) cannot be rebuilt from
        the survivors: back to the last checkpoint."""
        return RollBack(tuple(sorted(lost)), reason, what, drain)

    def on_out_of_memory(self, failure: Failure) -> ReplanForMemory | None:
        """A failed attempt in which workers ran out of device memory is planned again for less memory per worker,
        whatever :meth:`on_failure` decides about who was lost; None when nobody ran out."""
        if not failure.out_of_memory:
            return None
        return ReplanForMemory(failure.out_of_memory, failure.oom_messages)

    def at_boundary(self, size: int, joining: int, free_slots: int) -> Grow | None:
        """Grow by what fits under ``max_workers`` and the free slots; ``joining`` workers are already starting."""
        room = self.max_workers - size - joining
        count = min(room, int(free_slots))
        return Grow(count) if count > 0 else None
