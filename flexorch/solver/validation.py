"""Input checks shared by the planner and the baselines: say what is wrong, with numbers, and what to do."""

from __future__ import annotations

import numpy as np

from flexorch.solver.cost_model import min_degree
from flexorch.solver.errors import InfeasibleBatchError, PlanningError
from flexorch.solver.profiles import Profile

__all__ = ["check_batch", "check_num_devices", "largest_degree"]


def largest_degree(num_devices: int) -> int:
    """Largest power of two <= N: the biggest SP group N devices can form."""
    return 1 << (num_devices.bit_length() - 1)


def check_num_devices(num_devices) -> int:
    """N as an int; a PlanningError when it is not an integer >= 1. Every planning entry point checks it first: with
    no device there is no group to put a sequence in (a plan of empty micro-batches is what the planner would
    otherwise build, and ``Plan`` refuses it with a message about groups, not devices)."""
    if isinstance(num_devices, bool) or not isinstance(num_devices, int | np.integer):
        raise PlanningError(f"the number of devices must be an integer >= 1, got {num_devices!r}")
    if num_devices < 1:
        raise PlanningError(
            f"the number of devices must be an integer >= 1, got {int(num_devices)}: a step needs at least one alive "
            "worker to plan for (no worker is alive; wait for workers to join, or check why they left)"
        )
    return int(num_devices)


def check_batch(lengths, num_devices: int, profile: Profile) -> np.ndarray:
    """Validate a batch for N devices; returns the lengths as an int64 array."""
    num_devices = check_num_devices(num_devices)
    arr = np.asarray(lengths)
    if arr.ndim != 1:
        raise PlanningError(f"sequence lengths must be a flat list of integers, got shape {arr.shape}")
    if arr.size == 0:
        raise PlanningError("the batch is empty: there is nothing to plan (give at least one sequence)")
    if not np.issubdtype(arr.dtype, np.integer):
        if not np.issubdtype(arr.dtype, np.floating) or not np.all(np.isfinite(arr)) or np.any(arr != np.round(arr)):
            raise PlanningError(f"sequence lengths must be integers, got dtype {arr.dtype}")
    arr = arr.astype(np.int64)
    bad = np.flatnonzero(arr <= 0)
    if bad.size:
        i = int(bad[0])
        raise PlanningError(
            f"sequence {i} has length {int(arr[i])}: lengths must be >= 1 token "
            f"({bad.size} such sequence(s); drop empty documents before planning)"
        )
    dmax = largest_degree(num_devices)
    limit = dmax * profile.tokens_per_device
    over = np.flatnonzero(arr > limit)
    if over.size:
        i = int(over[np.argmax(arr[over])])
        s = int(arr[i])
        need = min_degree(s, profile.tokens_per_device)
        raise InfeasibleBatchError(
            f"sequence {i} has {s} tokens but the largest SP group on {num_devices} devices holds "
            f"{dmax} x {profile.tokens_per_device} = {limit} tokens ({over.size} sequence(s) too long); "
            f"use >= {need} devices, or drop/reject sequences over {limit} tokens (--max-context)"
        )
    return arr
