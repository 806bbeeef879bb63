"""Starting worker actors on a slow machine: a worker is waited for while it makes progress, not for a fixed time.

Ray's actor table (GCS) says whether each one is pending a slot (no process yet), loading (its process runs the
constructor: imports, building the model; on this node its CPU time shows it working) or dead (with its own error);
the group gives up only when nothing changed for ``placement_timeout_s``, when a start failed, or at once when the
cluster has fewer slots than needed.

:class:`WorkerStarter` holds the workers started and not yet members of the
:class:`~flexorch.control.worker_group.RayWorkerGroup` (``joining``), what was last seen of each and why a start
failed; the group admits the ready ones.
"""

from __future__ import annotations

import dataclasses
import os
import re
import time

import ray

BUSY_CPU_SHARE = 0.01
"""A starting worker process using at least this share of a core is working. Measured on 2 cores: a
constructor blocked in a sleep used 0.25 % (Ray's own threads), while constructors importing torch beside one CPU
hog per core got only 3-4 % (1.0 s to 2.7 s of CPU in 60 s): a 5 % threshold gave those up as hung."""
CPU_WINDOW_S = 5.0
"""The CPU share is measured over this long (at most a third of the no-progress limit): 1 % of 5 s is five clock
ticks, an idle process gets about one."""

__all__ = ["WorkerStarter"]


def _actor_table_row(actor) -> dict:
    """The GCS actor-table row of ``actor`` (``State``, ``Pid``, ``Address``); {} when it cannot be read.

    ``ray.util.state`` needs the dashboard, which flexorch's local Ray runs without, so this reads the table Ray's
    own state code reads (one GCS lookup, well under a millisecond)."""
    try:
        from ray._private import state

        return state.actors(actor._actor_id.hex()) or {}
    except Exception:  # noqa: BLE001 - a private API that may move: then the phase is just "starting"
        return {}


def _cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of a process on this node (None: gone, or no /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _start_error(e: ray.exceptions.RayError) -> str:
    """A failed worker start in one line: the constructor's own exception (e.g. an ImportError), else Ray's reason."""
    msg = getattr(e, "error_msg", None)  # optional: only some of Ray's errors have it (RayActorError and its kin)
    text = re.sub(r"\x1b\[[0-9;]*m", "", msg or str(e)).strip()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if not lines:
        return type(e).__name__
    init_failed = getattr(e, "actor_init_failed", False)  # optional: only on Ray's actor errors
    return (lines[-1] if init_failed else lines[0])[:500]


@dataclasses.dataclass
class _Seen:
    """What was last seen of a starting worker: its phase (``key``, ``text``) and a CPU-time baseline."""

    key: tuple
    text: str
    cpu: float | None
    cpu_t: float


class WorkerStarter:
    """Worker actors started and not yet members (``joining``), watched until they are up or given up."""

    def __init__(self, *, use_gpu: bool, placement_timeout_s: float):
        self.use_gpu = use_gpu
        self.placement_timeout_s = placement_timeout_s
        """How long starting workers may go without any progress (nothing became ready, no phase changed, no CPU
        used by a loading process on this node) before the ones still starting are given up."""
        self.joining: dict[int, tuple] = {}  # worker id -> (actor, ready ref, start time)
        self._node = ray.get_runtime_context().get_node_id()
        self._seen: dict[int, _Seen] = {}
        self._progress_t = time.monotonic()  # the last time anything about the starting workers changed
        self.start_failures: dict[int, tuple[str, str]] = {}
        """Workers given up while starting: worker id -> (kind, why): "error" (their own error), "slot" (no slot
        came free) or "stalled" (what was last seen of them)."""

    def total_slots(self) -> int:
        return int(ray.cluster_resources().get("GPU" if self.use_gpu else "CPU", 0))

    def free_slots(self) -> int:
        """Unclaimed device slots in the cluster now (a joined node shows up here)."""
        return int(ray.available_resources().get("GPU" if self.use_gpu else "CPU", 0))

    def slot_numbers(self) -> tuple[str, float, float]:
        key = "GPU" if self.use_gpu else "CPU"
        return key, ray.cluster_resources().get(key, 0.0), ray.available_resources().get(key, 0.0)

    def start(self, worker_class, ids: list[int], args: tuple) -> None:
        """Start a ``worker_class`` actor for each new worker id (``args``: the constructor's after the id)."""
        for wid in ids:
            actor = worker_class.options(
                num_cpus=1, num_gpus=1 if self.use_gpu else 0, name=None, max_restarts=0
            ).remote(wid, *args)
            self.joining[wid] = (actor, actor.info.remote(), time.monotonic())
        self._progress_t = time.monotonic()

    def ready(self, wait_s: float = 0.0) -> list[int]:
        """Joining workers whose actor is up. Drops joiners that failed to start (their error goes to
        :attr:`start_failures`) and, once no joiner progressed for ``placement_timeout_s``, those still starting."""
        if not self.joining:
            return []
        by_ref = {j[1]: wid for wid, j in self.joining.items()}
        ready, _ = ray.wait(list(by_ref), num_returns=len(by_ref), timeout=wait_s)
        out = []
        now = time.monotonic()
        for ref in ready:
            wid = by_ref[ref]
            self._progress_t = now
            self._seen.pop(wid, None)
            try:
                ray.get(ref)
                out.append(wid)
            except ray.exceptions.RayError as e:
                self.joining.pop(wid)
                self.start_failures[wid] = ("error", f"failed to start: {_start_error(e)}")
        waiting = [w for w in self.joining if w not in out]
        free = self.free_slots() if waiting else 0
        for wid in waiting:
            self._observe(wid, free, now)
        if waiting and now - self._progress_t > self.placement_timeout_s:
            for wid in waiting:
                seen = self._seen.pop(wid, None)
                last = seen.text if seen else "starting"
                t = self.placement_timeout_s
                self.start_failures[wid] = ("stalled", f"made no progress for {t:g} s (last seen: {last})")
                if seen and seen.key == ("pending", False):
                    self.start_failures[wid] = ("slot", f"waited {t:g} s for a {'GPU' if self.use_gpu else 'CPU'} slot")
                ray.kill(self.joining.pop(wid)[0], no_restart=True)
        return sorted(out)

    def _observe(self, wid: int, free: int, now: float) -> None:
        """Look at a starting worker in Ray's actor table; anything new about it counts as progress."""
        row = _actor_table_row(self.joining[wid][0])
        state, pid = row.get("State"), int(row.get("Pid") or 0)
        cpu = None
        if state == "PENDING_CREATION" and pid:
            local = row.get("Address", {}).get("NodeID") == self._node
            cpu = _cpu_seconds(pid) if local else None
            key, text = ("loading", pid), f"loading (pid {pid}" + (f", {cpu:.1f} s CPU)" if cpu is not None else ")")
            if not local:
                text = f"loading (pid {pid} on node {row.get('Address', {}).get('NodeID', '?')[:8]})"
        elif state == "PENDING_CREATION":
            key = ("pending", free > 0)
            kind = "GPU" if self.use_gpu else "CPU"
            text = f"pending a {kind} slot (none free)" if free <= 0 else "waiting for a worker process"
        elif state == "DEPENDENCIES_UNREADY":
            key, text = ("registering",), "being registered"
        else:  # ALIVE (ready in a moment), DEAD (its error comes with the ready ref), or not readable
            key, text = (state or "unknown",), "starting" if state is None else state.lower()
        prev = self._seen.get(wid)
        seen = _Seen(key, text, cpu, now)
        if prev is None or prev.key != key:
            self._progress_t = now
        elif cpu is not None and prev.cpu is not None:
            # keep the baseline: a small CPU share needs seconds to measure (well inside the no-progress limit)
            if now - prev.cpu_t < min(CPU_WINDOW_S, self.placement_timeout_s / 3):
                seen.cpu, seen.cpu_t = prev.cpu, prev.cpu_t
            elif cpu - prev.cpu >= BUSY_CPU_SHARE * (now - prev.cpu_t):
                self._progress_t = now
        self._seen[wid] = seen

    def take(self, wid: int):
        """The actor of ready joiner ``wid``, no longer joining (it becomes a member)."""
        self._seen.pop(wid, None)
        return self.joining.pop(wid)[0]

    def summary(self, size: int, started: int, elapsed: float) -> str:
        """E.g. '2 of 4 ready after 35 s (2 still starting: worker 2 loading (pid 812, 9.5 s CPU), worker 3
        pending a CPU slot (none free))'."""
        out = f"{size} of {started} ready after {elapsed:.0f} s"
        if self.joining:
            what = ", ".join(f"worker {w} {self.phase(w)}" for w in self.joining)
            out += f" ({len(self.joining)} still starting: {what})"
        if self.start_failures:
            out += "; " + "; ".join(f"worker {w} {why}" for w, (_, why) in sorted(self.start_failures.items()))
        return out

    def phase(self, wid: int) -> str:
        return self._seen[wid].text if wid in self._seen else "starting"

    def failure_message(self, size: int, started: int, need: int, elapsed: float) -> str:
        """Why fewer than ``need`` workers started, and what to do about it."""
        key, total, free = self.slot_numbers()
        head = f"only {size} of {started} workers started after {elapsed:.0f} s (at least {need} needed): "
        reasons = "; ".join(f"worker {w} {why}" for w, (_, why) in sorted(self.start_failures.items()))
        kinds = {kind for kind, _ in self.start_failures.values()}
        if "error" in kinds:
            return (
                f"{head}{reasons}. The worker processes could not be created: fix that error (the workers' Python "
                "environment, the model config) and run again"
            )
        if "slot" in kinds:
            return (
                f"{head}{reasons}. The cluster has {total:g} {key} slots, {free:g} free (other actors or tasks hold "
                f"the rest); {need} are needed: lower `workers`/`min_workers`, free the slots, or add nodes or slots "
                "(e.g. `ray start --num-cpus N`)"
            )
        return (
            f"{head}{reasons}. Nothing progressed for {self.placement_timeout_s:g} s: look at the workers' logs "
            "(/tmp/ray/session_latest/logs/worker-*.err) for why they hang"
        )
