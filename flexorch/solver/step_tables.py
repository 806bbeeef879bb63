"""One step's batch on N devices, tabled once for the planner's stages: the group types, each sequence's time on
each (``solver.packing``), the batch's area and the slowest sequences' rounds (``solver.round_bounds``), and the tiers
the candidate splits are made by (``solver.microbatching.partition_candidates``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from flexorch.solver.bounds import area_and_min_time
from flexorch.solver.errors import InfeasibleBatchError
from flexorch.solver.group_tables import GroupTables
from flexorch.solver.halves import light_fill, plan_rounds, tier_devices
from flexorch.solver.packing import best_homogeneous_draft, group_types, time_table, type_caps, type_overheads
from flexorch.solver.placement import capacity_rows
from flexorch.solver.planner_config import PlannerConfig
from flexorch.solver.profiles import Profile
from flexorch.solver.round_bounds import best_round_split, slowest_fronts

__all__ = ["StepTables", "split_tiers", "step_tables"]


@dataclass
class StepTables:
    """One step's batch on ``n`` devices and its tables, shared by the stages of
    :meth:`flexorch.solver.planner.Planner.plan`."""

    lengths: np.ndarray
    n: int
    cap: int
    """Tokens per device: the most any group holds per device (for bounds and candidate splits)."""
    types: list
    caps_t: np.ndarray
    """Tokens a group of each type holds."""
    table: np.ndarray
    """Each sequence's time on each group type."""
    overheads: np.ndarray
    """b1 + collective latency per group type, once per micro-batch."""
    area: np.ndarray
    wall: np.ndarray
    deg: np.ndarray
    slowest: tuple
    """The slowest sequences' rounds (``solver.round_bounds.slowest_fronts``): for the bound and the splits."""
    topology: object = None
    """The nodes (``solver.topology.Topology``) the groups are placed on and priced by; None: one node."""
    capacity: tuple = ()
    """The MILP's node-capacity rows (``solver.placement.capacity_rows``); empty without a topology."""

    @property
    def groups(self) -> GroupTables:
        """The tables the micro-batch solvers take (``solver.fill``, ``solver.exact``, ``solver.milp``)."""
        return GroupTables(self.types, self.table, self.lengths, self.n, self.caps_t, self.overheads, self.capacity)

    @property
    def packing(self) -> tuple:
        """(types, caps_t, overheads, table, lengths, n): the packing functions' arguments, in their order."""
        return (self.types, self.caps_t, self.overheads, self.table, self.lengths, self.n)

    def homogeneous_starts(self, split, deadline: float | None = None) -> list:
        """Each micro-batch's best homogeneous layout (its static start; None where none packs)."""
        t, caps_t, overheads, table, lengths, n = self.packing
        return [best_homogeneous_draft(c, t, table, lengths, n, caps_t, overheads, deadline=deadline) for c in split]


def step_tables(lengths, n: int, prof: Profile, cfg: PlannerConfig, topology=None) -> StepTables:
    """The step's group types and time tables; raises InfeasibleBatchError when a sequence fits no group. With a
    ``topology`` the types are priced by where they will lie (``packing.group_types``) and the MILP gets the node
    capacity rows that keep them there (``solver.placement``)."""
    cap = prof.tokens_per_device
    types = group_types(n, prof, cfg.kinds, topology, cfg.hybrid)
    caps_t = type_caps(types, prof)
    table = time_table(lengths, types, prof)
    overheads = type_overheads(types, prof)
    area, wall = area_and_min_time(table, types)
    if not np.isfinite(area).all():
        i = int(np.flatnonzero(~np.isfinite(area))[0])
        raise InfeasibleBatchError(
            f"sequence {i} ({lengths[i]} tokens) fits no group of kinds {cfg.kinds} on {n} devices (Ulysses "
            f"degrees must divide num_heads={prof.num_heads}); allow 'ring' or use more devices"
        )
    deg = np.array([t.degree for t in types], dtype=np.float64)
    slowest = slowest_fronts(table, deg, lengths, n, cap)
    rows = capacity_rows([t.degree for t in types], [t.spans for t in types], topology)
    return StepTables(lengths, n, cap, types, caps_t, table, overheads, area, wall, deg, slowest, topology, rows)


def split_tiers(step: StepTables, cfg: PlannerConfig) -> tuple:
    """``partition_candidates``'s tiers: the least degree that holds each sequence (a tier's sequences run side by
    side), each sequence's least-device-time type, and the slowest sequences' rounds as starts."""
    table, deg, lengths, n, cap = step.table, step.deg, step.lengths, step.n, step.cap
    cheapest = np.argmin(table * deg[None, :], axis=1)  # each sequence's least-device-time type
    rows = np.arange(len(lengths))
    own = (deg[cheapest].astype(np.int64), table[rows, cheapest])
    need = deg[np.argmax(np.isfinite(table), axis=1)].astype(np.int64)
    # the slowest sequences' micro-batches as the rounds bound places them, each chain on its least degree
    # (the relaxed fronts: every chain on its least degree), a start
    relaxed = slowest_fronts(table, deg, lengths, n, cap, per_degree=False) if cfg.round_splits else None
    rounds = best_round_split(*relaxed) if cfg.round_splits else None
    halves = None
    if cfg.halves:  # and as they run: one group of N, or two of N/2 each running a share (solver.halves)
        g = light_fill(table, deg, lengths, step.slowest[0], n, cap)
        halves = (
            tier_devices(need, *step.slowest, g, n),
            plan_rounds(*step.slowest, g, n) if cfg.round_splits else None,
        )
    return (step.wall, need, n, own, rounds, halves)
