"""a. the CUDA tests: ``pytest -m gpu`` in a subprocess, each test's outcome from its JUnit XML (row ``a.pytest``,
then a row ``a.test:<test id>`` per test)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from .check import Check, Ctx, FailRow, Row

__all__ = ["ROOT", "gpu_test_files", "junit_outcomes", "run_pytest", "section_tests"]

ROOT = Path(__file__).resolve().parents[3]
"""The checkout: pytest runs there, on the test modules of its tests/."""


def gpu_test_files() -> list[str]:
    """Test modules holding tests marked ``gpu``, in any folder of tests/ (collecting all of tests/ would import Ray in
    most modules)."""
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py") if "mark.gpu" in p.read_text())


def run_pytest(ctx: Ctx) -> tuple[int | None, str, Path]:
    """``pytest -m gpu`` in its own session (killed whole at the timeout); (exit code or None, output, xml path).
    ``--noconftest``: tests/conftest.py imports Ray at session end, and the GPU tests use none of its fixtures."""
    xml = ctx.out / "pytest-gpu.xml"
    xml.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-rA", "--noconftest", "-p", "no:cacheprovider"]
    cmd += ["-o", "junit_family=xunit1", f"--junitxml={xml}", *gpu_test_files()]
    env = dict(os.environ)
    if ctx.dry:
        env["CUDA_VISIBLE_DEVICES"] = ""  # --dry is CPU only, even on a GPU machine: every CUDA test skips
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = proc.communicate(timeout=ctx.sizes.pytest_timeout_s)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the session we started: pytest and the workers it spawned
        output, _ = proc.communicate()
        code = None
    (ctx.out / "pytest-gpu.log").write_text(output)
    return code, output, xml


def junit_outcomes(xml: Path) -> list[tuple[str, str, str]]:
    """(test id, passed/failed/skipped, message) of every test case in a pytest JUnit XML (xunit1: file attribute)."""
    out = []
    for case in ET.parse(xml).getroot().iter("testcase"):
        file = case.get("file", "")
        module = file.removesuffix(".py").replace("/", ".")
        inner = case.get("classname", "").removeprefix(module).strip(".")
        test_id = "::".join(x for x in (file, *inner.split("."), case.get("name", "")) if x)
        status, message = "passed", ""
        for tag, st in (("failure", "failed"), ("error", "failed"), ("skipped", "skipped")):
            el = case.find(tag)
            if el is not None:
                text = (el.get("message") or el.text or "").strip()
                status, message = st, (text.splitlines() or [""])[0][:300]
                break
        out.append((test_id, status, message))
    return out


def section_tests(check: Check, ctx: Ctx) -> None:
    t0, outcomes = time.perf_counter(), []
    with check.row("a.pytest", "pytest -m gpu (every test marked gpu)") as r:
        code, output, xml = run_pytest(ctx)
        if code is None:
            raise FailRow(
                f"pytest did not finish within {ctx.sizes.pytest_timeout_s:.0f} s ({ctx.out / 'pytest-gpu.log'})"
            )
        if not xml.is_file():
            tail = output.strip().splitlines()[-1:] or ["no output"]
            raise FailRow(f"pytest exited {code} without a JUnit XML: {tail[0]}")
        outcomes = junit_outcomes(xml)
        counts = {s: sum(o[1] == s for o in outcomes) for s in ("passed", "failed", "skipped")}
        r.metrics = {"exit_code": code, **counts}
        r.detail = f"{len(outcomes)} tests: " + ", ".join(f"{n} {s}" for s, n in counts.items()) + f" (exit {code})"
        if ctx.dry:
            r.detail += "; --dry hides CUDA from pytest, so every CUDA test skips"
        if code not in (0, 1, 5):  # 1: some test failed (its row says which); 5: nothing collected
            raise FailRow(f"pytest exited {code}: {r.detail}")
    for test_id, status, message in outcomes:
        if status == "skipped" and not ctx.cuda:
            message = ctx.no_cuda(f"pytest: {message}")
        check.add(Row(f"a.test:{test_id}", test_id, status, message), started=False)
    print(f"    tests listed ({time.perf_counter() - t0:.1f} s)", flush=True)
