"""Fixtures of the cluster level: emulated hosts that share no loopback (``tests/emulated_hosts.py``)."""

from __future__ import annotations

import time

import pytest


@pytest.fixture(scope="module")
def emulated_hosts(request, tmp_path_factory):
    """A module's own cluster of emulated hosts (``tests.emulated_hosts.EmulatedHosts``): a Ray head on a bridge
    with no slots and, by default, 2 hosts of 2 CPU slots, each its own network namespace; a module sets
    ``EMULATED_HOSTS = {"n": 3, "workers_per_host": 2, "rate": "200mbit"}`` for another. Skips where namespaces
    cannot be made. The suite's shared local Ray is shut down first (a test connects to this cluster with
    ``ray.init(address=hosts.head_address)``; the fixture disconnects it at the end). Teardown kills every process the
    harness started and deletes its namespaces, links and bridge, then checks nothing of it is left; the setup and
    teardown seconds go to ``hosts.timings`` (``setup_s``, ``close``; written to ``timings.json`` beside the
    ``ray start`` logs in the module's tmp dir)."""
    import json

    import ray

    from tests.emulated_hosts import EmulatedHosts, unavailable_reason
    from tests.ray_env import release_if_held

    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    release_if_held()
    if ray.is_initialized():
        ray.shutdown()  # the suite's shared local Ray: this module's tests run on the emulated cluster
    kw = {"n": 2, **getattr(request.module, "EMULATED_HOSTS", {})}
    t = time.monotonic()
    root = tmp_path_factory.mktemp("emulated-hosts")
    hosts = EmulatedHosts(root=root, **kw)
    hosts.start()
    hosts.timings["setup_s"] = time.monotonic() - t
    try:
        yield hosts
    finally:
        if ray.is_initialized():
            ray.shutdown()
        hosts.close()
        (root / "timings.json").write_text(json.dumps(hosts.timings, indent=1))
    left = hosts.leftovers()
    assert not left, f"emulated hosts left behind: {left}"
