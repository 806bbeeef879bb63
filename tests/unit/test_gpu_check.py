"""``python -m benchmarks.gpu.gpu_check --dry``: every row of the GPU check runs on the CPU with Ray impossible to
import (the GPU machine has no Ray), the CUDA-only rows are skipped saying "no CUDA", every other row passes, and the
calibrated profile it writes loads with the planner's loader. About 20 s on 2 idle cores."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flexorch.solver.profiles import get_profile
from tests.paths import REPO

# On PYTHONPATH as sitecustomize, it runs first in the check, in the pytest it starts and in the ranks it spawns.
BLOCKER = '''
import os
import sys


class _NoRay:
    """Every import of Ray fails, as on the GPU machine, and is noted in $GPU_CHECK_RAY_LOG."""

    def find_spec(self, name, path=None, target=None):
        if name == "ray" or name.startswith("ray."):
            with open(os.environ["GPU_CHECK_RAY_LOG"], "a") as f:
                f.write(name + "\\n")
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by tests/unit/test_gpu_check.py)")
        return None


sys.meta_path.insert(0, _NoRay())
'''

CUDA_ONLY = ("b.attn.flash_attn", "b.attn.torch_cudnn", "b.attn.torch_flash", "d.memory")
CPU_ROWS = (
    "a.pytest",
    "b.peak",
    "b.attn.torch_cpu",
    "b.attn.math",
    "c.ulysses.d2",
    "c.ring.d2",
    "c.ulysses.d4",
    "c.ring.d4",
    "d.step",
    "e.profile",
    "e.predict",
)


def _env(tmp_path: Path) -> tuple[dict, Path]:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCKER)
    log = tmp_path / "ray_imports.txt"
    env = {
        **os.environ,
        "PYTHONPATH": f"{site}{os.pathsep}{REPO}",
        "GPU_CHECK_RAY_LOG": str(log),
        "CUDA_VISIBLE_DEVICES": "",
    }
    return env, log


@pytest.mark.slow
def test_dry_run_passes_every_cpu_row_without_ray(tmp_path):
    env, log = _env(tmp_path)
    blocked = subprocess.run([sys.executable, "-c", "import ray"], env=env, capture_output=True, text=True)
    assert blocked.returncode != 0 and log.read_text() == "ray\n", "the Ray blocker is not active"
    log.unlink()

    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "benchmarks.gpu.gpu_check", "--dry", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    said = f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-2000:]}"
    assert proc.returncode == 0, said
    assert not log.exists(), f"something imported Ray: {log.read_text()}"

    data = json.loads((out / "table.json").read_text())
    assert data["mode"] == "dry" and data["environment"]["ray_imported"] is False
    rows = {r["key"]: r for r in data["rows"]}
    assert all(r["status"] in ("passed", "failed", "skipped") for r in rows.values()), said
    tests = [k for k in rows if k.startswith("a.test:")]
    assert tests, "no test marked gpu was listed"
    for key in (*CUDA_ONLY, *tests):
        assert rows[key]["status"] == "skipped" and "no CUDA" in rows[key]["reason"], rows[key]
    for key in CPU_ROWS:
        assert rows[key]["status"] == "passed", rows[key]
    assert set(rows) == {*CUDA_ONLY, *CPU_ROWS, *tests}
    assert rows["d.step"]["metrics"]["tokens_per_s"] > 0

    profile = get_profile(str(out / "profile.json"))
    assert profile.name.startswith("calibrated-") and profile.act_bytes_per_token > 0
    assert profile.a1_ms == rows["e.profile"]["metrics"]["a1_ms"]
    assert (out / "table.md").read_text().count("\n| ") == len(rows) + 1  # a line per row, and the header's


def _gpu_check():
    return importlib.import_module("benchmarks.gpu.gpu_check")


def test_a_failing_row_is_recorded_and_the_rest_still_run(tmp_path, monkeypatch):
    gc = _gpu_check()

    def broken(ctx):
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr("benchmarks.gpu.gpu_rows.train_step.train_steps", broken)  # importable once gpu_check is loaded
    assert gc.main(["--dry", "--only", "d", "--out", str(tmp_path)]) == 1  # a failed row: exit code 1
    rows = {r["key"]: r for r in json.loads((tmp_path / "table.json").read_text())["rows"]}
    assert (rows["d.step"]["status"], rows["d.step"]["reason"]) == ("failed", "RuntimeError: CUDA out of memory")
    assert rows["d.memory"]["status"] == "skipped"
    check = gc.Check()
    with check.row("x", "skipped row"):
        raise gc.SkipRow("no CUDA")
    with check.row("y", "next row") as r:
        r.detail = "ran"
    assert [(r.status, r.reason or r.detail) for r in check.rows] == [("skipped", "no CUDA"), ("passed", "ran")]


def test_junit_outcomes_and_long_tail(tmp_path):
    gc = _gpu_check()
    xml = tmp_path / "j.xml"
    xml.write_text(
        '<testsuites><testsuite><testcase classname="tests.test_a" file="tests/test_a.py" name="test_x[1]"/>'
        '<testcase classname="tests.test_a.TestK" file="tests/test_a.py" name="test_y">'
        '<failure message="assert 1 == 2">trace</failure></testcase>'
        '<testcase classname="tests.test_b" file="tests/test_b.py" name="test_z">'
        '<skipped message="needs CUDA"/></testcase></testsuite></testsuites>'
    )
    assert gc.junit_outcomes(xml) == [
        ("tests/test_a.py::test_x[1]", "passed", ""),
        ("tests/test_a.py::TestK::test_y", "failed", "assert 1 == 2"),
        ("tests/test_b.py::test_z", "skipped", "needs CUDA"),
    ]
    assert gc.long_tail(131072, 8192) == [131072, 65536] + [32768] * 2 + [16384] * 4 + [8192] * 8
    assert gc.attn_fwd_flops([4, 2], heads=3, head_dim=5) == 2 * (16 + 4) * 3 * 5  # 4 * L^2 / 2 * h * hd
