"""Smoke test of ``benchmarks/measured/data_scale.py`` without Ray: its corpus generator writes the JSONL the loader
reads, with the sizes it promises, and reuses it on the next run."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from tests.paths import BENCHMARKS

BENCH = BENCHMARKS / "measured" / "data_scale.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_data_scale", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_sizes_and_generated_corpora(tmp_path, monkeypatch):
    bench = _bench()
    monkeypatch.setattr(bench, "WORD_BUFFER_BYTES", 1 << 20)
    assert bench.parse_size("1.2B") == {"name": "1.2B", "short": False, "tokens": 1_200_000_000}
    assert bench.parse_size("short3M") == {"name": "short3M", "short": True, "docs": 3_000_000}

    long = bench.generate(bench.parse_size("200K"), tmp_path)
    rows = [json.loads(line) for line in Path(long["path"]).read_text().splitlines()]
    assert len(rows) == long["records"] and all(isinstance(r["text"], str) and r["text"] for r in rows)
    tokens = sum(len(r["text"].encode()) + 1 for r in rows)  # byte tokenizer: a token per byte + BOS
    assert tokens == long["byte_tokens"] and 200_000 <= tokens < 200_000 + 250_000

    short = bench.generate(bench.parse_size("short1K"), tmp_path)
    texts = [json.loads(line)["text"] for line in Path(short["path"]).read_text().splitlines()]
    assert len(texts) == 1000 and all(40 <= len(t) <= 80 for t in texts)

    mtime = Path(short["path"]).stat().st_mtime_ns
    assert bench.generate(bench.parse_size("short1K"), tmp_path) == short  # reused, not written again
    assert Path(short["path"]).stat().st_mtime_ns == mtime
