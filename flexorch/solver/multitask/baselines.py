"""The two ways to run several tasks without Spindle, on the same MetaOps and cost model (arXiv 2409.03365, §6.1).

* ``in_turn``: the tasks one after another, each on all devices (its MetaOps on the largest valid count; with T
  non-increasing this is its fastest): makespan = sum_t sum_m L_m T_m(N).
* ``fixed_split``: the devices split once between the tasks, each task on its own aligned power-of-two block for
  the whole step: shares proportional to each task's device-time on its fewest devices (its work on one device
  when it fits there), rounded down to powers of two (at least the task's fewest devices), halved while they
  exceed N (the task furthest above its share first), then spare devices doubling the slowest task's block while
  they fit; makespan = max_t (the task's time on its block). Impossible (inf) when the tasks' fewest devices add
  up to more than N.
"""

from __future__ import annotations

import math

from flexorch.solver.multitask.metaop import MetaOp
from flexorch.solver.multitask.plan import Part

__all__ = ["in_turn_parts", "fixed_split_counts", "fixed_split_parts"]


def _tasks(metaops):
    out: dict[int, list[MetaOp]] = {}
    for m in metaops:
        out.setdefault(m.task, []).append(m)
    return {t: sorted(ms, key=lambda m: m.level) for t, ms in sorted(out.items())}


def in_turn_parts(metaops, num_devices: int) -> tuple[Part, ...]:
    parts, now = [], 0.0
    top = 1 << (num_devices.bit_length() - 1)
    for t, ms in _tasks(metaops).items():
        for m in ms:
            time_ms = m.time_ms(top)
            parts.append(Part(t, m.level, m.layers, tuple(range(top)), now, time_ms))
            now += time_ms
    return tuple(parts)


def _task_ms(ms, count: int) -> float:
    return sum(m.time_ms(count) if count >= m.min_count else math.inf for m in ms)


def fixed_split_counts(metaops, num_devices: int) -> dict[int, int] | None:
    """Each task's block size, or None when the tasks cannot all run at once."""
    tasks = _tasks(metaops)
    top = 1 << (num_devices.bit_length() - 1)
    least = {t: max(m.min_count for m in ms) for t, ms in tasks.items()}
    if sum(least.values()) > num_devices:
        return None
    work = {t: least[t] * _task_ms(ms, least[t]) for t, ms in tasks.items()}
    total = sum(work.values())
    share = {t: num_devices * w / total for t, w in work.items()}
    n = {t: max(least[t], 1 << max(0, math.floor(math.log2(max(share[t], 1.0))))) for t in tasks}
    n = {t: min(c, top) for t, c in n.items()}
    while sum(n.values()) > num_devices:
        t = max((t for t in n if n[t] > least[t]), key=lambda t: n[t] / share[t])
        n[t] //= 2
    while True:
        slow = max(tasks, key=lambda t: _task_ms(tasks[t], n[t]))
        if n[slow] * 2 > top or sum(n.values()) + n[slow] > num_devices:
            return n
        n[slow] *= 2


def fixed_split_parts(metaops, num_devices: int) -> tuple[Part, ...] | None:
    counts = fixed_split_counts(metaops, num_devices)
    if counts is None:
        return None
    tasks = _tasks(metaops)
    parts, start = [], 0
    for t in sorted(tasks, key=lambda t: -counts[t]):  # largest first: consecutive blocks stay aligned
        c, now = counts[t], 0.0
        for m in tasks[t]:
            parts.append(Part(t, m.level, m.layers, tuple(range(start, start + c)), now, m.time_ms(c)))
            now += m.time_ms(c)
        start += c
    return tuple(parts)
