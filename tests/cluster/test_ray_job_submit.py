"""`ray job submit` of `flexorch train` to a real Ray head started with `ray start --head` on loopback.

The test starts its own head (its own temp dir, ports and HOME, so the token it makes stays in the test's
directory), submits a job and stops it, resubmits it to resume (it must succeed) and one that must fail, checks
the job statuses and the job logs (the per-step lines), then stops exactly the processes it started: the
`ray start --block` process group and any process whose command line names its private temp dir.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from flexorch.config import CorpusConfig, load_train_config
from flexorch.data.corpus import load_corpus
from flexorch.data.stream import DocumentStream
from flexorch.records.writer import read_records
from tests.paths import REPO
from tests.ray_env import shared_ray
from tests.train_helpers import reference_losses_and_params, small_run_toml

pytestmark = pytest.mark.slow
RAY = str(Path(sys.executable).parent / "ray")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pids_naming(text: str) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if text.encode() in (d / "cmdline").read_bytes():
                    out.append(int(d.name))
            except OSError:
                continue
    return out


@pytest.fixture
def ray_head(tmp_path):
    import ray

    if ray.is_initialized():  # the suite's shared local Ray: its dashboard agent would hold the head's agent port
        ray.shutdown()
    temp = Path(tempfile.mkdtemp(prefix="fxr-", dir="/tmp"))  # short: Ray's socket paths must stay < 108 bytes
    home = tmp_path / "home"
    home.mkdir()
    env = {**os.environ, "HOME": str(home), "RAY_AUTH_MODE": "token", "RAY_ADDRESS": ""}
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    # what a user does once per cluster (README): make a token; every node and client finds it in ~/.ray/auth_token
    subprocess.run([RAY, "get-auth-token", "--generate"], env=env, capture_output=True, timeout=60, check=True)
    assert (home / ".ray" / "auth_token").is_file()
    dash = _free_port()
    cmd = [RAY, "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={_free_port()}"]
    cmd += [f"--dashboard-port={dash}", "--dashboard-host=127.0.0.1", "--num-cpus=3", f"--temp-dir={temp}"]
    cmd += ["--include-dashboard=true", f"--ray-client-server-port={_free_port()}", "--disable-usage-stats"]
    log = open(tmp_path / "ray-start.log", "w")  # noqa: SIM115 - closed below
    head = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    address = f"http://127.0.0.1:{dash}"
    try:
        deadline = time.monotonic() + 120
        while True:
            probe = subprocess.run(
                [RAY, "job", "list", "--address", address], env=env, capture_output=True, text=True, timeout=60
            )
            if probe.returncode == 0:
                break
            if time.monotonic() > deadline or head.poll() is not None:
                raise RuntimeError(f"the Ray head did not come up: {probe.stderr[-2000:]}\n{log.name}")
            time.sleep(2)
        yield address, env
    finally:
        try:
            os.killpg(head.pid, signal.SIGTERM)  # `ray start --block` stops its node on SIGTERM
            # it often takes longer (30 s seen; 5 s, the wait here until 2026-12-03, was always too short in the
            # runs of that day): what is left is SIGKILLed below
            head.wait(timeout=1)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
        for pid in set(_pids_naming(str(temp))):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.killpg(head.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        log.close()
        shutil.rmtree(temp, ignore_errors=True)


def _plain(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", text)  # the Ray CLI colours its output


def _submit(address, env, entrypoint: list[str], job_id: str, runtime_env: dict | None = None) -> str:
    cmd = [RAY, "job", "submit", "--address", address, "--no-wait", "--submission-id", job_id]
    if runtime_env is not None:
        cmd += ["--runtime-env-json", json.dumps(runtime_env)]
    cmd += ["--working-dir", str(REPO), "--"]
    deadline = time.monotonic() + 300
    while True:
        out = subprocess.run(cmd + entrypoint, env=env, capture_output=True, text=True, timeout=120)
        # a fresh head answers `ray job list` a little before its job agent takes submissions
        if "No available agent" not in out.stderr or time.monotonic() > deadline:
            break
        time.sleep(3)
    assert out.returncode == 0 and job_id in _plain(out.stdout), out.stdout + out.stderr
    return job_id


def _wait(address, env, job_id, timeout_s=300) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        st = subprocess.run(
            [RAY, "job", "status", "--address", address, job_id], env=env, capture_output=True, text=True, timeout=60
        )
        # "Status for job 'x': SUCCEEDED" while reported, or "Job 'x' succeeded" once it has ended ("Job 'x' was
        # stopped" is a warning: on stderr)
        text = _plain(st.stdout + st.stderr)
        found = re.search(rf"job '{job_id}':? (?:was )?(succeeded|failed|stopped)\b", text, re.IGNORECASE)
        if found:
            return found.group(1).upper()
        time.sleep(2)
    raise AssertionError(f"job {job_id} did not finish in {timeout_s} s")


def _logs(address, env, job_id) -> str:
    return _plain(
        subprocess.run(
            [RAY, "job", "logs", "--address", address, job_id], env=env, capture_output=True, text=True, timeout=60
        ).stdout
    )


def _follow(address, env, job_id, until=None, timeout_s: float = 300) -> str:
    """The job's log, streamed by `ray job logs --follow` until a line for which ``until`` holds (None: until the job
    ended and the stream closed); a stream that fails (the job agent not answering yet) is opened again until
    ``timeout_s``. One streaming client, where a `ray job logs` every second started the Ray CLI each time (~1.5 s of
    CPU beside the job on the 2-core machine) and saw the line up to ~3 s late."""
    deadline = time.monotonic() + timeout_s
    lines: list[str] = []
    while True:
        lines = []
        cmd = [RAY, "job", "logs", "--address", address, job_id, "--follow"]
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        timer = threading.Timer(max(1.0, deadline - time.monotonic()), proc.kill)
        timer.start()
        try:
            for line in proc.stdout:
                lines.append(_plain(line))
                if until is not None and until(lines[-1]):
                    return "".join(lines)
        finally:
            timer.cancel()
            proc.kill()
            proc.wait()
        if proc.returncode == 0 or time.monotonic() > deadline:  # the job ended (or the time is up)
            return "".join(lines)
        time.sleep(1)


def test_ray_job_stop_checkpoints_and_a_resubmitted_resume_trains_like_one_process(ray_head, tmp_path):
    """`ray job stop` sends SIGTERM: the job finishes the step in flight, checkpoints and ends STOPPED; resubmitted
    with --resume (through `python -m flexorch`, as a user submits it) it trains the rest and ends SUCCEEDED, its
    step lines in the job log; stopped + resumed steps continue at the exact next document and their losses equal
    the single-process reference on the same batches (what a job never stopped computes: the invariant). A job that
    fails its checks ends FAILED with its error in the log (`python -m flexorch` returns the command's status)."""
    address, env = ray_head
    # the stopped job is long (its steps take ~50 ms here, the stop lands seconds after step 3): it cannot end before
    # the stop; it is resumed for two more steps (the LR schedule does not depend on the run's length)
    long = 1000
    config = small_run_toml(tmp_path, steps=long, checkpoint_every=0)
    base = [sys.executable, "-m", "flexorch", "train", "--config", str(config)]
    # Ray SIGKILLs a stopped job RAY_JOB_STOP_WAIT_TIME_S (default 3 s) after its SIGTERM: give it time to checkpoint
    grace = {"env_vars": {"RAY_JOB_STOP_WAIT_TIME_S": "120"}}
    run_dir = tmp_path / "stopped"
    job = _submit(address, env, base + ["--run-dir", str(run_dir)], f"fx-stop-{os.getpid()}", grace)
    seen = _follow(address, env, job, until=lambda line: f"step    3/{long}" in line)
    assert f"step    3/{long}" in seen, _logs(address, env, job)[-3000:]
    stop = subprocess.run(
        [RAY, "job", "stop", "--address", address, job], env=env, capture_output=True, text=True, timeout=200
    )
    assert stop.returncode == 0, stop.stdout + stop.stderr
    assert _wait(address, env, job) == "STOPPED"
    logs = _logs(address, env, job)
    found = re.search(rf"stopped by SIGTERM after step (\d+) of {long} .*checkpoint (\S+);", logs)
    assert found, logs[-3000:]
    reached = int(found.group(1))
    assert 3 <= reached < long and Path(found.group(2)).is_dir(), logs[-3000:]
    # Python's multiprocessing resource tracker in the planner's solver pool, killed with the job, sometimes prints a
    # KeyError traceback as it goes (seen on 2026-11-26; not flexorch's error, and not fixed yet): those lines aside
    own = "\n".join(line for line in logs.splitlines() if not _resource_tracker_noise(line))
    assert "error" not in own.lower().replace("stderr", ""), logs[-3000:]
    assert len(read_records(run_dir / "steps.jsonl")) == reached

    steps = reached + 2
    more = ["--run-dir", str(run_dir), "--resume", "--steps", str(steps)]
    again = _submit(address, env, base + more, f"fx-resume-{os.getpid()}", grace)
    bad_entry = base + ["--run-dir", str(tmp_path / "bad"), "--max-context", "100K"]
    bad = _submit(address, env, bad_entry, f"fx-bad-{os.getpid()}")
    assert _wait(address, env, bad) == "FAILED"
    assert "cannot fit" in _logs(address, env, bad)
    _follow(address, env, again)  # until the job ends: its status below is final at the first ask
    assert _wait(address, env, again) == "SUCCEEDED", _logs(address, env, again)[-3000:]
    logs = _logs(address, env, again)
    assert f"resumed after step {reached}" in logs and f"done: {steps} steps" in logs, logs[-3000:]
    lines = [ln for ln in logs.splitlines() if ln.lstrip().startswith("step ") and "loss" in ln]
    assert len(lines) == 2, logs[-3000:]
    assert (run_dir / "checkpoints" / f"checkpoint_{steps:06d}").is_dir()

    got = read_records(run_dir / "steps.jsonl", validate=True)
    assert [r["step"] for r in got] == list(range(steps))
    cfg = load_train_config(config, {})
    shared_ray()  # only now: a local Ray beside the head while jobs are submitted takes its job agent's port
    corpus = load_corpus(CorpusConfig(source=str(tmp_path / "corpus"), max_context=128))
    stream = DocumentStream(corpus.num_docs, cfg.batch_size, cfg.seed)
    assert [r["doc_ids"] for r in got] == [list(stream.next_batch().doc_ids) for _ in range(steps)]
    ref_losses, _ = reference_losses_and_params(cfg, corpus, got)
    assert [r["loss"] for r in got] == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)


_TRACKER_NOISE = None


def _resource_tracker_noise(line: str) -> bool:
    """A line of the traceback multiprocessing's resource tracker prints when it was killed with its process (its
    header, the frames in resource_tracker.py, and ``KeyError: '/mp-...'``)."""
    global _TRACKER_NOISE
    if _TRACKER_NOISE is None:
        _TRACKER_NOISE = re.compile(
            r"resource_tracker|cache\[rtype\]\.remove\(name\)|KeyError: '/mp-|Traceback \(most recent call last\):$"
            r"|warnings\.warn\('resource_tracker"
        )
    return bool(_TRACKER_NOISE.search(line))
