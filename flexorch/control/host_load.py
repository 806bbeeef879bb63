"""Is this process niced on a busy node? Ray starts its worker processes, and so every flexorch actor (the driver, the
planner, the workers), at niceness 15 by default (Ray's ``worker_niceness`` setting), so on a node whose CPUs other
processes keep busy they run on what is left, and plans and the workers' start crawl (what was measured is in
docs/guide/elastic.md).

flexorch's own local Ray starts them at niceness 0 (``flexorch.cli.train.ray_session``); a cluster started with
``ray start`` keeps its own setting, so the driver says once when it finds itself niced on a busy node.
"""

from __future__ import annotations

import os

__all__ = ["niced_on_busy_node"]


def niced_on_busy_node(nice: int | None = None, load: float | None = None, cpus: int | None = None) -> str | None:
    """A warning when this process runs niced (``nice`` > 0) on a node whose 1-minute load average (``load``) is at
    least its CPU count (``cpus``), with what to do; None otherwise. Arguments default to this process and node."""
    nice = os.nice(0) if nice is None else nice
    load = os.getloadavg()[0] if load is None else load
    cpus = (os.cpu_count() or 1) if cpus is None else cpus
    if nice <= 0 or load < cpus:
        return None
    return (
        f"WARNING: Ray runs flexorch's actors at niceness {nice} (Ray's default worker_niceness is 15) on a busy node "
        f"(load {load:.1f} on {cpus} CPUs): the driver, planner and workers get only what other processes leave, so "
        "plans may time out and steps run slow. Start Ray's nodes with `RAY_worker_niceness=0 ray start ...` to give "
        "them a fair share (flexorch's own local Ray does)."
    )
