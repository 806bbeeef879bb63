"""Shared pytest fixtures."""

from __future__ import annotations

import os
import sys
import tempfile

import pytest

# Prepared corpus stores (flexorch.data.store) of this test session go to a directory of its own, not the user's
# ~/.cache: set before any Ray starts, so drivers and workers inherit it. Shared by the session's tests (a source
# prepared once is reused, as across a user's runs).
os.environ.setdefault("FLEXORCH_DATA_CACHE", tempfile.mkdtemp(prefix="flexorch-corpora-"))
os.environ.setdefault("FLEXORCH_REMOTE_CACHE", tempfile.mkdtemp(prefix="flexorch-remote-"))


@pytest.fixture(scope="module", autouse=True)
def _shared_ray_is_left_clean():
    """After each module: a shared Ray with slots still held (an actor a failed test did not stop) is shut down, so
    the next module starts from a clean one instead of waiting for slots."""
    yield
    if "ray" in sys.modules:
        from tests.ray_env import release_if_held

        release_if_held()


@pytest.fixture(scope="module")
def ray_cluster():
    """The suite's shared local Ray (``tests.ray_env.shared_ray``)."""
    from tests.ray_env import shared_ray

    yield shared_ray()


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
