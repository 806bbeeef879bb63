"""The driver's hands for membership changes: it executes the decisions ``ElasticPolicy`` returns, as they say.

* :meth:`Elastic.recover` after a failed attempt asks the policy and executes its decision's fields:
  :class:`~flexorch.control.membership.Shrink` keeps exactly its ``survivors`` (its ``lost`` are dropped);
  :class:`~flexorch.control.membership.WaitForCapacity` drops its ``lost`` and waits up to its ``timeout_s`` for
  its ``need`` replacements; :class:`~flexorch.control.membership.Retry` drops nobody (every worker is alive) and
  re-forms the world; :class:`~flexorch.control.membership.Fail` stops the run with its ``reason``. In every case
  the members are then brought to one state (if some finished the step's optimizer update before the failure, the
  others copy their state and the step counts as done; otherwise every survivor still holds the state from before
  the step) and form a new world (new epoch, new ranks, new rendezvous). A failure during any of this (a second
  worker dying while the world forms, say) goes back to the policy. Returns what happened, a
  :class:`~flexorch.control.membership.Recovery`. With stage-local parameters (``[pipeline] params = "stage"``) a
  part whose every holder was lost is the policy's :class:`~flexorch.control.membership.RollBack`, raised to the
  driver as :class:`RollingBack`: the driver goes back to its last checkpoint. With sharded model state the new
  world re-shards it from the survivors as it forms (``hsdp``: in place; ``fsdp``: a lost shard had no copy, so
  the group's ``PartsLostError`` and the roll-back).
* :meth:`Elastic.at_boundary` between steps: admit workers that finished starting (new world, state copied to
  them from a member), then start new ones where the cluster has free slots, up to ``max_workers``.
* :meth:`Elastic.leave_drained` at a step boundary, before that: the members on nodes being drained
  (``control.drains``, watched from a thread) leave as the policy's :class:`~flexorch.control.membership.Leave`
  says: they hand off what only they hold (``WorkerGroup.hand_off``), go, and the world re-forms without them, so
  nothing is re-run or rolled back. A :class:`~flexorch.control.membership.Stay` (the deadline is too near for a
  handoff) leaves them to the lost-node path when the node goes, and so does a node that goes during the handoff;
  the records say which.
* :meth:`Elastic.retire_slow` at a step boundary, after the drains: members whose speed stayed below ``[elastic]
  retire_below_speed`` (``control.slow_retire``) are retired as failed the same way, as the policy's
  :class:`~flexorch.control.membership.Retire` says (never below ``min_workers``).
"""

from __future__ import annotations

import dataclasses
import time

from flexorch.config.elastic import ElasticSettings
from flexorch.control.drains import DrainWatch, NodeDrain
from flexorch.control.failures import Failure, MembershipFailure, WorkerGroupError
from flexorch.control.group import WorkerGroup
from flexorch.control.membership import (
    Decision,
    ElasticPolicy,
    Fail,
    Grow,
    Leave,
    Recovery,
    Retry,
    RollBack,
    Shrink,
    Stay,
    WaitForCapacity,
)
from flexorch.control.slow_retire import SlowWorkers, kept_line, retire_line, retire_record, slow_members
from flexorch.work.placement import PartsLostError

__all__ = ["Elastic", "ElasticError", "RollingBack", "DRAIN_MARGIN_S"]

DRAIN_MARGIN_S = 5.0
"""The least time before a drain's deadline that a planned leave is tried with (or twice the last world's
formation, if longer): a handoff and a re-form of a small model took well under a second on CPU workers here, and a
node that goes mid-handoff only costs the lost-node path it would have cost anyway."""


class ElasticError(WorkerGroupError):
    """The run cannot go on with the workers it has (the policy said Fail); the last checkpoint is intact."""


class RollingBack(RuntimeError):
    """Carries the policy's :class:`~flexorch.control.membership.RollBack` out of a boundary or a recovery to the
    driver, which executes it (the step it interrupts cannot go on)."""

    def __init__(self, decision: RollBack):
        self.decision = decision
        super().__init__(decision.reason)


class Elastic:
    """Executes the ``ElasticPolicy``'s decisions on ``workers`` (see the module's docstring); ``publish`` gets the
    membership events, ``checkpoint_hint()`` says where the last checkpoint is, ``layout_note(size)`` what the
    sharding does with a world of that size, ``grace_s`` the time a SIGTERM'd worker gets to leave."""

    def __init__(
        self,
        workers: WorkerGroup,
        policy: ElasticPolicy,
        publish,
        checkpoint_hint,
        *,
        layout_note=None,
        grace_s: float = 30.0,
    ):
        self.workers = workers
        self.policy = policy
        self.publish = publish
        self.checkpoint_hint = checkpoint_hint  # () -> str: where the last checkpoint is and how to resume
        self.layout_note = layout_note or (lambda size: None)  # world size -> what the sharding does with it, or None
        self.reform_s = 0.0  # how long the last world took to form: a planned leave needs about that again
        self._driver_drain_taken = False
        self._kept_slow: set[int] = set()  # slow workers the world could not lose, warned about once
        # nodes being drained, seen from a thread within a second; workers that got SIGTERM (their heartbeats)
        self.drains = DrainWatch(
            workers.draining_nodes,
            workers.nodes_of,
            publish,
            own_node=workers.driver_node,
            notices=workers.leaving_notices,
            grace_s=grace_s,
        )

    def watch_drains(self, on_seen=None) -> None:
        """Start watching for drains from a thread (:class:`~flexorch.control.drains.DrainWatch`); ``on_seen(workers)``
        is called (from that thread) with the members of a node the moment its drain is first seen."""
        self.drains.on_seen = on_seen
        self.drains.start()

    def close(self) -> None:
        self.drains.close()

    def driver_drained(self) -> bool:
        """True once, at the first step boundary after the driver's own node was seen draining: the driver then
        writes a checkpoint, so that the new driver started when the node goes re-runs no step."""
        if self._driver_drain_taken:
            return False
        if self.drains.own_drain is None:
            self.drains.poll()
        if self.drains.own_drain is None:
            return False
        self._driver_drain_taken = True
        return True

    def may_leave(self, settings: ElasticSettings) -> bool:
        """Whether members may leave at this step boundary: a member's node is draining, or slow members may be
        retired (``settings.retire_below_speed``). A checkpoint still being copied by the members is waited for
        first (``control.checkpointer``)."""
        nodes = set(self.workers.nodes_of().values())
        return settings.retire_below_speed > 0 or any(self.drains.draining(n) for n in nodes)

    def leave_drained(self, after_step: int, plan_for=None) -> list[dict]:
        """At a step boundary (``after_step`` the last step trained): members on draining nodes leave, one node at
        a time, soonest deadline first, as the policy decides. ``plan_for(n)`` is called once a leave is decided,
        before the handoff, with the world size after it (the driver starts the next plan's solve, which then runs
        while the state moves and the world re-forms). Returns a ``drain`` record per node."""
        records = []
        for drain, on in self.drains.take(self.workers.nodes_of()):
            on = [w for w in on if w in self.workers.worker_ids]
            if on:
                records.append(self._leave(drain, on, after_step, plan_for))
        return records

    def _leave(self, drain: NodeDrain, on: list[int], after_step: int, plan_for=None) -> dict:
        """Execute the policy's decision for the members ``on`` a draining node."""
        w = self.workers
        left_s = drain.left_s()
        needed_s = max(DRAIN_MARGIN_S, 2 * self.reform_s)
        decision = self.policy.on_drain(w.worker_ids, on, left_s, needed_s)
        before = list(w.worker_ids)
        rec = {"what": "drain", **drain.fields(), "deadline_left_s": left_s, "workers": sorted(on)}
        rec.update(after_step=after_step, world_before=before, needed_s=needed_s)
        if isinstance(decision, Stay):
            rec.update(left=[], world_after=before, recovery_ms=0.0, fallback=f"{decision.reason}: they stay until "
                       "the node goes, and the lost-node path recovers then")  # fmt: skip
            self.publish({"event": "membership", **rec})
            return rec
        if not isinstance(decision, Leave):
            raise TypeError(f"{type(decision).__name__} is not a decision on a drain")
        if plan_for is not None:
            plan_for(len(before) - len(decision.leaving))
        what = f"leave draining node {drain.name}"
        moved, recovered = self._planned_leave(decision.leaving, what, f"hand off before node {drain.name} goes", drain)
        if recovered is not None:
            return recovered
        rec.update(moved, left=list(decision.leaving), fallback=None)
        self.publish({"event": "membership", **rec})
        return rec

    def retire_slow(
        self, speeds: SlowWorkers | None, settings: ElasticSettings, after_step: int, plan_for=None
    ) -> list[dict]:
        """At a step boundary (``after_step`` the last step trained): members whose speed (``speeds``) stayed below
        ``settings.retire_below_speed`` (the ``[elastic]`` settings; 0: off) for ``settings.retire_after_steps``
        observed steps are retired as failed, as the policy's ``Retire`` decides: the slowest first, never below
        ``min_workers`` (those kept: a warning, once each). ``plan_for(n)`` as in :meth:`leave_drained`. Returns the
        ``retire`` record (``control.slow_retire.retire_record``), or the usual recovery's record when a worker
        failed on the way; empty when nobody was retired."""
        below, steps = settings.retire_below_speed, settings.retire_after_steps
        if not below or speeds is None:
            return []
        w = self.workers
        slow = slow_members(speeds, w.worker_ids, w.rank_nodes(), below, steps)
        if not slow:
            return []
        decision = self.policy.on_slow(w.worker_ids, [s["worker"] for s in slow])
        kept = [s for s in slow if s["worker"] in decision.kept and s["worker"] not in self._kept_slow]
        if kept:
            self._kept_slow |= {s["worker"] for s in kept}
            self.publish({"event": "progress", "message": kept_line(kept, below, steps, decision.reason)})
        if not decision.leaving:
            return []
        slow = [s for s in slow if s["worker"] in decision.leaving]
        before = list(w.worker_ids)
        if plan_for is not None:
            plan_for(len(decision.survivors))
        names = ", ".join(str(s["worker"]) for s in slow)
        what = f"retire slow worker{'s' if len(slow) > 1 else ''} {names}"
        left, recovered = self._planned_leave(decision.leaving, what, f"hand off before: {what}")
        if recovered is not None:
            return [recovered]
        rec = retire_record(slow, below, steps, after_step, before, left)
        self.publish({"event": "progress", "message": retire_line(rec)})
        return [rec]

    def _planned_leave(
        self, leaving, what: str, handing_off: str, drain: NodeDrain | None = None
    ) -> tuple[dict, None] | tuple[None, dict]:
        """``leaving`` (alive, idle members, at a step boundary) hand off what only they hold, go, and the world
        re-forms without them: nothing is re-run. Returns the figures for their record (what moved, the world after,
        ``reform_ms``, ``recovery_ms``, ``rerun``, the layout) and None; or None and the record of the usual recovery,
        when a worker failed on the way (``handing_off``: what the run was doing if it was the handoff). Raises
        :class:`RollingBack` when the handoff left some model state without a holder. ``drain``: the leaving's
        node is being drained (``what`` they do: e.g. ``leave draining node X``)."""
        w = self.workers
        where = {} if drain is None else drain.fields()
        before = len(w.worker_ids)
        t0 = time.perf_counter()
        try:
            moved = w.hand_off(leaving)
        except MembershipFailure as e:  # the node went before the handoff finished (or another failure)
            # nobody ran a step: ``completed`` (workers that finished the call) says nothing about model state
            failure = dataclasses.replace(e.failure, completed=frozenset())
            why = "the handoff did not finish before the node went" if drain is not None else None
            return None, self.recover(failure, 0, handing_off, drain_fallback=why).to_record()
        t1 = time.perf_counter()
        w.remove(leaving, retiring=True)
        try:
            w.form_world()
        except MembershipFailure as e:  # a stayer failed while the smaller world formed: the usual recovery
            failure = dataclasses.replace(e.failure, completed=frozenset())
            out = self.recover(failure, 0, f"re-form the world ({what})").to_record()
            if drain is not None:
                out["drain"] = where
            return None, out
        except PartsLostError as e:  # the handoff missed a shard: the driver rolls back, and says why
            left = {**where, "fallback": "the handoff left a shard behind"} if drain is not None else None
            raise RollingBack(self.policy.on_parts_lost(e.lost_workers, str(e), what, left)) from e
        missing = w.missing_parts()  # the handoff gave the stayers every part; were any left behind, roll back
        if missing:
            err = PartsLostError(missing, list(leaving))
            left = {**where, "fallback": "the handoff left a part behind"} if drain is not None else None
            raise RollingBack(self.policy.on_parts_lost(err.lost_workers, str(err), what, left))
        t2 = time.perf_counter()
        self.reform_s = t2 - t1
        out = {**moved, "world_after": list(w.worker_ids), "reform_ms": (t2 - t1) * 1e3}
        out.update(recovery_ms=(t2 - t0) * 1e3, rerun=False)
        if w.form_phases_ms:  # where the re-form went (the slowest member's phases)
            out["reform_phases_ms"] = w.form_phases_ms
        note = self._layout(before, len(w.worker_ids))
        if note:
            out["layout"] = note
        return out, None

    def _drained(self, lost, why: str | None = None) -> dict | None:
        """The drain of the node the lost workers ran on, if it was being drained, with ``why`` they did not leave
        on notice (default: its deadline came before a step boundary took them out)."""
        nodes = self.workers.nodes_of()
        for wid in sorted(lost):
            drain = self.drains.draining(nodes.get(wid, ""))
            if drain is not None:
                why = why or "the node went before its workers left at a step boundary"
                return {**drain.fields(), "fallback": why}
        return None

    def recover(
        self, failure: Failure, attempt: int, what: str, fresh=(), drain_fallback: str | None = None
    ) -> Recovery:
        """Bring the run back to a formed world after ``failure``; raises :class:`ElasticError` when it cannot, and
        :class:`RollingBack` with the policy's roll-back when some model state lost its every holder.

        ``failure.completed`` are the workers that finished the failed step (their state is after it); ``fresh``
        are members that hold no model state yet."""
        w = self.workers
        t0 = time.perf_counter()
        detected = w.detection(failure.lost)  # before a re-formed world forgets it
        drained = self._drained(failure.lost, drain_fallback)  # lost with a draining node: the record says so
        before = tuple(w.worker_ids)
        ahead = set(failure.completed)  # finished the attempt: hold the state after it
        fresh = set(fresh)  # started to replace the lost: hold no state yet
        decisions, reasons, lost_all = [], [], set()
        while True:
            decision = self.policy.on_failure(w.worker_ids, failure, attempt)
            decisions.append(type(decision).__name__)
            reasons.append(_reason(failure, decision))
            lost = self._drop(decision, what)
            lost_all |= lost
            ahead &= set(w.worker_ids)
            fresh &= set(w.worker_ids)
            if not set(w.worker_ids) - fresh:
                raise ElasticError(f"{what}: every worker that held the model state was lost. {self.checkpoint_hint()}")
            try:
                self._reform(decision, ahead, fresh)
            except MembershipFailure as e:
                failure = e.failure
                attempt += 1
                continue
            except PartsLostError as e:  # the roll-back's record says the lost were on a draining node
                raise RollingBack(self.policy.on_parts_lost(e.lost_workers, str(e), drain=drained)) from e
            restored = w.restored  # sharded state: the version the new world re-sharded
            if ahead and restored is not None and restored["version"] != restored["newest"]:
                ahead = set()  # the update survived only on workers that lost shards: the step runs again
            missing = w.missing_parts()  # stage-local parameters: some part's every holder may be gone
            if missing:
                err = PartsLostError(missing, sorted(lost_all))
                raise RollingBack(self.policy.on_parts_lost(err.lost_workers, str(err), drain=drained))
            recovery = Recovery(
                what, attempt, tuple(decisions), tuple(sorted(lost_all)), "; then ".join(reasons), before,
                tuple(w.worker_ids), bool(ahead), (time.perf_counter() - t0) * 1e3, drain=drained,
            )  # fmt: skip
            if detected is not None:  # from the lost workers' last heartbeat to the failure seen
                # re-forming starts when the failure is seen: the survivors' way out of the broken world counts
                recovery = dataclasses.replace(
                    recovery, detected_by=detected["by"], detect_ms=detected["detect_ms"],
                    recovery_ms=recovery.recovery_ms + detected.get("since_ms", 0.0),
                )  # fmt: skip
            recovery = dataclasses.replace(recovery, layout=self._layout(len(before), len(w.worker_ids)))
            self.publish({"event": "membership", **recovery.to_record()})
            return recovery

    def _reform(self, decision: Decision, ahead: set[int], fresh: set[int]) -> None:
        """Wait for capacity when the decision says so, copy the state to the members that lack it (from one that
        finished the failed step, else from a holder) and form a world. ``ahead`` and ``fresh`` are updated in
        place: after the copy every member holds what ``ahead`` held, and no member is fresh."""
        w = self.workers
        if isinstance(decision, WaitForCapacity):
            fresh |= self._wait_for_capacity(decision)
        source = min(ahead) if ahead else min(set(w.worker_ids) - fresh)
        targets = set(w.worker_ids) - ahead if ahead else set(fresh)
        w.sync_state(source, targets)
        if ahead:
            ahead |= set(w.worker_ids)
        fresh.clear()
        self.reform_s = w.form_world()

    def _layout(self, before: int, after: int) -> str | None:
        """What the sharding does with a world of ``after`` workers, when that differs from ``before``'s; else
        None."""
        note = self.layout_note(after)
        return note if note and note != self.layout_note(before) else None

    def _note_layout(self, rec: dict) -> None:
        """Add ``layout`` to a membership record when the new world's size changes what the sharding does."""
        note = self._layout(len(rec["world_before"]), len(rec["world_after"]))
        if note:
            rec["layout"] = note

    def _drop(self, decision: Decision, what: str) -> set[int]:
        """The members a decision drops, dropped: a Shrink keeps exactly its survivors, a WaitForCapacity drops its
        lost (and waits after), a Retry drops nobody; a Fail raises :class:`ElasticError` with its reason."""
        w = self.workers
        if isinstance(decision, Fail):
            raise ElasticError(f"{what}: {decision.reason}. {self.checkpoint_hint()}")
        if isinstance(decision, Shrink):
            gone = set(w.worker_ids) - set(decision.survivors)
        elif isinstance(decision, WaitForCapacity):
            gone = set(decision.lost) & set(w.worker_ids)
        elif isinstance(decision, Retry):
            gone = set()
        else:
            raise TypeError(f"{what}: {type(decision).__name__} is not a decision after a failure")
        if gone:
            w.remove(gone)
        return gone

    def _wait_for_capacity(self, decision: WaitForCapacity) -> set[int]:
        """Start replacements and wait for ``decision.need`` of them; returns their ids (admitted, stateless)."""
        w = self.workers
        if len(w.joining) < decision.need:
            w.start_workers(decision.need - len(w.joining))
        self.publish(
            {
                "event": "waiting",
                "alive": list(w.worker_ids),
                "need": decision.need,
                "min_workers": self.policy.min_workers,
                "timeout_s": decision.timeout_s,
            }
        )
        deadline = time.monotonic() + decision.timeout_s
        admitted: set[int] = set()
        while len(admitted) < decision.need:
            left = deadline - time.monotonic()
            ready = w.ready_joiners(wait_s=max(0.0, min(1.0, left)))
            w.admit(ready)
            admitted |= set(ready)
            if len(admitted) < decision.need and left <= 0:
                raise ElasticError(
                    f"only {w.size} workers are alive (min_workers={self.policy.min_workers}) and no capacity for "
                    f"{decision.need - len(admitted)} more appeared within elastic.wait_s={decision.timeout_s:g} s. "
                    f"{self.checkpoint_hint()}"
                )
        return admitted

    def at_boundary(self) -> dict | None:
        """Between steps: admit ready joiners into a new world, start workers on free slots. Returns a record of
        the workers that joined, or None."""
        w = self.workers
        ready = w.ready_joiners()
        record = None
        if ready:
            t0 = time.perf_counter()
            before = list(w.worker_ids)
            source = min(before)
            w.admit(ready)
            try:
                w.sync_state(source, ready)
                self.reform_s = w.form_world()
            except MembershipFailure as e:
                # the joiners hold no state unless the copy finished; let recovery sort the survivors out
                failure = dataclasses.replace(e.failure, completed=frozenset())
                return self.recover(failure, 0, "admit joining workers", fresh=set(ready)).to_record()
            except PartsLostError as e:  # sharded state lost a shard with a member that left since the last world
                raise RollingBack(self.policy.on_parts_lost(e.lost_workers, str(e))) from e
            record = {
                "what": "grow",
                "joined": ready,
                "world_before": before,
                "world_after": list(w.worker_ids),
                "recovery_ms": (time.perf_counter() - t0) * 1e3,
            }
            self._note_layout(record)
            self.publish({"event": "membership", **record})
        grow = self.policy.at_boundary(w.size, len(w.joining), w.free_slots())
        if isinstance(grow, Grow):
            ids = w.start_workers(grow.count)
            self.publish({"event": "starting", "worker_ids": ids, "size": w.size})
        return record


def _reason(failure: Failure, decision: Decision) -> str:
    parts = []
    if failure.lost:
        parts.append(f"workers {sorted(failure.lost)} died or hung")
    if failure.peer_errors:
        parts.append(f"workers {sorted(failure.peer_errors)} saw the world break")
    if isinstance(decision, Retry):
        parts.append(decision.reason)
    return ", ".join(parts) or "a collective failed"
