"""Shared pytest fixtures."""

from __future__ import annotations

import sys

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


_EXIT_STATUS: list[int] = []


def pytest_sessionfinish(session, exitstatus):
    """Leave no Ray running into interpreter teardown (a session without Ray, e.g. the GPU check's, has none)."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()
    _EXIT_STATUS.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """Exit with pytest's status without running the interpreter's and native libraries' teardown.

    Two full runs of the suite (of about eight) passed every test, printed the summary, and then the process died
    with SIGSEGV during teardown, turning a green run red. faulthandler (re-enabled for teardown) printed nothing,
    so the crash is in native destructors (torch, gloo, CBC or Ray threads), after every result was reported. Once
    every other plugin has finished (trylast), the process ends here with the session's exit status."""
    import os
    import sys

    if not _EXIT_STATUS:  # a session that never finished (collection only, an internal error): normal exit
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_EXIT_STATUS[-1])
