"""The suite's one local Ray, shared by the modules that need a plain local Ray (``conftest.ray_cluster``,
``train_helpers.training_env``).

Starting and stopping a local Ray costs 3-5 s on the 2-core CI machine; one per module was about a minute of the
suite. A module that needs another Ray (a multi-node ``Cluster``, a metrics export port, fewer CPU slots) shuts this
one down and starts its own; the next module that asks starts the shared one again. Imported as ``tests.ray_env``
everywhere (one copy of its state).
"""

from __future__ import annotations

import time

__all__ = ["SHARED_CPUS", "release_if_held", "shared_ray"]

SHARED_CPUS = 5
"""CPU slots of the suite's shared local Ray: a driver's 4 workers and one spare (its actors need none)."""

_SHARED: dict = {}
"""``gcs``: the address of the shared Ray while it runs."""


def shared_ray():
    """The shared local Ray, started if it is not the one running (none, or another module's own)."""
    import ray

    if _is_shared(ray):
        return ray
    if ray.is_initialized():
        ray.shutdown()
    ctx = ray.init(address="local", num_cpus=SHARED_CPUS, include_dashboard=False, logging_level="ERROR")
    _SHARED["gcs"] = ctx.address_info["gcs_address"]
    return ray


def _is_shared(ray) -> bool:
    return ray.is_initialized() and _SHARED.get("gcs") == ray.get_runtime_context().gcs_address


def release_if_held(wait_s: float = 10.0) -> None:
    """Shut the shared Ray down if its slots are still held ``wait_s`` after a module ended (killed actors give
    their slots back asynchronously): the next module then starts a clean one instead of waiting for slots."""
    import ray

    if not _is_shared(ray):
        return
    deadline = time.monotonic() + wait_s
    while ray.available_resources().get("CPU", 0) < SHARED_CPUS and time.monotonic() < deadline:
        time.sleep(0.2)
    if ray.available_resources().get("CPU", 0) < SHARED_CPUS:
        ray.shutdown()


def kill_private_ray(ray_tmp, remove: bool = True) -> None:
    """SIGKILL every process of a private Ray started with ``RAY_TMPDIR=ray_tmp`` (a CLI's own local Ray: raylet,
    GCS, workers), found by that path in its command line or environment; ``remove``: then delete the directory."""
    import os
    import shutil
    import signal
    from pathlib import Path

    needle = str(ray_tmp).encode()
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if needle in (d / "cmdline").read_bytes() or needle in (d / "environ").read_bytes():
                    os.kill(int(d.name), signal.SIGKILL)
            except (OSError, ProcessLookupError):
                continue
    if remove:
        shutil.rmtree(ray_tmp, ignore_errors=True)


def drain_node(address: str, node_id: str, deadline_s: int) -> None:
    """``ray drain-node`` of ``node_id`` for preemption with ``deadline_s``, by Ray's own CLI, as a user (or an
    autoscaler or KubeRay, through the same GCS call) sends it."""
    import subprocess
    import sys
    from pathlib import Path

    ray_cli = Path(sys.executable).with_name("ray")
    subprocess.run(
        [str(ray_cli), "drain-node", "--address", address, "--node-id", node_id, "--reason",
         "DRAIN_NODE_REASON_PREEMPTION", "--reason-message", "spot preemption notice", "--deadline-remaining-seconds",
         str(deadline_s)],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
