"""The benchmarks, by what they measure (``benchmarks/README.md`` is the index): ``sim`` (the planner and the cost
model, no training), ``measured`` (real runs on CPU workers), ``recovery`` (failures on a multi-node Ray cluster
on this machine), ``gpu`` (a lent GPU machine). Run one from the repository root as
``python -m benchmarks.<folder>.<name>``; what they share is :mod:`benchmarks.common`. Not part of the installed
``flexorch`` package."""
