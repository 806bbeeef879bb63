"""The attention kernel a worker runs, chosen by measurement on its own device, dtype and head shape.

Which varlen kernel is fastest depends on the GPU, the dtype and the head size (on an H200 cuDNN's beats torch's
FlashAttention-2 at head dims 64 and 128, ``benchmarks/results/gpu/gpu_profile_h200.md``; on another card or torch
the order may differ), so ``[model] attention = "auto"`` (the default) does not assume it. At worker start
:func:`choose_backend`:

1. checks each candidate against the ``math`` reference in fp32 (fp64 for fp64) on a small batch that reaches
   every path of the kernel (a document long enough for cuDNN's and one-token ones): output, log-sum-exp and the
   three gradients within the dtype's tolerance; a kernel that fails or raises is refused, with the reason kept;
2. times forward + backward of the exact ones on a probe batch of the worker's head shape (documents of 8192,
   4096, 2048 and 1000 tokens: attention's cost is in the long ones), median of three after a warm-up;
3. makes the fastest the process default (:func:`~.kernels.set_default_backend`) and returns a :class:`Choice`
   the worker reports (``describe()``).

On a CPU there is one fused kernel (``torch_cpu``) and nothing is measured.

A model with a sliding window (``ModelConfig.attention_window``; any window, since some layers use it) considers only
the kernels that compute one (:data:`~.kernels.WINDOW_BACKENDS`), checks them with the window (the model's and one of
:data:`CHECK_WINDOW` keys, where a key too many or too few in a window moves the output by ~1/16, over every
tolerance) and times them with the model's window; a named kernel that cannot compute a window is refused.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch

from flexorch.config.model import ModelConfig
from flexorch.workers.attention.kernels import (
    WINDOW_BACKENDS,
    Seqlens,
    acc_dtype,
    attn_backward,
    attn_forward,
    available_backends,
    default_backend,
    set_default_backend,
)

__all__ = [
    "CHECK_LENGTHS",
    "CHECK_WINDOW",
    "PROBE_LENGTHS",
    "TOLERANCE",
    "Choice",
    "choose_backend",
    "kernel_error",
    "model_window",
    "set_attention",
]

CHECK_LENGTHS = (4100, 300, 1, 1)
"""Documents of the exactness check: one past ``torch_cudnn.MIN_TOKENS`` and not a multiple of its padding, a short
one and two single tokens."""
CHECK_WINDOW = 16
"""A sliding window the exactness check of a windowed model also runs (short: an error at its edge shows)."""
PROBE_LENGTHS = (8192, 4096, 2048, 1000)
"""Documents of the timed probe."""
TOLERANCE = {torch.float16: 1e-2, torch.bfloat16: 2e-2, torch.float32: 1e-4, torch.float64: 1e-10}
"""Largest error against the reference, relative to max(1, the reference's largest magnitude), per input dtype (the
bounds the attention tests use)."""


@dataclass(frozen=True)
class Choice:
    """The kernel chosen, and what was measured."""

    name: str
    ms: dict[str, float] = field(default_factory=dict)
    """Forward + backward milliseconds of each exact candidate on the probe batch."""
    errors: dict[str, float] = field(default_factory=dict)
    """Each candidate's error against the reference."""
    refused: dict[str, str] = field(default_factory=dict)
    """Candidates not used, and why."""
    tokens: int = 0
    """Tokens of the probe batch."""
    seconds: float = 0.0
    """Wall time of the whole choice (every check and timing): what it adds to a worker's start."""

    def describe(self) -> str:
        if not self.ms:
            return f"attention kernel {self.name} (the only one here)"
        timed = ", ".join(f"{k} {v:.1f} ms" for k, v in sorted(self.ms.items(), key=lambda kv: kv[1]))
        text = f"attention kernel {self.name}, measured: {timed} (forward + backward, {self.tokens:,} tokens)"
        if self.refused:
            text += "; not used: " + "; ".join(f"{k}: {v}" for k, v in self.refused.items())
        return text + f"; chosen in {self.seconds:.1f} s"


def _offsets(lengths) -> Seqlens:
    out = [0]
    for n in lengths:
        out.append(out[-1] + int(n))
    return Seqlens(tuple(out))


def _inputs(lengths, heads, kv_heads, head_dim, device, dtype, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    t = sum(lengths)
    shapes = ((t, heads, head_dim), (t, kv_heads, head_dim), (t, kv_heads, head_dim), (t, heads, head_dim))
    return [torch.randn(s, generator=g).to(device=device, dtype=dtype) for s in shapes]


def _run(name, q, k, v, dout, cu, scale, window=None):
    kw = {"causal": True, "softmax_scale": scale, "backend": name, "window": window}
    out, lse = attn_forward(q, k, v, cu, cu, **kw)
    return (out, lse, *attn_backward(dout, q, k, v, out, lse, cu, cu, **kw))


def kernel_error(
    name: str,
    heads: int,
    kv_heads: int,
    head_dim: int,
    device,
    dtype,
    lengths=CHECK_LENGTHS,
    window: int | None = None,
) -> float:
    """Largest relative error of ``name``'s out, lse, dq, dk, dv against ``math`` in :func:`acc_dtype` (with a
    sliding ``window``: at that window and at one of at most :data:`CHECK_WINDOW` keys)."""
    q, k, v, dout = _inputs(lengths, heads, kv_heads, head_dim, device, dtype, seed=0)
    cu, scale = _offsets(lengths), head_dim**-0.5
    err = 0.0
    for w in (None,) if window is None else sorted({window, min(window, CHECK_WINDOW)}):
        got = _run(name, q, k, v, dout, cu, scale, w)
        ref = _run("math", *(x.to(acc_dtype(dtype)) for x in (q, k, v, dout)), cu, scale, w)
        pairs = zip(got, ref, strict=True)
        err = max(err, *(float((a.to(b.dtype) - b).abs().max()) / max(1.0, float(b.abs().max())) for a, b in pairs))
    return err


def model_window(cfg: ModelConfig) -> int | None:
    """The sliding window the model's attention must compute (None: none): ``attention_window``, or the smallest
    of a per-layer list; any window means the kernel must support one."""
    window = getattr(cfg, "attention_window", None)
    if window is None or isinstance(window, int):
        return window
    windows = [w for w in window if w is not None]
    return min(windows) if windows else None


def _time_ms(name, q, k, v, dout, cu, scale, reps: int, window=None) -> float:
    cuda = q.device.type == "cuda"
    laps = []
    for i in range(1 + reps):
        if cuda:
            torch.cuda.synchronize(q.device)
        t0 = time.perf_counter()
        _run(name, q, k, v, dout, cu, scale, window)
        if cuda:
            torch.cuda.synchronize(q.device)
        if i:
            laps.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(laps)


def choose_backend(
    device: torch.device,
    dtype: torch.dtype,
    heads: int,
    kv_heads: int,
    head_dim: int,
    *,
    candidates: tuple[str, ...] | None = None,
    probe: tuple[int, ...] = PROBE_LENGTHS,
    check: tuple[int, ...] = CHECK_LENGTHS,
    reps: int = 3,
    window: int | None = None,
) -> Choice:
    """Measure, choose and set the default attention kernel for ``dtype`` on ``device`` (see the module doc).
    ``candidates``: the kernels to consider (default: every one available here but the ``math`` reference);
    ``window``: the model's sliding window (only kernels that compute one are considered, checked and timed with it)."""
    if candidates is None:
        available = available_backends(device, dtype)
        candidates = tuple(b for b in available if b != "math") or ("math",)
    if window is not None:
        candidates = tuple(b for b in candidates if b in WINDOW_BACKENDS) or ("math",)
    if len(candidates) == 1:
        set_default_backend(device, dtype, candidates[0])
        return Choice(candidates[0])
    t0 = time.perf_counter()
    errors, refused, ms = {}, {}, {}
    q, k, v, dout = _inputs(probe, heads, kv_heads, head_dim, device, dtype, seed=1)
    cu, scale = _offsets(probe), head_dim**-0.5
    for name in candidates:
        try:
            errors[name] = err = kernel_error(name, heads, kv_heads, head_dim, device, dtype, check, window)
            if not err <= TOLERANCE[dtype]:
                refused[name] = f"error {err:.1e} against the reference (bound {TOLERANCE[dtype]:.0e})"
                continue
            ms[name] = _time_ms(name, q, k, v, dout, cu, scale, reps, window)
        except Exception as e:  # noqa: BLE001 - a kernel that cannot run here is not chosen; the reason is reported
            refused[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if not ms:
        raise RuntimeError(f"no attention kernel matches the reference on {device} in {dtype}: {refused}")
    name = min(ms, key=ms.get)
    set_default_backend(device, dtype, name)
    return Choice(name, ms, errors, refused, sum(probe), time.perf_counter() - t0)


def set_attention(cfg: ModelConfig, device: torch.device | None, precision: str) -> str:
    """Make ``[model] attention`` this process's default kernel for the dtype ``precision`` computes in: a named
    kernel as set (ValueError, saying what runs here, when it cannot run); ``auto`` on a GPU in fp16/bf16 measured
    with :func:`choose_backend` (printed: a Ray worker's output reaches the driver's log); ``auto`` elsewhere the
    static default. Returns what was chosen, in words."""
    dev = device or torch.device("cpu")
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    window = model_window(cfg)
    if cfg.attention != "auto":
        if window is not None and cfg.attention not in WINDOW_BACKENDS:
            raise ValueError(
                f"[model] attention = {cfg.attention!r} cannot compute the model's sliding window (attention_window "
                f"= {window}): choose one of {list(WINDOW_BACKENDS)} or 'auto'"
            )
        set_default_backend(dev, dtype, cfg.attention)
        return f"attention kernel {cfg.attention} (as set)"
    if dev.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        fallback = default_backend(dev, dtype, window=window is not None) if dev.type != "cuda" else None
        return "attention kernel " + (fallback or "math (fp32 on CUDA)")
    choice = choose_backend(dev, dtype, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, window=window)
    print(f"worker on {dev}: {choice.describe()}", flush=True)
    return choice.describe()
