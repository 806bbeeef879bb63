"""Waiting on the workers and sorting what happened: :meth:`Settler.settle` waits for a call on every worker and
returns a :class:`~flexorch.control.failures.Failure` value (lost, peer errors, deterministic errors, out of memory,
completed) instead of failing on the first error: the elastic driver needs to know who survived and in which state.

:class:`Settler` is a component of :class:`~flexorch.control.worker_group.RayWorkerGroup`: it is given the group's
actors (a live view: the group adds and removes them), the heartbeat watch, the membership (for the epoch a late
abort must not reach past), the collective timeout, a way to close the current rendezvous and ``publish``; it owns
what one wait found out (who went silent, when the world broke, when it last told the pending to abort).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import ray

from flexorch.control.failures import Failure, MembershipFailure, Outcomes
from flexorch.control.heartbeats import Heartbeats
from flexorch.control.membership import Membership
from flexorch.workers.errors import PeerLostError, StepOutOfMemoryError, WorldUnreachableError

__all__ = ["Settler"]

BEAT_CHECK_S = 0.5  # while waiting on workers: how often their heartbeats are looked at
BROKEN_WORLD_SILENCE_S = 3.0
"""Once a world broke (a member lost, its peers failing out), a member still unanswered whose heartbeat has not moved
for this long is counted lost too, without waiting out ``heartbeat_timeout_s``: a live worker beats through any
step (the thread beats beside it), so after a failure three missed beats mean its process or node is gone (a node
killed at once: its raylet and workers, whose deaths Ray reports only after its health check gives up). Not after
a worker's own error: then nothing is lost yet, and the peers hold the state an emergency checkpoint is written from,
so a loaded machine's missed beats must not cost a shard (``ERROR_GRACE_S`` and ``heartbeat_timeout_s`` apply)."""
ERROR_GRACE_S = 15.0
"""After a worker raises (a bug: the run stops), how long its peers get to leave the broken world before they are
killed: they hold the state the emergency checkpoint is written from (``control.emergency``), and on a loaded
2-core machine a peer can take several seconds to fail out of a closed rendezvous (killed sooner, its shard is lost
and no emergency checkpoint can be written). Well below ``collective_timeout_s``: a bug still stops the run in
seconds."""
REABORT_S = 2.0
"""Once a world broke, the members still in a call on it are told to abort it again this often (``abort_world`` is
idempotent): a socket of that world opened after the last abort, by a group the step was still creating, is shut
too, so no survivor waits out the collective timeout on a peer that has already failed out of the world."""
PROGRESS_EVERY_S = 10.0  # while setup waits: a progress event at least this often (and whenever something changed)


def _where(err: BaseException) -> str:
    """`` (at FILE:LINE in FUNC)``: the innermost frame of a worker's own error, from the traceback its worker
    attached as a note (``Worker._guarded``), so a one-line reason still says where it was raised."""
    notes = getattr(err, "__notes__", None) or ()  # optional: only an exception given a note has it (PEP 678)
    for note in reversed(notes):
        frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)', note)
        if frames:
            path, line, func = frames[-1]
            return f" (at {Path(path).name}:{line} in {func})"
    return ""


@dataclass
class _Wait:
    """One :meth:`Settler.settle`: the calls still pending (ref -> worker id), what the others came to, and the
    wait's deadline (brought forward once the world broke)."""

    pending: dict
    deadline: float
    got: Outcomes = field(default_factory=Outcomes)


class Settler:
    """Waiting on calls to the workers and sorting their failures (see the module's docstring)."""

    def __init__(
        self,
        actors: dict,
        heartbeats: Heartbeats,
        membership: Membership,
        *,
        timeout_s: float,
        heartbeat_timeout_s: float,
        close_rendezvous: Callable[[], None],
        publish,
    ) -> None:
        self._actors = actors  # worker id -> actor handle: the group's own dict, members and joiners it admitted
        self.heartbeats: Heartbeats | None = heartbeats
        """The heartbeat watch (None once the group shut down: its store is closed with it)."""
        self._membership = membership
        self.timeout_s = timeout_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._close_rendezvous = close_rendezvous
        self._publish = publish
        self.silent: dict[int, float] = {}
        """Workers declared hung by their heartbeat during the last :meth:`settle`: worker id -> seconds silent."""
        self.failed_at: float | None = None
        """When the last :meth:`settle` saw its first failure (``time.monotonic()``); None: none."""
        self._aborted_at = 0.0  # when the pending were last told to abort the broken world

    def settle(self, refs: dict, timeout_s: float, what: str | None = None) -> tuple[dict, Failure | None]:
        """Wait for every worker's call; returns ({worker id: result} of those that finished, failure or None).

        After the first failure the rendezvous store is closed (a worker waiting in a rendezvous or ``new_group``
        fails at once) and the others get ``collective_timeout_s`` plus a grace to settle (survivors whose
        collective broke fail fast; one blocked on a silent peer fails at its collective timeout); a worker that
        has not answered by then is hung: it is killed and counted as lost. A worker's own error (a bug, bad
        input) is final, so then the others get only ``ERROR_GRACE_S``; those still unanswered then are killed unless
        their heartbeat shows them alive (in a bounded wait: they are left running and reported nowhere, since the
        run stops on the error and its emergency checkpoint may need their state). With ``what``, a wait
        longer than ``PROGRESS_EVERY_S`` publishes progress (who answered, who is still working).
        """
        self.silent, self.failed_at, self._aborted_at = {}, None, 0.0
        t0 = time.monotonic()
        w = _Wait({ref: wid for wid, ref in refs.items()}, t0 + timeout_s)
        tick = t0 + PROGRESS_EVERY_S
        while w.pending:
            now = time.monotonic()
            left = w.deadline - now
            if left <= 0:
                break
            if what is not None and now >= tick:
                tick = now + PROGRESS_EVERY_S
                self._say_waiting(what, len(refs), w.pending, now - t0)
            wait_s = left if what is None else max(0.0, min(left, tick - now))
            if self.failed_at is not None:  # a broken world: abort it again on the pending, now and then
                if now - self._aborted_at >= REABORT_S:
                    self._abort_pending(w.pending.values())
                wait_s = min(wait_s, REABORT_S)
            if self.heartbeat_timeout_s:
                wait_s = min(wait_s, BEAT_CHECK_S)
                if self._drop_silent(w):
                    continue
            ready, _ = ray.wait(list(w.pending), num_returns=1, timeout=wait_s)
            for ref in ready:
                if not self._take(w, ref):
                    self._world_broke(w, ERROR_GRACE_S if w.got.errors else self.timeout_s + 5.0)
        return w.got.results, w.got.failure(self._end_wait(w))

    def _say_waiting(self, what: str, total: int, pending: dict, waited_s: float) -> None:
        msg = (
            f"waiting for workers ({what}): {total - len(pending)} of {total} done after "
            f"{waited_s:.0f} s (still working: workers {sorted(pending.values())})"
        )
        self._publish({"event": "progress", "message": msg})

    def _drop_silent(self, w: _Wait) -> bool:
        """Kill the pending workers whose heartbeat has been silent too long (``heartbeat_timeout_s``; once a member
        was lost, ``BROKEN_WORLD_SILENCE_S``): their sockets close, so peers blocked on them fail at once. True when
        any was dropped."""
        limit = self.heartbeat_timeout_s
        if self.failed_at is not None and not w.got.errors:  # a member was lost: silence means gone too
            limit = min(limit, BROKEN_WORLD_SILENCE_S)
        hung = self.heartbeats.silent(set(w.pending.values()), limit)
        if not hung:
            return False
        for ref in [r for r, wid in w.pending.items() if wid in hung]:
            ray.kill(self._actors[w.pending.pop(ref)], no_restart=True)
        w.got.lost |= set(hung)
        self.silent.update(hung)
        if self.failed_at is None:
            self.failed_at = time.monotonic()
            self._abort_pending(w.pending.values())
        self._close_rendezvous()
        if not w.got.errors:
            w.deadline = min(w.deadline, time.monotonic() + self.timeout_s + 5.0)
        return True

    def _take(self, w: _Wait, ref) -> bool:
        """Sort one finished call: its result, or lost / peer error / out of memory / the worker's own error.
        True when it succeeded."""
        wid = w.pending.pop(ref)
        try:
            w.got.results[wid] = ray.get(ref)
            return True
        except ray.exceptions.RayActorError:
            w.got.lost.add(wid)
        except ray.exceptions.RayTaskError as e:
            cause = e.cause if e.cause is not None else e
            if isinstance(cause, PeerLostError) or isinstance(e, PeerLostError):
                w.got.peer.add(wid)
            elif isinstance(cause, StepOutOfMemoryError):  # not final: re-planned with less memory
                w.got.out_of_memory(wid, str(cause).splitlines()[0][:300])
            else:  # a setup error says what to do at its end: kept whole
                first = str(cause).splitlines()[0][: None if isinstance(cause, WorldUnreachableError) else 500]
                w.got.errors.append((wid, f"{type(cause).__name__}: {first}{_where(cause)}"))
        return False

    def _world_broke(self, w: _Wait, grace_s: float) -> None:
        """A call failed: end every collective still waiting in the world now (the first time), close the
        rendezvous (workers blocked in it fail now), and give the others ``grace_s`` more (a worker's own error
        ends the run, so then only a short grace)."""
        if self.failed_at is None:
            self.failed_at = time.monotonic()
            self._abort_pending(w.pending.values())
        self._close_rendezvous()
        w.deadline = min(w.deadline, time.monotonic() + grace_s)

    def _end_wait(self, w: _Wait) -> set:
        """The wait is over: the workers still pending are hung (killed, lost) unless a worker's own error stopped
        the run and their heartbeat shows them alive, in a bounded wait (left running: their state may be kept,
        ``control.emergency``). Returns those that ran past the call's limit with nothing else failing."""
        timed_out = set()
        for wid in w.pending.values():  # hung past the collective timeout
            if w.got.errors and self.heartbeats.beating(wid):
                continue
            ray.kill(self._actors[wid], no_restart=True)
            w.got.lost.add(wid)
            if self.failed_at is None:  # nothing else failed: the call itself ran past its limit
                timed_out.add(wid)
        return timed_out

    def _abort_pending(self, worker_ids) -> None:
        """Tell workers still in a call on a broken world to shut its sockets down (``Worker.abort_world``, on
        their control thread): a collective waiting on a gone or frozen peer fails at once. Not waited for."""
        self._aborted_at = time.monotonic()
        for w in worker_ids:  # this epoch's world only: a late abort must not reach the next world
            self._actors[w].abort_world.remote(self._membership.epoch)

    def detection(self, lost) -> dict | None:
        """How the last :meth:`settle`'s failure was found (``Heartbeats.detection``): by, detect_ms, since_ms."""
        return self.heartbeats.detection(lost, self.failed_at, self.silent)

    def call_all(self, refs: dict, what: str, timeout_s: float) -> dict:
        """:meth:`settle`, raising :class:`MembershipFailure` on any failure."""
        results, failure = self.settle(refs, timeout_s, what)
        if failure is not None:
            raise MembershipFailure(what, failure, timeout_s)
        return results
