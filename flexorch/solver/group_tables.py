"""The tables one micro-batch is packed and solved with: the group types of N devices, each sequence's time on each,
what a group of each type holds and costs, and a topology's node-capacity rows.

The micro-batch solvers (``solver.fill.fill_draft``, ``solver.exact.solve_exact``, ``solver.milp.solve_micro_batch``)
take them as one value; the planner tables them once per step (``solver.step_tables.StepTables.groups``), and a
solve sent to a solver process carries its micro-batch's rows alone (:meth:`GroupTables.rows`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from flexorch.solver.packing import GroupType

__all__ = ["GroupTables"]


@dataclass(frozen=True, eq=False)
class GroupTables:
    """A batch's sequences on the group types of ``num_devices`` devices."""

    types: list[GroupType]
    table: np.ndarray
    """``table[i, t]``: sequence i's time on a group of type t (inf where it does not fit)."""
    lengths: np.ndarray
    """Each sequence's tokens."""
    num_devices: int
    caps_by_type: np.ndarray
    """Tokens a group of each type holds (``solver.packing.type_caps``)."""
    overheads: np.ndarray
    """A group's fixed cost per micro-batch, per type: b1 + collective latency (``solver.packing.type_overheads``)."""
    capacity: tuple = ()
    """A topology's node-capacity rows (``solver.placement.capacity_rows``: the group counts that keep each type
    where it is priced); empty: none."""

    def rows(self, items) -> GroupTables:
        """The tables of the sequences ``items`` alone, indexed 0..k-1 in that order."""
        items = list(items)
        return dataclasses.replace(self, table=self.table[items], lengths=self.lengths[items])
