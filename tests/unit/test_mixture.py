"""[[data.sources]]: batches blended from several prepared stores by weight (Megatron's rule), each source on its
own epochs, resumable from a few integers; the real driver trains a mixture exactly (fake worker group, no Ray)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from flexorch.config import ModelConfig, OptimConfig, PlanSettings, TrainConfig
from flexorch.config.load import config_from_dict
from flexorch.data.mixture import IdRanges, MixtureStream, blend_counts, load_mixture
from flexorch.records.writer import read_records
from flexorch.testing.reference import reference_train
from tests.chat_helpers import write_jsonl
from tests.fake_cluster import fake_driver
from tests.train_helpers import cpu_profile


@pytest.mark.parametrize("weights", [(1, 1), (0.7, 0.2, 0.1), (5, 1, 1, 3), (0.999, 0.001)])
def test_blending_keeps_every_source_within_one_document_of_its_share(weights):
    w = np.asarray(weights, dtype=float) / sum(weights)
    taken = np.zeros(len(w), dtype=np.int64)
    for k in range(1, 2000):
        taken += blend_counts(weights, taken, 1)
        assert np.all(np.abs(taken - w * k) < 1.0 + 1e-9), (k, taken)
    assert blend_counts(weights, [0] * len(w), 1000).sum() == 1000


@pytest.mark.parametrize("sizes,weights,batch", [((7, 50), (1, 1), 8), ((3, 100, 20), (0.2, 0.5, 0.3), 16)])
def test_each_source_sees_every_document_once_per_own_epoch_and_resumes_exactly(sizes, weights, batch):
    stream = MixtureStream(sizes, weights, batch, seed=3, names=[f"s{i}" for i in range(len(sizes))])
    first = np.concatenate([[0], np.cumsum(sizes)])
    seen = [[] for _ in sizes]
    for step in range(40):
        if step == 17:  # a resume: a new stream continues from the state alone
            state = json.loads(json.dumps(stream.state_dict()))
            assert len(json.dumps(state)) < 1024
            stream = MixtureStream(sizes, weights, batch, seed=0, names=[f"s{i}" for i in range(len(sizes))])
            stream.load_state_dict(state)
        b = stream.next_batch()
        assert len(b.doc_ids) == batch
        for i in b.doc_ids:
            s = int(np.searchsorted(first, i, side="right") - 1)
            seen[s].append(i - first[s])
    for s, n in enumerate(sizes):
        ids = seen[s]
        for e in range(len(ids) // n):  # every full epoch of source s is a permutation of its documents
            assert sorted(ids[e * n : (e + 1) * n]) == list(range(n))
        assert len(set(ids[(len(ids) // n) * n :])) == len(ids) % n
    other = MixtureStream(sizes, weights, batch, seed=3, names=["x"] * len(sizes))
    with pytest.raises(ValueError, match="same \\[\\[data.sources\\]\\]"):
        other.load_state_dict(stream.state_dict())


def test_idranges_index_like_one_array():
    a, b = np.arange(5), np.arange(100, 103)
    r = IdRanges([a, b], [0, 10])
    assert len(r) == 8 and r[[0, 6, 4, 5]].tolist() == [0, 111, 4, 110] and r[7] == 112
    assert np.asarray(r).tolist() == [0, 1, 2, 3, 4, 110, 111, 112] and r.sum() == sum(np.asarray(r))
    with pytest.raises(IndexError):
        r[[8]]


def _sources(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [{"text": f"alpha {i} " + "a" * (i % 23)} for i in range(40)])
    b = write_jsonl(tmp_path / "b.jsonl", [{"prompt": f"q{i}?", "completion": f" ans {i}."} for i in range(12)])
    return a, b


def test_a_mixture_of_a_text_and_a_masked_store_trains_exactly_with_sources_in_the_records(tmp_path):
    a, b = _sources(tmp_path)
    table = {"max_context": 64, "cache": str(tmp_path / "cache")}
    table["sources"] = [{"source": str(a), "weight": 3}, {"source": str(b), "weight": 1, "name": "qa"}]
    data = config_from_dict({"data": table}).data
    assert [s.name for s in data.sources] == ["a.jsonl", "qa"]
    corpus = load_mixture(data, parallelism=0)  # in-process prepares: no Ray in this module
    assert corpus.num_docs == 52 and corpus.keys[0] == "a.jsonl/a.jsonl:1" and corpus.keys[40] == "qa/b.jsonl:1"
    assert corpus.targets is not None and int(corpus.targets[0]) == int(corpus.lengths[0]) - 1
    stored_qa = corpus.get_stored([45])[0]
    assert (stored_qa < 0).any()  # the prompt carries no loss
    cfg = TrainConfig(
        steps=3,
        workers=2,
        batch_size=8,
        run_dir=str(tmp_path / "run"),
        model=ModelConfig(),
        optim=OptimConfig(lr=1e-3, warmup_steps=1),
        data=data,
        plan=PlanSettings(profile=str(cpu_profile(tmp_path / "p.json")), tokens_per_worker=64, mode="static-ulysses-2"),
    )
    driver, _ = fake_driver(cfg, corpus)
    try:
        for _ in range(cfg.steps):
            driver.step()
        records = read_records(tmp_path / "run" / "steps.jsonl", validate=True)
        for r in records:
            assert r["sources"]["a.jsonl"]["docs"] == 6 and r["sources"]["qa"]["docs"] == 2  # 3:1 of 8, exactly
            lens = corpus.lengths[r["doc_ids"]]
            assert sum(v["tokens"] for v in r["sources"].values()) == int(np.sum(lens))
        trained = [sorted(r["doc_ids"]) for r in records]
        batches = [corpus.get_stored(ids) for ids in trained]
        ref = reference_train(cfg.model, cfg.optim, batches, cfg.seed)[1]
        for params in driver.replica_parameters():
            for name, value in params:
                np.testing.assert_allclose(value, ref[name].numpy(), rtol=1e-6, atol=1e-8, err_msg=name)
    finally:
        driver.shutdown()
