"""Wavefront scheduling of pieces on aligned device blocks (Spindle, arXiv 2409.03365, §4.3).

Spindle packs the discretised MetaOps into waves of concurrently running parts. This scheduler is event driven (a
finer form of the same, flexorch's): whenever parts end, the idle tasks, in a fixed priority order, each start their
next piece if a free aligned block of its size exists (lower-priority tasks may start when a higher one cannot:
backfilling); a piece runs all its layers on one block. A task's pieces of one MetaOp may run in either order (they
are layers of the same MetaOp on different counts): the first that fits starts. Waves are the sets of parts that
start at the same event (``plan.waves_of``). Once every idle task that fits has started, the pieces started at an
event widen into free buddy blocks that make them faster (``_grow``): devices nobody can use are not left idle.

Blocks are placed buddy-style: a block of size c starts at a multiple of c, and among the free ones the one whose
enclosing block of 2c is most used is chosen, to keep large blocks free. Moving a task's activations between two
device sets when its pieces change blocks is not charged (flexorch's assumption: every device holds the base).
"""

from __future__ import annotations

import heapq

import numpy as np

from flexorch.solver.multitask.discretise import Piece
from flexorch.solver.multitask.metaop import MetaOp
from flexorch.solver.multitask.plan import Part

__all__ = ["find_block", "schedule", "critical_first"]


def find_block(free: np.ndarray, size: int) -> int | None:
    """Start of a free aligned block of `size` devices (buddy best fit: its 2*size buddy block most used), or None."""
    fits = free[: free.size - free.size % size].reshape(-1, size).all(axis=1)
    idx = np.flatnonzero(fits)
    if idx.size <= 1:
        return int(idx[0]) * size if idx.size else None
    whole = free.size - free.size % (2 * size)  # buddy blocks of 2*size that lie inside the devices
    buddy_free = free[:whole].reshape(-1, 2 * size).sum(axis=1)
    b = idx // 2
    used = np.where(b < buddy_free.size, 2 * size - buddy_free[np.minimum(b, buddy_free.size - 1)], size)
    return int(idx[int(np.argmax(used))]) * size


def critical_first(metaops, pieces) -> list[int]:
    """Tasks by their pieces' total time, longest first (longest-processing-time priority)."""
    ops = {(m.task, m.level): m for m in metaops}
    left: dict[int, float] = {}
    for p in pieces:
        left[p.task] = left.get(p.task, 0.0) + ops[p.task, p.level].time_ms(p.count, p.layers)
    return sorted(left, key=lambda t: -left[t])


def schedule(metaops: tuple[MetaOp, ...], pieces: tuple[Piece, ...], num_devices: int, order=None, grow=True):
    """Start times and blocks for `pieces` (tasks tried in `order`, default ``critical_first``): a tuple of Parts.

    With `grow`, once every idle task that fits has started, the pieces started at this event take, in the same
    order, the largest free aligned block that holds their own (twice, four times... its size) when that makes
    them faster: devices nobody can use until the next event are not left idle."""
    ops = {(m.task, m.level): m for m in metaops}
    order = critical_first(metaops, pieces) if order is None else list(order)
    todo: dict[int, list[list[Piece]]] = {}  # task -> levels in order -> pieces left
    for p in sorted(pieces, key=lambda p: (p.task, p.level, -p.count)):
        levels = todo.setdefault(p.task, [])
        if not levels or levels[-1][0].level != p.level:
            levels.append([])
        levels[-1].append(p)
    free = np.ones(num_devices, dtype=bool)
    running: list[tuple[float, int, int, int]] = []  # (end, task, start device, size)
    idle = set(todo)
    now, parts = 0.0, []
    while True:
        started = len(parts)
        for t in order:
            if t not in idle:
                continue
            for piece in todo[t][0]:
                start = find_block(free, piece.count)
                if start is None:
                    continue
                time_ms = ops[t, piece.level].time_ms(piece.count, piece.layers)
                parts.append(Part(t, piece.level, piece.layers, tuple(range(start, start + piece.count)), now, time_ms))
                free[start : start + piece.count] = False
                heapq.heappush(running, (now + time_ms, t, start, piece.count))
                todo[t][0].remove(piece)
                if not todo[t][0]:
                    todo[t].pop(0)
                idle.discard(t)
                break
        if grow:
            _grow(parts, started, ops, free, running)
        if not running:
            return tuple(parts)  # nothing runs, so nothing waits: every device is free
        now = running[0][0]
        while running and running[0][0] <= now:
            _, t, start, size = heapq.heappop(running)
            free[start : start + size] = True
            if todo[t]:
                idle.add(t)


def _grow(parts: list[Part], started: int, ops, free: np.ndarray, running: list) -> None:
    """Widen the parts started at this event (``parts[started:]``) into free buddy blocks that make them faster."""
    for k in range(started, len(parts)):
        p = parts[k]
        m, size, start = ops[p.task, p.metaop], len(p.devices), p.devices[0]
        best = (p.time_ms, size, start)
        c = size * 2
        while c <= m.counts[-1]:
            base = start - start % c
            block = free[base : base + c]
            if block.size < c or block.sum() != c - size:  # the rest of the buddy block must be free
                break
            t = m.time_ms(c, p.layers)
            if t < best[0]:
                best = (t, c, base)
            c *= 2
        if best[1] == size:
            continue
        time_ms, c, base = best
        free[base : base + c] = False
        running.remove((p.start_ms + p.time_ms, p.task, start, size))
        heapq.heapify(running)
        heapq.heappush(running, (p.start_ms + time_ms, p.task, base, c))
        parts[k] = Part(p.task, p.metaop, p.layers, tuple(range(base, base + c)), p.start_ms, time_ms)
