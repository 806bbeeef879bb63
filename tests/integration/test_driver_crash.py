"""The driver process itself dies (SIGKILL, mid-run): `flexorch train --resume` continues at the exact next document.

Workers can be replaced in place (test_elastic.py); the driver cannot, because it owns the data stream. What
survives it is the last checkpoint (taken every step here). The test kills the whole `flexorch train` process
tree (its local Ray included) right after a step line, resumes, and checks the ledger: every step once in
steps.jsonl, the documents of an uninterrupted stream in order, and the final parameters equal to one process
training on the same batches.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from flexorch.config import CorpusConfig, load_train_config
from flexorch.data.corpus import load_corpus
from flexorch.data.stream import DocumentStream
from flexorch.records.writer import read_records
from tests.paths import REPO
from tests.ray_env import kill_private_ray
from tests.train_helpers import reference_losses_and_params, small_run_toml

pytestmark = pytest.mark.slow


def _kill_tree(proc: subprocess.Popen, ray_tmp: Path) -> None:
    """SIGKILL the CLI's process group and every Ray process of its private temp dir (raylet, GCS, workers)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)
    kill_private_ray(ray_tmp, remove=False)  # the resume below starts its Ray in the same directory


def test_driver_killed_mid_run_resumes_at_the_next_document(tmp_path, ray_cluster):
    # the CLI reads the driver's events every 0.2 s and steps here take a fraction of that: the driver may be
    # several steps past the line the test reacts to, so the run is long enough to be still going at the kill
    steps = 16
    config = small_run_toml(tmp_path, steps=steps, checkpoint_every=1)
    corpus_dir = tmp_path / "corpus"
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "flexorch.cli.main", "train", "--config", str(config), "--run-dir", str(run_dir)]
    ray_tmp = Path(tempfile.mkdtemp(prefix="fxc-", dir="/tmp"))  # short: Ray's socket paths stay < 108 bytes
    env = {**os.environ, "RAY_ADDRESS": "", "PYTHONPATH": str(REPO), "RAY_TMPDIR": str(ray_tmp)}

    proc = subprocess.Popen(
        cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    seen = []
    try:
        deadline = time.monotonic() + 240
        for line in proc.stdout:  # the CLI prints one line per step
            seen.append(line)
            if line.startswith(f"step    3/{steps}") or time.monotonic() > deadline:
                break
    finally:
        _kill_tree(proc, ray_tmp)
    assert any(ln.startswith(f"step    3/{steps}") for ln in seen), "".join(seen)[-3000:]
    before = read_records(run_dir / "steps.jsonl")
    # steps of this tiny run take ~0.3 s, so one or two more may finish before the kill lands; the run must not
    # have finished (the resume below has steps left to do)
    assert [r["step"] for r in before][:3] == [0, 1, 2] and len(before) < steps

    try:
        resumed = subprocess.run(cmd + ["--resume"], env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    assert "resumed after step" in resumed.stdout and f"done: {steps} steps" in resumed.stdout

    records = read_records(run_dir / "steps.jsonl", validate=True)
    assert [r["step"] for r in records] == list(range(steps)), "every step exactly once, none lost or repeated"
    cfg = load_train_config(config, {})
    corpus = load_corpus(CorpusConfig(source=str(corpus_dir), max_context=128))  # in this process's Ray
    stream = DocumentStream(corpus.num_docs, cfg.batch_size, cfg.seed)
    assert [r["doc_ids"] for r in records] == [list(stream.next_batch().doc_ids) for _ in range(steps)]
    ref_losses, ref_params = reference_losses_and_params(cfg, corpus, records)
    assert [r["loss"] for r in records] == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
    final = torch.load(run_dir / "checkpoints" / f"checkpoint_{steps:06d}" / "model.pt", weights_only=True)
    for name, value in ref_params.items():
        np.testing.assert_allclose(final[name].numpy(), value, rtol=1e-4, atol=2e-5, err_msg=name)


def test_a_lost_driver_actor_is_replaced_from_the_checkpoint_until_driver_restarts_run_out(tmp_path, ray_cluster):
    """Only the TrainingDriver actor's process dies (SIGKILL): `flexorch train` says so, starts a new driver from the
    newest checkpoint and trains on; once `[elastic] driver_restarts` is used up it exits 2 with the resume command.
    Resumed, the run's records hold every step once with the reference's losses and documents."""
    # 40 short steps: the CLI reads the driver's events every 0.2 s, so the driver may be a few steps past the
    # line the test reacts to; the run must still be going when the second kill lands
    steps = 40
    config = small_run_toml(tmp_path, steps=steps, checkpoint_every=2)
    config.write_text(config.read_text() + "[elastic]\ndriver_restarts = 1\n")
    corpus_dir, run_dir = tmp_path / "corpus", tmp_path / "run"
    cmd = [sys.executable, "-m", "flexorch.cli.main", "train", "--config", str(config), "--run-dir", str(run_dir)]
    ray_tmp = Path(tempfile.mkdtemp(prefix="fxd-", dir="/tmp"))  # short: Ray's socket paths stay < 108 bytes
    env = {**os.environ, "RAY_ADDRESS": "", "PYTHONPATH": str(REPO), "RAY_TMPDIR": str(ray_tmp)}
    proc = subprocess.Popen(
        cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    seen, pids, kills = [], [], []
    try:
        deadline = time.monotonic() + 300
        for line in proc.stdout:
            seen.append(line)
            m = re.search(r"driver and planner on this entrypoint's node \S+ \(pid (\d+)\)", line)
            if m:
                pids.append(int(m[1]))
            # the first driver after step 3; its replacement once it trained the step past the lost one
            first = not kills and line.startswith(f"step    3/{steps}")
            if first or (len(kills) == 1 and "[driver restarted" in line):
                os.kill(pids[-1], signal.SIGKILL)
                kills.append(pids[-1])
            if time.monotonic() > deadline:
                break
        rc = proc.wait(timeout=60)
    finally:
        _kill_tree(proc, ray_tmp)
    out = "".join(seen)
    assert len(kills) == 2 and len(pids) == 2 and pids[0] != pids[1], out[-4000:]
    assert re.search(r"the driver was lost after step \d+: The actor is dead", out), out[-4000:]
    m = re.search(r"starting a new driver from the checkpoint of step (\d+) \(\S+\) \(restart 1 of 1\)", out)
    assert m and int(m[1]) % 2 == 0 and int(m[1]) >= 2, out[-4000:]  # checkpoint_every = 2, killed after step 3
    recovered = [ln for ln in out.splitlines() if "[driver restarted, recovered in" in ln]
    assert len(recovered) == 1, out[-4000:]  # the step past the one the lost driver was running shows the recovery
    assert rc == 2, out[-4000:]
    assert "not restarted (driver_restarts = 1)" in out and "--resume`" in out, out[-2000:]
    records = read_records(run_dir / "steps.jsonl", validate=True)
    lived = [r for r in records for rec in r["recoveries"] if rec.get("driver_restart")]
    assert len(lived) == 1
    rec = next(x for x in lived[0]["recoveries"] if x.get("driver_restart"))
    assert rec["total_ms"] == pytest.approx(rec["detect_ms"] + rec["recovery_ms"] + rec["rerun_ms"])
    assert rec["redone_steps"] == lived[0]["step"] - rec["from_step"] >= 0
    # the new driver opened the corpus store the first one prepared: its corpus work is opening files
    after = out[out.index("starting a new driver") :]
    assert "opened the corpus store" in after and "preparing the corpus" not in after, after[:3000]
    assert 0 < rec["corpus_ms"] < rec["recovery_ms"]

    try:
        resumed = subprocess.run(cmd + ["--resume"], env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    finally:
        kill_private_ray(ray_tmp)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    records = read_records(run_dir / "steps.jsonl", validate=True)
    assert [r["step"] for r in records] == list(range(steps)), "every step exactly once, none lost or repeated"
    cfg = load_train_config(config, {})
    corpus = load_corpus(CorpusConfig(source=str(corpus_dir), max_context=128))
    stream = DocumentStream(corpus.num_docs, cfg.batch_size, cfg.seed)
    assert [r["doc_ids"] for r in records] == [list(stream.next_batch().doc_ids) for _ in range(steps)]
    ref_losses, _ = reference_losses_and_params(cfg, corpus, records)
    assert [r["loss"] for r in records] == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
