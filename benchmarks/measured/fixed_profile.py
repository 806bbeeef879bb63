"""A fixed CPU cost profile with a model's shape, for benchmarks that must give the planner the same inputs on
every run (no calibration): the timing constants of ``tests/train_helpers.cpu_profile``."""

from __future__ import annotations

import json
from pathlib import Path

from flexorch.config import ModelConfig
from flexorch.solver.profiles import Profile

__all__ = ["write_fixed_profile"]


def write_fixed_profile(path: Path, model: ModelConfig, name: str, act_bytes_per_token: float = 11_000.0) -> Path:
    """Write the profile to ``path`` (JSON, as ``[plan] profile`` reads it) and return ``path``."""
    p = Profile(
        name=name,
        a1_ms=2e-5,
        a2_ms=0.02,
        b1_ms=1.0,
        act_bytes_per_token=act_bytes_per_token,
        memory_budget_bytes=1e12,
        model_state_bytes=0.0,
        num_layers=model.num_layers,
        hidden=model.dim,
        num_heads=model.num_heads,
        num_kv_heads=model.num_kv_heads,
        a2a_gbps={2: 1.0, 4: 1.0},
        bytes_per_element=4,
    )
    data = json.loads(p.to_json())
    data.update({"a2a_latency_ms": {"2": 4.0, "4": 8.0}, "p2p_latency_ms": {"2": 3.0, "4": 9.0}})
    path.write_text(json.dumps(data))
    return path
