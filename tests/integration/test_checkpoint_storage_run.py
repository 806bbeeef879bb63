"""Runs whose checkpoints live in object storage (``[checkpoint] storage = "s3://..."``, moto's server on
127.0.0.1): a run saved to S3 whose run directory is then deleted resumes from storage alone, in a new run
directory, exactly (losses and parameters against the single-process reference), replicated and sharded (every
fsdp worker wrote its shard straight to S3); ``flexorch export`` reads a checkpoint from S3."""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from flexorch.config import ShardingSettings
from flexorch.config.checkpoint import CheckpointSettings
from flexorch.control.checkpoint_store import CheckpointStore
from tests.s3_server import s3_server
from tests.train_helpers import (
    check_against_reference,
    cpu_profile,
    reference_losses_and_params,
    run_driver,
    train_config,
    write_corpus,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """A private local Ray whose workers get the S3 server's settings (a job's runtime_env, as ``ray job submit
    --runtime-env-json`` gives them), the server, a corpus and the fixed profile."""
    import ray

    from flexorch.config import CorpusConfig
    from flexorch.data.corpus import load_corpus
    from tests.ray_env import release_if_held

    with s3_server() as s3:
        release_if_held()
        if ray.is_initialized():
            ray.shutdown()  # the suite's shared Ray: its workers lack the server's settings
        ray.init(address="local", num_cpus=3, include_dashboard=False, logging_level="ERROR",
                 runtime_env={"env_vars": s3.env})  # fmt: skip
        root = tmp_path_factory.mktemp("ckpt-storage")
        corpus_dir = write_corpus(root / "corpus")
        corpus = load_corpus(CorpusConfig(source=str(corpus_dir), max_context=256))
        try:
            yield root, corpus_dir, cpu_profile(root / "profile.json"), corpus, s3
        finally:
            ray.shutdown()


def _cfg(env, name: str, mode: str, asynchronous: bool = False, **kw):
    root, corpus_dir, profile, _, s3 = env
    storage = CheckpointSettings(storage=f"{s3.root}/{name}", async_=asynchronous)
    return train_config(
        corpus_dir, root / name, profile, workers=2, plan={"tokens_per_worker": 128}, checkpoint=storage,
        sharding=ShardingSettings(mode=mode), **kw,
    )  # fmt: skip


@pytest.mark.parametrize("mode", ["replicate", "fsdp"])
def test_a_run_resumes_from_object_storage_alone_in_a_new_run_dir(env, mode):
    root, _, _, corpus, _ = env
    first = _cfg(env, f"{mode}-first", mode, asynchronous=True, steps=2, checkpoint_every=1)  # written in the back
    head, _ = run_driver(first, corpus)  # stepped without run(): the periodic checkpoint after step 1 only
    head = head[:1]
    store = CheckpointStore(first.checkpoint.storage)
    assert [c.name for c in store.checkpoints()] == ["checkpoint_000001"]
    files = store.files("checkpoint_000001")
    if mode == "fsdp":  # each worker wrote its own shard to S3; no process wrote the whole model
        assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= set(files) and "model.pt" not in files
    assert {"steps.jsonl", "config.json"} <= set(store.files("run"))  # the records, beside the checkpoints
    shutil.rmtree(first.run_dir)  # nothing of the run is left on this machine

    more = first.replace(run_dir=str(root / f"{mode}-elsewhere"), steps=3, resume=True)
    more = more.replace(checkpoint=CheckpointSettings(storage=first.checkpoint.storage, async_=False))  # sync saves
    tail, replicas = run_driver(more, corpus)
    assert [r["step"] for r in tail] == [1, 2]
    check_against_reference(more, corpus, head + tail, replicas)
    if mode != "fsdp":
        return
    from flexorch.cli.main import main

    # `flexorch export s3://...`: the newest checkpoint (the resumed run's, after step 2), downloaded, consolidated
    assert [c.name for c in store.checkpoints()] == ["checkpoint_000002", "checkpoint_000001"]
    out = root / "exported.pt"
    assert main(["export", first.checkpoint.storage, str(out)]) == 0
    exported = torch.load(out, weights_only=True)
    _, ref = reference_losses_and_params(more, corpus, (head + tail)[:2])
    assert set(exported) == set(ref)
    for name, value in exported.items():
        np.testing.assert_allclose(value.numpy(), ref[name], rtol=1e-4, atol=2e-5, err_msg=name)
    assert not Path(first.run_dir).exists()


def test_an_async_sharded_save_writes_the_bytes_a_synchronous_one_writes(env):
    """Each fsdp worker staged its shard in host memory and copied it to S3 in the background: the same shards, byte
    for byte, as the synchronous save of the same state straight to S3, and the same DCP metadata (where every
    parameter's rows are) but for the save's own id and path."""
    from flexorch.control.checkpointer import Checkpointer
    from flexorch.control.driver import TrainingDriver
    from flexorch.control.run_checkpoints import RunCheckpoints

    _, _, _, corpus, s3 = env
    cfg = _cfg(env, "fsdp-bytes", "fsdp", asynchronous=True, steps=2)
    driver = TrainingDriver(cfg, corpus=corpus)
    try:
        driver.setup()
        driver.step()
        assert driver.checkpointer.save(1, driver.workers, wait=False) is None
        assert driver.checkpointer.in_flight == 1
        a = _contents(driver.checkpointer.wait())
        sync_run = RunCheckpoints(CheckpointStore(f"{s3.root}/fsdp-bytes-sync"), corpus, keep=2)
        sync = Checkpointer(sync_run, driver._driver_state, lambda e: None, asynchronous=False)
        b = _contents(sync.save(1, driver.workers))
    finally:
        driver.shutdown()
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "manifest.json"} <= set(a)
    assert a.keys() == b.keys()
    for f in set(a) - {".metadata", "manifest.json"}:  # the manifest holds .metadata's size
        assert a[f] == b[f], f
    ma, mb = pickle.loads(a[".metadata"]), pickle.loads(b[".metadata"])
    assert ma.state_dict_metadata == mb.state_dict_metadata and ma.storage_data == mb.storage_data
    assert ma.storage_meta.save_id != mb.storage_meta.save_id  # DCP's id of each save: why the bytes differ there


def _contents(path: str) -> dict[str, bytes]:
    """Every file of the checkpoint at ``path`` (a URI) and its bytes."""
    parent, name = path.rsplit("/", 1)
    store = CheckpointStore(parent)
    return {f: store.read(name, f) for f in store.files(name)}
