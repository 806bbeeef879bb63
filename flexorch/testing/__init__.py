"""What tests and benchmarks inject into a run or compare it with, shipped with the package (as ``torch.testing``
and Ray's ``ray.cluster_utils`` are) so that worker processes on any node can unpickle it. No production module
imports it (``tests/unit/test_architecture.py`` checks).

* :mod:`flexorch.testing.faults`: :class:`~flexorch.testing.faults.WorkerFault`, a probe a test adds to a worker
  (``Worker.add_probe``) that kills, hangs or fails it at a named point of a step.
* :mod:`flexorch.testing.reference`: the single-process reference every sequence-parallel plan must reproduce
  (docs/design.md §1).
* :mod:`flexorch.testing.pipeline_local`: a planned pipeline step with every stage in one process, the reference
  of the distributed pipeline executor.
* :mod:`flexorch.testing.multitask_svg`: a picture of a multi-task step plan against its baselines
  (``benchmarks/sim/multi_task.py``).
"""
