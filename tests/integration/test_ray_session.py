"""`flexorch train` without an address starts its own Ray, even when a stale cluster address file is lying around,
and runs its actors at niceness 0 (Ray's default is 15).

Ray's `ray.init()` with no address reads `<ray temp dir>/ray_current_cluster` (written by `ray start` and by
`ray.cluster_utils.Cluster`, left behind when they are killed) and tries to join that cluster; our laptop runs and
test fixtures must not. The test points Ray's temp dir at a private folder holding such a stale file.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.paths import REPO

SCRIPT = """
import os
import ray
from flexorch.cli.train import ray_session
@ray.remote
class Probe:
    def nice(self):
        return os.nice(0)
with ray_session(None, 1):
    print("nice", ray.get(Probe.remote().nice.remote()))
    print("cpus", int(ray.cluster_resources()["CPU"]))
"""


@pytest.mark.slow
def test_local_session_ignores_a_stale_cluster_address_file():
    tmp = Path(tempfile.mkdtemp(prefix="fxs-", dir="/tmp"))  # short: Ray's socket paths must stay < 108 bytes
    try:
        (tmp / "ray").mkdir()
        (tmp / "ray" / "ray_current_cluster").write_text("127.0.0.1:9")  # nothing listens on port 9
        env = {**os.environ, "RAY_TMPDIR": str(tmp), "RAY_ADDRESS": "", "PYTHONPATH": str(REPO)}
        out = subprocess.run(
            [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=180, cwd=REPO
        )
        assert out.returncode == 0, out.stderr[-3000:]
        cpus = int(out.stdout.split("cpus")[-1])
        assert cpus >= 1
        # Ray's default worker niceness (15) starves every actor beside busy processes: the local Ray sets 0
        assert int(out.stdout.split("nice")[-1].split()[0]) == 0
    finally:
        subprocess.run(["pkill", "-f", str(tmp)], check=False)
        shutil.rmtree(tmp, ignore_errors=True)


def test_a_niced_process_on_a_busy_node_is_warned_with_what_to_do():
    from flexorch.control.host_load import niced_on_busy_node

    note = niced_on_busy_node(nice=15, load=5.2, cpus=2)
    assert note.startswith("WARNING: Ray runs flexorch's actors at niceness 15")
    assert "load 5.2 on 2 CPUs" in note and "RAY_worker_niceness=0 ray start" in note
    assert niced_on_busy_node(nice=0, load=9.0, cpus=2) is None  # a fair share: nothing to say
    assert niced_on_busy_node(nice=15, load=0.5, cpus=2) is None  # niced on an idle node: harmless
