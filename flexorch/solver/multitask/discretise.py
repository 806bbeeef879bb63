"""Bi-point discretisation (Spindle, arXiv 2409.03365, §4.3).

The continuous allocation gives each MetaOp a real device count n* between two valid counts n_lo <= n* <= n_hi
(neighbouring vertices of its hull, ``allocation.Share``) and the share f of its layers that the mixture runs on
n_lo. Spindle keeps both points: l_lo = round(f * L_m) layers on n_lo and l_hi = L_m - l_lo on n_hi, the integer
split whose time and device-time are closest to the continuous ones (both are linear in l_lo).
"""

from __future__ import annotations

from dataclasses import dataclass

from flexorch.solver.multitask.allocation import Allocation
from flexorch.solver.multitask.metaop import MetaOp

__all__ = ["Piece", "bi_point"]


@dataclass(frozen=True)
class Piece:
    """`layers` layers of MetaOp (task, level) to run on `count` devices (not yet placed in time or on devices)."""

    task: int
    level: int
    count: int
    layers: int


def bi_point(metaops: tuple[MetaOp, ...], alloc: Allocation) -> tuple[Piece, ...]:
    """Each MetaOp as one or two pieces (largest count first) whose layers add up to L_m."""
    out = []
    for m, s in zip(metaops, alloc.shares, strict=True):
        l_lo = round(s.lo_fraction * m.layers) if s.n_lo != s.n_hi else 0
        for count, layers in ((s.n_hi, m.layers - l_lo), (s.n_lo, l_lo)):
            if layers > 0:
                out.append(Piece(m.task, m.level, count, layers))
    return tuple(out)
