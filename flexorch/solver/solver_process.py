"""Where the planner's MILP solves run: solver processes the :class:`~flexorch.solver.planner.Planner` owns, or
threads of the caller's process.

A native crash of the MILP library (SIGSEGV / SIGABRT in CBC, coin-or/Cbc#693) in a solver process costs that solve,
not the plan: the pool is killed and restarted, and the planner keeps the micro-batch's static start. Processes come
from a ``forkserver`` that has imported this module (numpy, python-mip, the MILP) once, so a restart costs
milliseconds; each loads its MILP backend's library at start (``load_backend``), not at its first solve.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
import warnings
import weakref
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures.process import BrokenProcessPool

from flexorch.solver import backend
from flexorch.solver.milp import solve_micro_batch

__all__ = ["SolverPool", "solve_job"]


def load_backend(solver: str) -> int:
    """Load the MILP backend's library in the solver process (python-mip parses its C declarations on first use: a
    quarter of a second that would otherwise fall on the first solve)."""
    backend.solver_available(solver)
    return os.getpid()


def solve_job(job: dict):
    """One micro-batch's solve (in the solver process, or a thread with ``isolate=False``); indices are local."""
    for run_first in job.get("before", ()):  # what a probe asked to run in the solver process first (a test's crash)
        run_first()
    # its share of the time left now (the solves queued before it may have ended early), less a margin: the solve
    # may end one bisection step (a short MILP and a packing) past its budget
    left = job["deadline"] - time.monotonic()
    budget = max(0.0, min(job["budget_s"], left / job["share_of"]) * 0.9 - 0.01)
    tables = job["tables"]
    s = solve_micro_batch(
        range(tables.lengths.size),
        tables,
        lower_bound_ms=job["lower_bound_ms"],
        time_budget_s=budget,
        start=job["start"],
        **job["kw"],
    )
    return None if s is None else (s.draft, s.method)


CLOSE_WAIT_S = 1.0
"""How long :meth:`SolverPool.close` lets the solver processes exit on their own before killing them."""
RESTART_WAIT_S = 0.05
"""The same for :meth:`SolverPool.restart`: its process is crashed or stuck in a solve, and a plan waits on it."""


def _mp_context():
    """forkserver (the planner runs in a Ray actor with threads: no fork), preloading the solver once; spawn
    where there is none."""
    if "forkserver" in multiprocessing.get_all_start_methods():
        ctx = multiprocessing.get_context("forkserver")
        # numpy, python-mip and the MILP: imported once, in the server the processes fork from (not the backends'
        # libraries: HiGHS loaded before a fork hangs in the child; each solver process loads its own in `load_backend`)
        ctx.set_forkserver_preload(["flexorch.solver.solver_process"])
        return ctx
    return multiprocessing.get_context("spawn")


def _run_in_thread(fn, arg) -> Future:
    fut: Future = Future()

    def run() -> None:
        if fut.set_running_or_notify_cancel():
            try:
                fut.set_result(fn(arg))
            except BaseException as e:  # noqa: BLE001 - handed to the waiting planner
                fut.set_exception(e)

    threading.Thread(target=run, daemon=True, name="flexorch-milp").start()
    return fut


def _kill_executor(ex: ProcessPoolExecutor | None) -> None:
    if ex is None:
        return
    for p in list((getattr(ex, "_processes", None) or {}).values()):
        try:
            p.kill()
        except (OSError, AttributeError, ValueError):
            pass
    try:
        ex.shutdown(wait=False, cancel_futures=True)
    except (OSError, ValueError):  # at interpreter exit its wake-up pipe may be closed already
        pass


class SolverPool:
    """Where MILP solves run: ``workers`` solver processes (``isolate``), else threads of this process."""

    def __init__(self, workers: int, isolate: bool, solver: str):
        self.workers = workers
        self.solver = solver
        self.isolate = isolate
        self.restarts = 0
        self._ex: ProcessPoolExecutor | None = None
        self._finalizer = None
        self.why_not_isolated = ""
        if isolate:
            try:
                self._start(wait=True)
            except (BrokenProcessPool, OSError, RuntimeError, FutureTimeout) as e:
                # e.g. a script without an `if __name__ == "__main__":` guard (spawn and forkserver children import
                # the main module): solve in this process rather than not at all
                self.close()
                self.isolate = False
                self.why_not_isolated = f"the solver process did not start ({type(e).__name__}: {e})"
                warnings.warn(f"flexorch planner: {self.why_not_isolated}; solving in this process", stacklevel=3)

    def _start(self, wait: bool) -> None:
        self._ex = ProcessPoolExecutor(max_workers=self.workers, mp_context=_mp_context())
        self._finalizer = weakref.finalize(self, _kill_executor, self._ex)
        warm = [
            self._ex.submit(load_backend, self.solver) for _ in range(self.workers)
        ]  # start the processes now, not at a solve
        if wait:
            for f in warm:
                f.result(timeout=120)

    def submit(self, job: dict) -> Future:
        if not self.isolate:
            return _run_in_thread(solve_job, job)
        if self._ex is None:
            self._start(wait=False)
        try:
            return self._ex.submit(solve_job, job)
        except BrokenProcessPool:
            self.restart()
            return self._ex.submit(solve_job, job)

    def restart(self) -> None:
        """Kill the solver processes (crashed or stuck) and start fresh ones (no wait: they come up meanwhile). A
        stuck solve does not exit when asked: it gets ``RESTART_WAIT_S``, not ``CLOSE_WAIT_S`` (a plan cut at its
        deadline waited the whole second for it: on 4 CPU workers a 1 s plan took 1.4 s)."""
        if not self.isolate:
            return  # a thread cannot be killed: the planner stops waiting for it
        self.close(RESTART_WAIT_S)
        self.restarts += 1
        self._start(wait=False)

    def close(self, wait_s: float | None = None) -> None:
        """Shut the pool down: idle solver processes exit on their own (their queues' semaphores released in order:
        SIGKILLed, they left the resource tracker a KeyError traceback and a 'process died unexpectedly' warning to
        print into a finished run's console), then whatever is still running after ``CLOSE_WAIT_S`` is killed."""
        ex = self._ex
        if ex is not None:
            done = threading.Event()

            def shut() -> None:
                try:
                    ex.shutdown(wait=True, cancel_futures=True)
                except (OSError, ValueError, RuntimeError):  # a broken pool: killed below
                    pass
                done.set()

            threading.Thread(target=shut, daemon=True, name="flexorch-solver-close").start()
            done.wait(CLOSE_WAIT_S if wait_s is None else wait_s)
        if self._finalizer is not None:
            self._finalizer()  # kills the processes still up (a stuck solve) and shuts the pool down
        self._ex, self._finalizer = None, None
