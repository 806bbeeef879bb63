"""Simulated benchmarks: the planner, its solvers and the cost model on simulated devices; no training runs."""
