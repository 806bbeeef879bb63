"""What tests and benchmarks inject into a run, shipped with the package (as ``torch.testing`` and Ray's
``ray.cluster_utils`` are) so that worker processes on any node can unpickle it. No production module imports it
(``tests/unit/test_architecture.py`` checks).

* :mod:`flexorch.testing.faults`: :class:`~flexorch.testing.faults.WorkerFault`, a probe a test adds to a worker
  (``Worker.add_probe``) that kills, hangs or fails it at a named point of a step.
"""
