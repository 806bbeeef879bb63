"""What went wrong in a call on the workers, as values: :class:`Failure` (who was lost, who left the broken world,
who raised, who ran out of memory, who finished) and the errors that carry it.

A worker group sorts each worker's answer to a call into an :class:`Outcomes` (``control.settle`` for Ray actors,
the fake group of the tests for in-process workers); :meth:`Outcomes.failure` is the one place a :class:`Failure`
is built from them. :class:`MembershipFailure` is raised when a call that must succeed on every worker did not;
the elastic policy (``control.membership``) decides from its ``failure``. No Ray here: the driver's pure parts and
the tests import it without a cluster.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Failure", "MembershipFailure", "Outcomes", "WorkerGroupError"]


@dataclass(frozen=True)
class Failure:
    """What the driver saw when an attempt (a step, a world formation, a state transfer) failed. Each field is one
    kind of failure, by worker id."""

    lost: frozenset[int]
    """Worker ids that died, or hung past the collective timeout and were killed."""
    peer_errors: frozenset[int] = frozenset()
    """Alive workers whose collective failed because a peer went away (they left the broken world)."""
    errors: tuple[tuple[int, str], ...] = ()
    """Alive workers that raised anything else: (worker id, message). Deterministic: never retried."""
    completed: frozenset[int] = frozenset()
    """Alive workers that finished the attempt (e.g. the step's optimizer update) before the failure."""
    out_of_memory: frozenset[int] = frozenset()
    """Alive workers whose device ran out of memory in the step (``StepOutOfMemoryError``): the step is re-planned
    with a smaller memory budget and run again."""
    timed_out: frozenset[int] = frozenset()
    """The part of ``lost`` that was killed because the call outlasted its time limit while nothing else had failed
    (hung, or still working on a call too long for the limit): the message says so instead of "lost"."""
    oom_messages: tuple[tuple[int, str], ...] = ()
    """(worker id, the first line of its out-of-memory error: what it tried to allocate, what was free) for the
    workers in ``out_of_memory``."""


@dataclass
class Outcomes:
    """Each worker's answer to one call, sorted as they come: a result, or one kind of failure."""

    results: dict = field(default_factory=dict)
    """{worker id: result} of the workers that finished the call."""
    lost: set = field(default_factory=set)
    peer: set = field(default_factory=set)
    errors: list = field(default_factory=list)
    oom: set = field(default_factory=set)
    oom_messages: list = field(default_factory=list)

    def out_of_memory(self, worker_id: int, message: str) -> None:
        self.oom.add(worker_id)
        self.oom_messages.append((worker_id, message))

    def failure(self, timed_out=frozenset()) -> Failure | None:
        """The :class:`Failure` these outcomes are (None: every worker answered); ``timed_out``: the lost that ran
        past the call's limit while nothing else failed."""
        if not (self.lost or self.peer or self.errors or self.oom):
            return None
        return Failure(
            frozenset(self.lost),
            frozenset(self.peer),
            tuple(self.errors),
            frozenset(self.results),
            frozenset(self.oom),
            frozenset(timed_out),
            tuple(self.oom_messages),
        )


class WorkerGroupError(RuntimeError):
    """Workers could not be placed, or failed in a way the run cannot recover from."""


class MembershipFailure(WorkerGroupError):
    """A call on the workers failed; ``failure`` says who was lost and in which state the others are."""

    def __init__(self, what: str, failure: Failure, timeout_s: float | None = None):
        self.failure = failure
        parts = []
        if failure.lost - failure.timed_out:
            parts.append(f"lost workers {sorted(failure.lost - failure.timed_out)}")
        if failure.timed_out:
            limit = f" within its limit of {timeout_s:.3g} s" if timeout_s is not None else " in time"
            parts.append(f"workers {sorted(failure.timed_out)} did not finish{limit} and were killed")
        if failure.peer_errors:
            parts.append(f"workers {sorted(failure.peer_errors)} left the broken world")
        said: dict[str, list[int]] = {}  # the same error from several workers (a world that cannot connect) once
        for w, m in failure.errors:
            said.setdefault(m, []).append(w)
        parts += [f"worker {ws[0]}: {m}" if len(ws) == 1 else f"workers {sorted(ws)}: {m}" for m, ws in said.items()]
        super().__init__(f"could not {what}: {'; '.join(parts)}")
