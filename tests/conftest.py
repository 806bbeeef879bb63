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


def pytest_sessionfinish(session, exitstatus):
    """Leave no Ray running into interpreter teardown, and keep a traceback if teardown still crashes.

    One CI run passed every test and then died with SIGSEGV at exit (not reproduced); pytest's own faulthandler is
    off by then, so it is re-enabled here to name the culprit if it happens again."""
    import faulthandler
    import sys

    import ray

    if ray.is_initialized():
        ray.shutdown()
    faulthandler.enable(file=sys.__stderr__, all_threads=True)
