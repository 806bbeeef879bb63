"""Smoke test of ``benchmarks/measured/hf_step_time.py`` without Ray: a tiny shape through its single-process part."""

from __future__ import annotations

import importlib.util
import json

import pytest

from tests.paths import BENCHMARKS

pytest.importorskip("transformers")

BENCH = BENCHMARKS / "measured" / "hf_step_time.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_hf_step_time", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_hf_twin_has_our_shape_and_single_process_part_runs(tmp_path, capsys):
    bench = _bench()
    own = bench.own_model(32, 1, 2, 1, 88, 260)
    hf = bench.hf_twin(own, tmp_path / "llama")
    assert (hf.family, hf.hf is not None) == ("llama", True)
    assert hf.num_params() == own.num_params()
    assert all(getattr(hf, k) == getattr(own, k) for k in bench.SHAPE_KEYS)

    out = tmp_path / "r.json"
    args = ["--no-ray", "--dim", "32", "--layers", "1", "--heads", "2", "--kv-heads", "1", "--ffn", "88"]
    args += ["--vocab", "260", "--single-reps", "1", "--out", str(tmp_path), "--json", str(out)]
    assert bench.main([*args, "--families", "llama,gemma3_text"]) == 0
    r = json.loads(out.read_text())
    assert r["params"]["own"] == r["params"]["hf-llama"] == own.num_params()
    assert r["params"]["hf-gemma3_text"] > own.num_params()  # its q/k norms and two more norms a layer
    for family in ("llama", "gemma3_text"):
        sizes = r["single_process"][family]["sizes"]
        assert set(sizes) == {"128", "512", "1024"} and all(row["ratio"] > 0 for row in sizes.values())
    printed = capsys.readouterr().out
    assert "pairwise HF/own" in printed and "hf-gemma3_text ms" in printed
