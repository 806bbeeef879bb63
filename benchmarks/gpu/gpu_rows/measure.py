"""Batches, timing, FLOPs and errors: what the attention, SP and training-step rows share."""

from __future__ import annotations

import time

import torch

from .sizes import Sizes

__all__ = [
    "BWD_OVER_FWD",
    "Laps",
    "attn_fwd_flops",
    "long_tail",
    "offsets_of",
    "qkv",
    "rel_error",
    "sync",
]


def long_tail(longest: int, shortest: int) -> list[int]:
    """One document of ``longest`` tokens, then each length half the one before and twice as many of them, down to
    ``shortest`` (131072, 65536, 2 x 32768, 4 x 16384, 8 x 8192: every length class holds half the longest)."""
    lengths, n = [longest], longest // 2
    while n >= shortest:
        lengths += [n] * (longest // (2 * n))
        n //= 2
    return lengths


def offsets_of(lengths) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + int(n))
    return out


def attn_fwd_flops(lengths, heads: int, head_dim: int) -> float:
    """Causal attention forward FLOPs: two matmuls (QK^T, PV) of 2 * L^2 * h * hd each, halved by the causal mask:
    4 * sum(L^2) / 2 * h * hd (FlashAttention-2, arXiv 2307.08691, Sec. 4.1, the count its benchmarks use)."""
    return 4.0 * sum(float(n) * n for n in lengths) / 2 * heads * head_dim


BWD_OVER_FWD = 2.5
"""Backward FLOPs / forward FLOPs of attention: 5 matmuls against 2 (FlashAttention-2, arXiv 2307.08691, Sec. 4.1)."""


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Laps:
    """Times between marks: CUDA events on a GPU (no host sync inside the timed region), the clock on a CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list = []
        self.mark()

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def ms(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) for a, b in zip(self.marks, self.marks[1:], strict=False)]
        return [(b - a) * 1e3 for a, b in zip(self.marks, self.marks[1:], strict=False)]


def qkv(lengths, sizes: Sizes, device, dtype, seed: int):
    """Random q (t, h, hd), k, v (t, h_kv, hd), dout (t, h, hd) drawn on ``device`` and the offsets."""
    gen = torch.Generator(device=device).manual_seed(seed)
    t = sum(lengths)
    heads = (sizes.heads, sizes.kv_heads, sizes.kv_heads, sizes.heads)
    q, k, v, dout = (torch.randn(t, h, sizes.head_dim, generator=gen, device=device).to(dtype) for h in heads)
    return q, k, v, dout, offsets_of(lengths)


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max(1, max |want|), in float32."""
    want = want.float()
    return float((got.float() - want).abs().max()) / max(1.0, float(want.abs().max()))
