"""Shared pytest fixtures."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray instance (2 CPUs, no dashboard) for one test module; reuses one that is already running.

    Shuts Ray down at the end of the module only if this fixture started it.
    """
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR")
    yield ray
    if started:
        ray.shutdown()
