"""Runs whose checkpoints live in object storage (``[checkpoint] storage = "s3://..."``, moto's server on
127.0.0.1): a run saved to S3 whose run directory is then deleted resumes from storage alone, in a new run
directory, exactly (losses and parameters against the single-process reference), replicated and sharded (every
fsdp worker wrote its shard straight to S3); ``flexorch export`` reads a checkpoint from S3."""

from __future__ import annotations

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


def _cfg(env, name: str, mode: str, **kw):
    root, corpus_dir, profile, _, s3 = env
    storage = CheckpointSettings(storage=f"{s3.root}/{mode}")
    return train_config(
        corpus_dir, root / name, profile, workers=2, plan={"tokens_per_worker": 128}, checkpoint=storage,
        sharding=ShardingSettings(mode=mode), **kw,
    )  # fmt: skip


@pytest.mark.parametrize("mode", ["replicate", "fsdp"])
def test_a_run_resumes_from_object_storage_alone_in_a_new_run_dir(env, mode):
    root, _, _, corpus, _ = env
    first = _cfg(env, f"{mode}-first", mode, steps=2, checkpoint_every=1)
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
