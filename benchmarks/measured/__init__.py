"""Measured benchmarks: real training steps on CPU worker processes of this machine (Ray or gloo)."""
