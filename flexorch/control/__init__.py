"""The control plane: the driver and what it drives.

* :mod:`~flexorch.control.driver`: :class:`TrainingDriver`, one explicit transition per :meth:`step`; it takes its
  worker group and planner through a seam, so tests step it against an in-process fake.
* :mod:`~flexorch.control.planner_client`: the planner actor and the client that prefetches the next plan, bounds
  its wait and falls back to a heuristic plan.
* :mod:`~flexorch.control.membership`: the elastic policy, pure (decisions are values).
* :mod:`~flexorch.control.elastic`: the executor of those decisions against a worker group.
* :mod:`~flexorch.control.worker_group`: the Ray worker actors as one group (start, form worlds, run, settle).
* :mod:`~flexorch.control.checkpoint` and :mod:`~flexorch.control.calibration`: checkpoints on disk, the cost
  model calibrated on the workers.
"""
