"""Errors the planner raises. Each message says what was wrong, with the numbers, and what to do."""

__all__ = ["PlanningError", "InfeasibleBatchError", "InvalidPlanError", "ProfileError"]


class PlanningError(ValueError):
    """Base class for every planning error (a ValueError: the input, not the program, is at fault)."""


class InfeasibleBatchError(PlanningError):
    """No layout of the available devices can run this batch (e.g. a sequence longer than N devices hold)."""


class InvalidPlanError(PlanningError):
    """A Plan violates one of its invariants (coverage, rank blocks, memory, degree, heads)."""


class ProfileError(PlanningError):
    """A cost-model profile is unknown or malformed."""
