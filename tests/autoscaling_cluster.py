"""A Ray cluster with a real autoscaler on this machine: Ray's fake multi-node provider (``RAY_FAKE_CLUSTER=1``), the
same autoscaler (v1 monitor, ``StandardAutoscaler``) that clouds run, launching and terminating "nodes" that are
raylets on this machine.

``ray.cluster_utils.AutoscalingCluster`` does this too, but its ``start`` runs ``ray stop --force`` (every Ray on the
machine, other tests' and other users' clusters included) and its config template is missing from Ray's wheel. Here
the head listens on 127.0.0.1 on a free port with a temp dir of its own, and shutting down kills exactly the
processes whose command lines name that temp dir (the head's, and every node the autoscaler launched).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.paths import REPO

__all__ = ["autoscaling_cluster"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(port: int, node_cpus: int, max_nodes: int, preempt_dir: Path) -> dict:
    """The fake provider's cluster config: a head with no CPU (the driver and planner actors take none) and one
    worker node type of ``node_cpus`` CPUs, none at first, up to ``max_nodes``; a node is preempted by a file named
    after its id in ``preempt_dir`` (``tests.preempting_provider``)."""
    node = {"resources": {"CPU": node_cpus}, "node_config": {}, "min_workers": 0, "max_workers": max_nodes}
    return {
        "cluster_name": "flexorch-test",
        "max_workers": max_nodes,
        "provider": {
            "type": "external",
            "module": "tests.preempting_provider.PreemptingFakeProvider",
            "preempt_dir": str(preempt_dir),
            "use_node_id_as_ip": True,
            "disable_node_updaters": True,
            "disable_launch_config_check": True,
            "gcs_address": f"127.0.0.1:{port}",
        },
        "available_node_types": {
            "ray.head.default": {"resources": {"CPU": 0}, "node_config": {}, "max_workers": 0},
            "ray.worker.cpu": node,
        },
        "head_node_type": "ray.head.default",
        "auth": {},
        "upscaling_speed": 1.0,
        "idle_timeout_minutes": 5,
        "docker": {},
        "initialization_commands": [],
        "setup_commands": [],
        "head_setup_commands": [],
        "worker_setup_commands": [],
        "head_start_ray_commands": [],
        "worker_start_ray_commands": [],
        "file_mounts": {},
        "cluster_synced_files": [],
        "file_mounts_sync_continuously": False,
        "rsync_exclude": [],
        "rsync_filter": [],
    }


def _pids_naming(text: str) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmd:
            out.append(int(entry))
    return out


def _kill(pids) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def autoscaling_cluster(node_cpus: int = 1, max_nodes: int = 3):
    """Start the head (its monitor runs the autoscaler, updating every second); yield its address and the directory
    where a file named after a node's id preempts that node. Every process of the cluster is killed on exit."""
    temp = Path(tempfile.mkdtemp(prefix="fxas-", dir="/tmp"))  # short: Unix socket paths live under it
    port = _free_port()
    preempt = temp / "preempt"
    preempt.mkdir()
    (temp / "autoscaling.json").write_text(json.dumps(_config(port, node_cpus, max_nodes, preempt)))
    env = {**os.environ, "RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1", "RAY_AUTH_MODE": "disabled"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))  # the monitor loads tests.*
    ray_cli = str(Path(sys.executable).with_name("ray"))
    cmd = [
        ray_cli, "start", "--head", f"--port={port}", "--node-ip-address=127.0.0.1", f"--temp-dir={temp}",
        f"--autoscaling-config={temp / 'autoscaling.json'}", "--num-cpus=0", "--include-dashboard=false",
        f"--metrics-export-port={_free_port()}", "--disable-usage-stats",
    ]  # fmt: skip
    try:
        subprocess.run(cmd, env=env, check=True, capture_output=True, timeout=120)
        yield f"127.0.0.1:{port}", preempt
    finally:
        for _ in range(3):  # nodes the monitor is launching right now may show up a moment later
            _kill(_pids_naming(str(temp)))
            time.sleep(0.5)
        shutil.rmtree(temp, ignore_errors=True)
        current = Path("/tmp/ray/ray_current_cluster")  # `ray start` names its cluster here for `ray.init()`
        with contextlib.suppress(OSError):
            if current.read_text().strip().endswith(f":{port}"):
                current.unlink()
