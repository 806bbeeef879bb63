"""Checkpoints in a store of their own (``[checkpoint] storage``): a local directory, or ``s3://`` through moto's
server on 127.0.0.1. What a save writes, what verifies, a killed upload never loaded and cleaned up, retention, a
storage that cannot be written, and the ``[checkpoint]`` table."""

from __future__ import annotations

import itertools
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from flexorch.config import ConfigError, ModelConfig, load_train_config
from flexorch.control.checkpoint import (
    check_resume,
    corpus_fingerprint,
    latest_checkpoint,
    load_checkpoint,
    newest_good_checkpoint,
    prune,
    save_checkpoint,
)
from flexorch.control.checkpoint_store import CheckpointStore, StoreError
from flexorch.control.run_checkpoints import RunCheckpoints
from tests.s3_server import s3_server

CORPUS = SimpleNamespace(num_docs=3, lengths=np.array([4, 5, 6]), total_tokens=15, keys=["a", "b", "c"])
_prefixes = itertools.count()


@pytest.fixture(scope="module")
def s3():
    with s3_server() as server:
        yield server


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    if request.param == "local":
        return CheckpointStore(tmp_path / "ckpts")
    s3 = request.getfixturevalue("s3")
    return CheckpointStore(f"{s3.root}/run{next(_prefixes)}/ckpts")


def _states(step: int) -> tuple[dict, dict]:
    worker = {
        "model": {"w": torch.full((64,), float(step)), "b": torch.arange(3.0)},
        "optimizer": {"state": {}, "param_groups": []},
        "scheduler": {"last_epoch": step},
        "rng": torch.zeros(4, dtype=torch.uint8),
    }
    driver = {
        "stream": {"position": step},
        "skipped_batches": 0,
        "config": {"model": ModelConfig().to_dict()},
        "corpus": corpus_fingerprint(CORPUS),
    }
    return worker, driver


def _save(store, step, keep=10, keep_every=0):
    return save_checkpoint(store, step, *_states(step), keep=keep, keep_every=keep_every)


def test_a_checkpoint_is_written_verified_and_loaded_back(store):
    ckpt = _save(store, 3)
    assert ckpt.name == "checkpoint_000003" and ckpt.step == 3
    assert ckpt.path.startswith("s3://") == store.remote
    files = store.files(ckpt.name)
    assert set(files) == {"model.pt", "train_state.pt", "driver_state.json", "manifest.json"}
    manifest = json.loads(store.read(ckpt.name, "manifest.json"))
    assert {k: v["bytes"] for k, v in manifest.items()} == {k: v for k, v in files.items() if k != "manifest.json"}
    assert all(len(v["sha256"]) == 64 for v in manifest.values())  # the driver hashed what it wrote
    state, dstate = load_checkpoint(ckpt)
    assert torch.equal(state["model"]["w"], torch.full((64,), 3.0)) and dstate["step"] == 3
    assert latest_checkpoint(store) == ckpt
    assert check_resume(store, ModelConfig().to_dict()) == f"--resume: from checkpoint_000003 (step 3) in {store.uri}"


def test_a_killed_upload_is_never_loaded_and_is_cleaned_up_by_the_next_save(store):
    _save(store, 1)
    killed = _save(store, 2)
    store.fs.delete_file(f"{store.root}/{killed.name}/manifest.json")  # the upload was killed before its manifest
    half = store.checkpoint("checkpoint_000003")
    store.write(half.name, "model.pt", b"half a model")  # and one killed after its first file
    ckpt, skipped = newest_good_checkpoint(store)
    assert ckpt.step == 1
    assert skipped == [
        "skipped checkpoint_000003: partial checkpoint, manifest.json and driver_state.json missing (written by a "
        "crash before it was complete)",
        "skipped checkpoint_000002: partial checkpoint, manifest.json missing (written by a crash before it was "
        "complete)",
    ]
    run = RunCheckpoints(store, CORPUS, keep=10)
    _, dstate = run.resume()
    assert dstate["step"] == 1 and run.own.step == 1
    run.save(4, *_states(4))
    assert [c.name for c in store.checkpoints()] == ["checkpoint_000004", "checkpoint_000001"]


def test_a_damaged_file_is_named_and_skipped(store):
    _save(store, 1)
    bad = _save(store, 2)
    data = bytearray(store.read(bad.name, "model.pt"))
    data[len(data) // 2] ^= 0xFF
    store.write(bad.name, "model.pt", bytes(data))
    ckpt, skipped = newest_good_checkpoint(store)
    assert ckpt.step == 1 and skipped == [
        "skipped checkpoint_000002: model.pt is corrupted "
        f"({len(data)} bytes as the manifest says, but another SHA-256)"
    ]


def test_retention_keeps_the_newest_and_every_nth(store):
    for step in range(1, 8):
        _save(store, step, keep=2, keep_every=3)
    assert [c.step for c in store.checkpoints()] == [7, 6, 3]
    _save(store, 8, keep=2, keep_every=3)
    assert [c.step for c in store.checkpoints()] == [8, 7, 6, 3]  # 6: a multiple of 3, kept beside the newest two
    _save(store, 9, keep=1)
    assert [c.step for c in store.checkpoints()] == [9]
    assert prune(store, keep=1) == []


def test_records_are_mirrored_beside_the_checkpoints(s3, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "steps.jsonl").write_text('{"step": 0}\n')
    (run_dir / "config.json").write_text("{}")
    store = CheckpointStore(f"{s3.root}/mirror{next(_prefixes)}")
    RunCheckpoints(store, CORPUS, keep=2, run_dir=run_dir).save(1, *_states(1))
    assert store.files("run") == {"steps.jsonl": 12, "config.json": 2}
    assert [c.step for c in store.checkpoints()] == [1]  # the records are not a checkpoint


def test_a_bucket_that_does_not_exist_is_an_error_naming_it(s3):
    with pytest.raises(StoreError, match=r"s3://no-such-bucket/x: the bucket 'no-such-bucket' does not exist; create"):
        CheckpointStore("s3://no-such-bucket/x").check_writable()
    CheckpointStore(f"{s3.root}/fine").check_writable()


def test_a_local_storage_that_cannot_be_written_is_an_error(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(StoreError, match=r"is not a writable directory\); set \[checkpoint\] storage"):
        CheckpointStore(tmp_path / "file" / "ckpts").check_writable()
    CheckpointStore(tmp_path / "new" / "ckpts").check_writable()
    assert not (tmp_path / "new").exists(), "the check creates nothing"


def test_the_checkpoint_table_and_the_old_top_level_keys(tmp_path):
    f = tmp_path / "run.toml"
    f.write_text('checkpoint_every = 5\nkeep_checkpoints = 3\n[checkpoint]\nstorage = "s3://b/p"\nkeep_every = 10\n')
    cfg = load_train_config(f)
    assert (cfg.checkpoint_every, cfg.keep_checkpoints, cfg.checkpoint.storage) == (5, 3, "s3://b/p")
    f.write_text("[checkpoint]\nevery = 4\nkeep = 1\n")
    cfg = load_train_config(f)
    assert (cfg.checkpoint_every, cfg.keep_checkpoints) == (4, 1)
    assert load_train_config(f, {"checkpoint_every": 7}).checkpoint_every == 7  # a flag wins over either spelling
    f.write_text("checkpoint_every = 5\n[checkpoint]\nevery = 4\n")
    with pytest.raises(ConfigError, match=r"checkpoint.every = 4 and the top-level checkpoint_every = 5 disagree"):
        load_train_config(f)
    f.write_text('[checkpoint]\nstorage = "hdfs://x/y"\n')
    with pytest.raises(ConfigError, match="unsupported scheme"):
        load_train_config(f)
    f.write_text("[checkpoint]\nkeep_every = -1\n")
    with pytest.raises(ConfigError, match="checkpoint.keep_every must be an integer >= 0"):
        load_train_config(f)
