"""A pool of real worker processes for multi-process gloo tests.

Spawning processes and importing torch costs seconds, so a test module starts one pool of ``world_size``
processes and runs many jobs on it. A job is a picklable function ``fn(ctx, *args)`` run on every rank at
once; ``ctx.registry()`` opens a fresh torch.distributed world (a new epoch prefix per job) on the shared
TCPStore hosted by the test process. Every wait has a deadline: a failing or hanging job fails its test (the
pool is killed and re-spawned for the next job), it never hangs the suite.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import queue
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist

JOB_TIMEOUT_S = 120.0
PG_TIMEOUT_S = 30.0


@dataclasses.dataclass
class WorkerContext:
    rank: int
    world_size: int
    store: Any
    job: int

    def registry(self, world_size: int | None = None, *, epoch_offset: int = 0, timeout_s: float = PG_TIMEOUT_S):
        from flexorch.workers.process_groups import ProcessGroupRegistry

        return ProcessGroupRegistry(
            store=self.store,
            rank=self.rank,
            world_size=world_size or self.world_size,
            epoch=1000 * self.job + epoch_offset,
            backend="gloo",
            timeout_s=timeout_s,
        )


def _worker_main(rank: int, world_size: int, port: int, tasks: mp.Queue, results: mp.Queue) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=_timeout())
    while True:
        item = tasks.get()
        if item is None:
            return
        job, fn, args = item
        try:
            value = fn(WorkerContext(rank, world_size, store, job), *args)
            results.put((job, rank, True, value))
        except BaseException:
            results.put((job, rank, False, traceback.format_exc()))
        finally:
            if dist.is_initialized():  # a failed job may leave its world open
                dist.destroy_process_group()


def _timeout():
    from datetime import timedelta

    return timedelta(seconds=PG_TIMEOUT_S)


class DistPool:
    """``world_size`` spawned processes that run jobs together; call :meth:`close` when done."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._job = 0
        self._procs: list = []

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=_timeout())
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._results = ctx.Queue()
        self._procs = [
            ctx.Process(
                target=_worker_main,
                args=(r, self.world_size, self._store.port, self._tasks[r], self._results),
                daemon=True,
            )
            for r in range(self.world_size)
        ]
        for p in self._procs:
            p.start()

    def run(self, fn, *args, timeout_s: float = JOB_TIMEOUT_S) -> list:
        """Run ``fn(ctx, *args)`` on every rank; return the values in rank order or raise AssertionError."""
        if not self._procs:
            self._start()
        self._job += 1
        for q in self._tasks:
            q.put((self._job, fn, args))
        values: dict[int, Any] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout_s
        while len(values) + len(errors) < self.world_size:
            try:
                job, rank, ok, value = self._results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                self.close()
                raise AssertionError(
                    f"job {fn.__name__} timed out after {timeout_s:.0f}s; finished ranks: "
                    f"{sorted(values)}, failed: {errors}"
                ) from None
            if job != self._job:
                continue
            (values if ok else errors)[rank] = value
        if errors:
            detail = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
            raise AssertionError(f"job {fn.__name__} failed on ranks {sorted(errors)}:\n{detail}")
        return [values[r] for r in range(self.world_size)]

    def close(self) -> None:
        for q in getattr(self, "_tasks", []):
            q.put(None)
        for p in self._procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self._procs = []
