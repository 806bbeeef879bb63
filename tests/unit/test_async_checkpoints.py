"""Asynchronous saves (``[checkpoint] async``) through the driver's checkpointer: the step goes on while the state is
written, the files are the bytes a synchronous save writes, at most one save is in flight, and a failed write is
reported with its cause while the previous checkpoint stays the newest. The worker group here is a stand-in that
hands out a replicated state for the driver to write, as with stage-local parts (the workers' own writes, whole or
sharded, now or from their threads, run in ``tests/integration/test_checkpoint_storage_run.py``)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from flexorch.config import load_train_config
from flexorch.control import checkpointer as checkpointer_mod
from flexorch.control.checkpoint_store import CheckpointStore
from flexorch.control.checkpointer import Checkpointer
from flexorch.control.run_checkpoints import RunCheckpoints

CORPUS = SimpleNamespace(num_docs=3, lengths=np.array([4, 5, 6]), total_tokens=15, keys=["a", "b", "c"])


class _Replicas:
    sharded = False

    def __init__(self):
        self.step = 0

    def write_whole(self, directory: str, background: bool):
        return None  # no worker writes: the driver assembles the state and writes it (stage-local parts)

    def get_state(self, rank: int = 0) -> dict:
        return {
            "model": {"w": torch.full((1000,), float(self.step)), "b": torch.arange(5.0)},
            "optimizer": {"state": {}, "param_groups": []},
            "scheduler": {"last_epoch": self.step},
            "rng": torch.zeros(4, dtype=torch.uint8),
        }


def _checkpointer(root, asynchronous: bool, events: list, keep: int = 5) -> Checkpointer:
    run = RunCheckpoints(CheckpointStore(root), CORPUS, keep=keep)
    return Checkpointer(run, lambda: {"stream": {"position": 1}, "config": {}}, events.append, asynchronous)


def test_an_async_save_returns_at_once_and_writes_the_bytes_a_sync_save_writes(tmp_path, monkeypatch):
    events, workers = [], _Replicas()
    gate = threading.Event()
    real = checkpointer_mod.write_model_state
    monkeypatch.setattr(checkpointer_mod, "write_model_state", lambda c, s: (gate.wait(10), real(c, s))[1])
    ck = _checkpointer(tmp_path / "async", True, events)
    workers.step = 1
    assert ck.save(1, workers, wait=False) is None and ck.in_flight == 1
    workers.step = 2  # the run goes on: the state staged at the save is what is written
    assert ck.at is None and not events, "nothing counts before the write completes"
    ck.poll()
    assert ck.in_flight == 1, "poll never waits"
    gate.set()
    path = ck.wait()
    assert path.endswith("checkpoint_000001") and (ck.at, ck.last) == (1, path)
    assert events == [{"event": "checkpoint", "step": 1, "path": path}]

    sync = _checkpointer(tmp_path / "sync", False, [])
    workers.step = 1
    sync.save(1, workers)
    a, b = CheckpointStore(tmp_path / "async"), CheckpointStore(tmp_path / "sync")
    assert a.files("checkpoint_000001") == b.files("checkpoint_000001")
    for f in a.files("checkpoint_000001"):
        assert a.read("checkpoint_000001", f) == b.read("checkpoint_000001", f), f


def test_the_next_save_waits_for_the_one_in_flight(tmp_path, monkeypatch):
    events, workers, order = [], _Replicas(), []
    real = checkpointer_mod.write_model_state

    def slow(ckpt, state):
        order.append(("start", ckpt.step))
        time.sleep(0.3)
        out = real(ckpt, state)
        order.append(("end", ckpt.step))
        return out

    monkeypatch.setattr(checkpointer_mod, "write_model_state", slow)
    ck = _checkpointer(tmp_path, True, events)
    ck.save(1, workers, wait=False)
    ck.save(2, workers, wait=False)
    ck.wait()
    assert order == [("start", 1), ("end", 1), ("start", 2), ("end", 2)]
    assert [e["step"] for e in events] == [1, 2] and ck.at == 2


def test_a_failed_write_is_reported_and_the_previous_checkpoint_stays_the_newest(tmp_path, monkeypatch):
    events, workers = [], _Replicas()
    ck = _checkpointer(tmp_path, True, events)
    first = ck.save(1, workers)
    real = checkpointer_mod.write_model_state

    def broken(ckpt, state):
        ckpt.store.write(ckpt.name, "model.pt", b"half")
        raise OSError("the bucket went away")

    monkeypatch.setattr(checkpointer_mod, "write_model_state", broken)
    ck.save(2, workers, wait=False)
    assert ck.wait() is None
    failed = events[-1]
    assert failed["event"] == "checkpoint_failed" and failed["step"] == 2
    assert failed["error"] == "OSError: the bucket went away" and failed["newest"] == first
    assert (ck.at, ck.last) == (1, first)
    store = CheckpointStore(tmp_path)
    assert [c.name for c in store.checkpoints()] == ["checkpoint_000001"], "what the failed save wrote is deleted"
    monkeypatch.setattr(checkpointer_mod, "write_model_state", real)
    assert ck.save(3, workers).endswith("checkpoint_000003") and ck.at == 3  # the run goes on saving


def test_the_run_end_and_an_emergency_save_wait_for_the_save_in_flight(tmp_path, monkeypatch):
    events, workers = [], _Replicas()
    gate = threading.Event()
    real = checkpointer_mod.write_model_state
    monkeypatch.setattr(checkpointer_mod, "write_model_state", lambda c, s: (gate.wait(10), real(c, s))[1])
    ck = _checkpointer(tmp_path, True, events)
    ck.save(4, workers, wait=False)
    threading.Timer(0.2, gate.set).start()
    path = ck.at_end(4, workers)  # the periodic one of this step, waited for, is the run's last
    assert path.endswith("checkpoint_000004") and ck.at == 4
    waits = [e for e in events if e["event"] == "checkpoint_wait"]
    assert len(waits) == 1 and waits[0]["message"].startswith("the run ends: waiting for the checkpoint of step 4")


def test_async_is_a_checkpoint_key(tmp_path):
    f = tmp_path / "run.toml"
    f.write_text("[checkpoint]\nasync = true\n")
    cfg = load_train_config(f)
    assert cfg.checkpoint.async_ is True
    f.write_text('[checkpoint]\nasync = "yes"\n')
    with pytest.raises(ValueError, match="checkpoint.async must be true or false"):
        load_train_config(f)
    f.write_text("[checkpoint]\nasink = true\n")
    with pytest.raises(ValueError, match=r"unknown keys \['asink'\]; known: \['async', 'every', 'keep'"):
        load_train_config(f)


def test_the_console_says_when_a_save_is_waited_for_and_when_one_failed(tmp_path):
    import io

    from flexorch.cli.train_console import print_event
    from flexorch.config import TrainConfig

    out, cfg = io.StringIO(), TrainConfig()
    wait = {"event": "checkpoint_wait", "step": 4, "message": "the run ends: waiting for the checkpoint of step 4 ..."}
    print_event(wait, cfg, out)
    failed = {"event": "checkpoint_failed", "step": 5, "path": "s3://b/checkpoint_000005",
              "error": "OSError: the bucket went away", "newest": "s3://b/checkpoint_000004"}  # fmt: skip
    print_event(failed, cfg, out)
    assert out.getvalue().splitlines() == [
        "the run ends: waiting for the checkpoint of step 4 ...",
        "checkpoint after step 5 failed (OSError: the bucket went away); what it wrote is deleted and the newest "
        "checkpoint is still s3://b/checkpoint_000004; the run goes on",
    ]


def test_an_emergency_save_whose_write_fails_says_why_and_where_the_last_checkpoint_is(tmp_path, monkeypatch):
    events, workers = [], _Replicas()
    workers.worker_ids = [0]
    workers.state_versions = lambda timeout_s: {0: 3}
    ck = _checkpointer(tmp_path, True, events)
    first = ck.save(2, workers)

    def broken(ckpt, state):
        raise OSError("disk full")

    monkeypatch.setattr(checkpointer_mod, "write_model_state", broken)
    err = ck.keep_work(RuntimeError("the run failed."), 3, workers, "resume it")
    assert str(err) == (
        "the run failed. No emergency checkpoint could be written (RuntimeError: the checkpoint's write failed "
        f"(OSError: disk full)); the last checkpoint is {first}"
    )
    assert (ck.at, ck.last) == (2, first)
