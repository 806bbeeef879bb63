"""Shared pieces of the training tests: a small real corpus, a fixed CPU profile, configs, the reference run."""

from __future__ import annotations

import dataclasses
import inspect
import json
import textwrap
from pathlib import Path

import numpy as np

from flexorch.config import (
    CorpusConfig,
    ElasticSettings,
    ModelConfig,
    OptimConfig,
    PipelineSettings,
    PlanSettings,
    TrainConfig,
)
from flexorch.solver.profiles import Profile
from flexorch.testing.faults import WorkerFault

# Byte lengths of the test documents: long-tailed, the longest (255 B + BOS = 256 tokens) needs all 4 workers
# at 64 tokens per worker, the shortest are a few bytes.
DOC_BYTES = [5, 40, 255, 17, 90, 200, 127, 60, 8, 33, 150, 71, 12, 250, 99, 3, 180, 45, 64, 22, 120, 7, 230, 55]


def write_corpus(root: Path, sizes=DOC_BYTES) -> Path:
    """Real text (the standard library's textwrap source) cut into documents of the given byte sizes."""
    text = inspect.getsource(textwrap).encode()
    root.mkdir(parents=True, exist_ok=True)
    pos = 0
    for i, n in enumerate(sizes):
        (root / f"doc_{i:03d}.txt").write_bytes(text[pos : pos + n])
        pos += n
    return root


def cpu_profile(path: Path) -> Path:
    """A fixed profile (no calibration) with the tiny model's shape and a real collective latency."""
    p = Profile(
        name="test-cpu",
        a1_ms=2e-5,
        a2_ms=0.02,
        b1_ms=1.0,
        act_bytes_per_token=11_000.0,
        memory_budget_bytes=1e9,
        model_state_bytes=0.0,
        num_layers=2,
        hidden=64,
        num_heads=4,
        num_kv_heads=2,
        a2a_gbps={2: 1.0, 4: 1.0},
        bytes_per_element=4,
    )
    data = json.loads(p.to_json())
    data.update({"a2a_latency_ms": {"2": 4.0, "4": 8.0}, "p2p_latency_ms": {"2": 3.0, "4": 9.0}})
    path.write_text(json.dumps(data))
    return path


def model_profile(cfg: ModelConfig, act_bytes_per_token: float, **overrides) -> Profile:
    """gpt-7b-a100's timing constants with the shape of the model ``cfg`` (float32 activations), the given activation
    bytes per token and no model state; ``overrides`` set the rest (budget, LM head's share)."""
    from flexorch.solver.profiles import get_profile

    return dataclasses.replace(
        get_profile("gpt-7b-a100"),
        num_layers=cfg.num_layers,
        hidden=cfg.dim,
        num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads,
        bytes_per_element=4,
        act_bytes_per_token=act_bytes_per_token,
        model_state_bytes=0.0,
        **overrides,
    )


def training_env(tmp_path_factory, name: str):
    """Module fixture body: the suite's shared Ray (room for 4 workers: ``tests.ray_env``), a corpus, a fixed
    profile."""
    from flexorch.data.corpus import load_corpus
    from tests.ray_env import shared_ray

    shared_ray()
    root = tmp_path_factory.mktemp(name)
    corpus_dir = write_corpus(root / "corpus")
    profile = cpu_profile(root / "profile.json")
    corpus = load_corpus(CorpusConfig(source=str(corpus_dir), max_context=256))
    yield root, corpus_dir, profile, corpus


def train_config(corpus_dir: Path, run_dir: Path, profile: Path, **overrides) -> TrainConfig:
    """A small run; ``plan``, ``elastic`` and ``pipeline`` overrides are dicts of their table's keys."""
    plan = {"profile": str(profile), "tokens_per_worker": 64, "time_limit_s": 0.3, **overrides.pop("plan", {})}
    values = {
        "steps": 3,
        "workers": 4,
        "batch_size": 8,
        "seed": 0,
        "run_dir": str(run_dir),
        # the head and loss in chunks of 24 tokens (a rank's micro-batch here holds up to 64): every run through
        # this helper trains on the chunked path and is checked against the reference's plain whole-logits loss
        "model": ModelConfig(loss_chunk_tokens=24),
        # eps 1e-6, not Adam's 1e-8: Adam divides by the gradient's RMS, so an element whose gradient is ~1e-8 turns
        # a float-reordering difference into a step of ~lr (seen on 2026-11-25: one embedding element of 16,448,
        # 4e-5 off in every mode, static-ulysses-1 included; with eps 1e-6 all equal), as
        # tests/unit/test_pipeline_dist.py
        "optim": OptimConfig(lr=1e-3, warmup_steps=1, eps=1e-6),
        "data": CorpusConfig(source=str(corpus_dir), max_context=256),
        "plan": PlanSettings(**plan),
        "elastic": ElasticSettings(**overrides.pop("elastic", {})),
        "pipeline": PipelineSettings(**overrides.pop("pipeline", {})),
        **overrides,
    }
    return TrainConfig(**values)


def reference_losses_and_params(cfg: TrainConfig, corpus, records) -> tuple[list[float], dict]:
    from flexorch.testing.reference import reference_train

    batches = [corpus.get_stored(r["doc_ids"]) for r in records if not r["skipped"]]  # with any loss masks
    losses, state = reference_train(cfg.model, cfg.optim, batches, cfg.seed)
    return losses, {k: v.numpy() for k, v in state.items()}


def assert_params_close(
    replicas: list, reference: dict, atol: float = 2e-5, rtol: float = 1e-4, whole: bool = True
) -> None:
    """Every rank's parameters (``whole``: each rank a whole replica; else the parts it holds, stage-local) are
    bitwise equal where two ranks hold the same one, together cover the model, and match the reference."""
    merged: dict = {}
    for rank, params in enumerate(replicas):  # every copy took the same all-reduced gradient: bitwise identical
        if whole:
            assert {name for name, _ in params} == set(reference), f"rank {rank} does not hold the whole model"
        for name, value in params:
            if name in merged:
                np.testing.assert_array_equal(value, merged[name], err_msg=f"copies differ at {name}")
            merged[name] = value
    assert set(merged) == set(reference)
    for name, value in merged.items():
        np.testing.assert_allclose(value, reference[name], rtol=rtol, atol=atol, err_msg=name)


def small_run_toml(root: Path, steps: int, **keys) -> Path:
    """A real corpus, the fixed profile and a 2-worker TOML run file under ``root`` for CLI and job tests."""
    corpus_dir = write_corpus(root / "corpus")
    profile = cpu_profile(root / "profile.json")
    extra = "".join(f"{k} = {v}\n" for k, v in keys.items())
    path = root / "run.toml"
    path.write_text(
        f"steps = {steps}\nworkers = 2\nbatch_size = 6\n{extra}"
        f"[data]\nsource = '{corpus_dir}'\nmax_context = 128\n"
        f"[plan]\nprofile = '{profile}'\ntokens_per_worker = 64\n"
    )
    return path


def run_driver(cfg: TrainConfig, corpus, faults=(), before=None) -> tuple[list[dict], list]:
    """Set a driver up, inject ``faults`` ((worker id, point, step, nth, action), ...), call ``before(driver)`` if
    given, step it to the end (a resumed run starts after its checkpoint's step); returns the records and every
    replica's parameters."""
    from flexorch.control.driver import TrainingDriver

    driver = TrainingDriver(cfg, corpus=corpus)
    try:
        driver.setup()
        if before is not None:
            before(driver)
        for wid, point, step, nth, action in faults:
            driver.workers.actor(wid).add_probe.remote(WorkerFault(point, step, nth, action))
        records = []
        while not driver.finished:
            t = driver.step()
            if t.record is None:  # rolled back to a checkpoint: the steps after it are trained again
                records = [r for r in records if r["step"] < t.next_step]
            else:
                records.append(t.record)
        return records, driver.replica_parameters()
    finally:
        driver.shutdown()


def check_against_reference(cfg: TrainConfig, corpus, records: list[dict], replicas: list, whole: bool = True) -> None:
    """The ledger (every step trained exactly the documents of a fault-free run, each once), the per-step losses
    and the parameters against the single-process reference, and every replica identical."""
    import pytest

    from flexorch.data.stream import DocumentStream

    stream = DocumentStream(corpus.num_docs, cfg.batch_size, cfg.seed)
    assert [r["doc_ids"] for r in records] == [list(stream.next_batch().doc_ids) for _ in records]
    ref_losses, ref_params = reference_losses_and_params(cfg, corpus, records)
    assert [r["loss"] for r in records] == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
    assert_params_close(replicas, ref_params, whole=whole)


def next_record(driver) -> dict:
    """Step ``driver`` until a step is trained or skipped (a roll-back's transition has no record); its record."""
    while True:
        t = driver.step()
        if t.record is not None:
            return t.record


def own_cluster(tmp_path_factory, name: str, head_cpus: int):
    """A module's own ``ray.cluster_utils.Cluster`` (the suite's shared local Ray shut down first) with a head of
    ``head_cpus`` slots, connected, and a small corpus: yields (cluster, corpus dir, profile path, corpus, root)."""
    import ray
    from ray.cluster_utils import Cluster

    from flexorch.data.corpus import load_corpus
    from tests.ray_env import release_if_held

    release_if_held()
    if ray.is_initialized():
        ray.shutdown()  # the suite's shared local Ray: this module needs a cluster of its own
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": head_cpus, "include_dashboard": False})
    ray.init(address=c.address, logging_level="ERROR")
    root = tmp_path_factory.mktemp(name)
    corpus_dir = write_corpus(root / "corpus")
    corpus = load_corpus(CorpusConfig(source=str(corpus_dir), max_context=256))
    yield c, corpus_dir, cpu_profile(root / "profile.json"), corpus, root
    ray.shutdown()
    c.shutdown()
