"""The errors a worker's step raises for the driver to sort (``flexorch.control.settle``): apart from the worker so
that every part of it can raise them."""

from __future__ import annotations

__all__ = ["PeerLostError", "StepOutOfMemoryError", "WorldUnreachableError"]


class PeerLostError(RuntimeError):
    """A collective failed because the world broke (a peer died, hung or left); this worker has left the world
    and keeps its state from before the step, ready to join the next one."""


class StepOutOfMemoryError(RuntimeError):
    """This worker's device ran out of memory in a step. Its gradients are dropped and its cache emptied, so the
    state it holds is the state before the step; the driver re-plans the step with a smaller memory budget."""


class WorldUnreachableError(RuntimeError):
    """Before a world formed, some of its workers could not connect to others at the addresses their collectives
    announce (``flexorch.workers.network.check_reachable``): a setup error, named with the two addresses and what to
    set, not a lost worker. Every rank raises it, so the driver stops the run instead of shrinking it."""
