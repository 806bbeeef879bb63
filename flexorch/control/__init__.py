"""The control plane: the driver and what it drives.

* :mod:`~flexorch.control.driver`: :class:`TrainingDriver`, one explicit transition per :meth:`step`; it takes its
  worker group and planner through a seam, so tests step it against an in-process fake.
* :mod:`~flexorch.control.transitions`: what a step did (trained, skipped, rolled back), as a value; the event log.
* :mod:`~flexorch.control.group`: the worker-group protocol the driver and the elastic executor use.
* :mod:`~flexorch.control.planner_client`: the planner actor and the clients (Ray actor, in-process) that prefetch
  the next plan, bound its wait and fall back to a heuristic plan.
* :mod:`~flexorch.control.membership`: the elastic policy, pure (decisions are values).
* :mod:`~flexorch.control.elastic`: the executor of those decisions against a worker group.
* :mod:`~flexorch.control.worker_group`: the Ray worker actors as one group (start, form worlds, run, settle);
  :mod:`~flexorch.control.worker_start` watches them start (phases, CPU use, why a start failed).
* :mod:`~flexorch.control.fallback_watch`: the run's warning when many steps go without the planner's plan.
* :mod:`~flexorch.control.refitting`: the run's cost model refitted in a thread beside its steps (``[plan] refit``).
* :mod:`~flexorch.control.checkpoint` and :mod:`~flexorch.control.calibration`: checkpoints on disk, the cost
  model calibrated on the workers (the probes it runs: :mod:`~flexorch.control.calibration_probes`).
"""
