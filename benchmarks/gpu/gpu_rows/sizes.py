"""Problem sizes of the two modes (full: one H100; dry: CPU) and the bounds the rows are judged by."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flexorch.config.model import ModelConfig

__all__ = ["DRY", "FULL", "MATH_SCORE_BYTES", "MEMORY_SLACK", "MODEL_1B", "PREDICT_SLACK", "TOLERANCE", "Sizes"]

# bf16 (and fp16) results against a reference of the same dtype: within 2e-2 of max(1, the reference's largest
# magnitude), the bound tests/unit/test_sp_attention.py uses against float64; fp32 within 1e-4 (observed ~1e-6).
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 1e-2, torch.float32: 1e-4}
MEMORY_SLACK = 1.5
"""d.memory fails when the allocator's peak exceeds the planner's prediction by more than this factor."""
PREDICT_SLACK = 0.25
"""e.predict fails when the calibrated cost model misses the measured step by more than this (the goal is 6 %)."""
MATH_SCORE_BYTES = 2**31
"""The math reference materialises fp32 scores (h, L, L) per document: above this it is timed on the small batch."""


@dataclass(frozen=True)
class Sizes:
    """Problem sizes of one mode: full (one H100, under 8 minutes in all) or dry (CPU, seconds)."""

    heads: int
    kv_heads: int
    head_dim: int
    tail: tuple[int, int]
    """(longest, shortest) document of the attention long-tail batch (:func:`long_tail`)."""
    small: tuple[int, ...]
    """Document lengths of the accuracy batch every backend runs against the math reference."""
    matmul: int
    """n of the n x n x n matmul whose rate is the peak."""
    warmup: int
    reps: int
    sp_tail: tuple[int, int]
    sp_odd: tuple[int, ...]
    """Lengths added to the SP batch that no degree divides (padding in both layouts)."""
    sp_degrees: tuple[int, ...]
    model: ModelConfig
    step_tail: tuple[int, int]
    tokens_per_worker: int
    cal_repeats: int
    pytest_timeout_s: float
    job_timeout_s: float


# 1.1B parameters: TinyLlama-1.1B's shape (dim 2048, 22 layers, FFN 5632, 4 KV heads, vocab 32000) with 16 heads of 128.
MODEL_1B = ModelConfig(vocab_size=32000, dim=2048, num_layers=22, num_heads=16, num_kv_heads=4, ffn_dim=5632)
FULL = Sizes(
    heads=16, kv_heads=4, head_dim=128, tail=(131072, 8192), small=(1, 37, 300, 1024, 2048), matmul=8192,
    warmup=2, reps=5, sp_tail=(8192, 512), sp_odd=(77, 1), sp_degrees=(2, 4), model=MODEL_1B,
    step_tail=(8192, 512), tokens_per_worker=32768, cal_repeats=3, pytest_timeout_s=240, job_timeout_s=180,
)  # fmt: skip
DRY = Sizes(
    heads=4, kv_heads=2, head_dim=16, tail=(128, 16), small=(1, 37, 100, 200), matmul=256,
    warmup=1, reps=1, sp_tail=(64, 8), sp_odd=(7, 1), sp_degrees=(2, 4), model=ModelConfig(),
    step_tail=(64, 8), tokens_per_worker=256, cal_repeats=1, pytest_timeout_s=120, job_timeout_s=120,
)  # fmt: skip
