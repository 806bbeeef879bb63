"""b. attention backends: the measured matmul peak (row ``b.peak``), then each backend's forward and backward time and
TFLOP/s on a long-tail varlen batch and its error against the ``math`` reference on a small batch
(rows ``b.attn.<name>``)."""

from __future__ import annotations

import statistics

import torch

from .check import Check, Ctx, FailRow, Row, SkipRow, last_line
from .measure import BWD_OVER_FWD, Laps, attn_fwd_flops, long_tail, qkv, rel_error
from .sizes import MATH_SCORE_BYTES, TOLERANCE

__all__ = [
    "attention_batch",
    "backend_row",
    "fwd_bwd",
    "matmul_tflops",
    "of_peak",
    "section_attention",
    "time_fwd_bwd",
    "unavailable",
]


def matmul_tflops(ctx: Ctx) -> float:
    """Rate of an n^3 matmul (2 n^3 FLOPs): bf16 on CUDA, fp32 on CPU; the median of the timed repetitions."""
    n = ctx.sizes.matmul
    a, b = (torch.randn(n, n, device=ctx.device, dtype=ctx.dtype) for _ in range(2))
    for _ in range(ctx.sizes.warmup + 1):
        a @ b
    laps = Laps(ctx.device)
    for _ in range(max(10, ctx.sizes.reps)):
        a @ b
        laps.mark()
    return 2 * n**3 / (statistics.median(laps.ms()) / 1e3) / 1e12


def fwd_bwd(batch, backend: str):
    """Output and q/k/v gradients of one forward + backward through ``varlen_attn_func``."""
    from flexorch.workers.attention.api import varlen_attn_func

    q, k, v, dout, cu, max_seqlen = batch
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    out = varlen_attn_func(*leaves, cu, max_seqlen, causal=True, backend=backend)
    out.backward(dout)
    return [out.detach(), *(x.grad for x in leaves)]


def time_fwd_bwd(batch, backend: str, ctx: Ctx) -> tuple[float, float]:
    """Median forward and backward ms after ``warmup`` runs."""
    from flexorch.workers.attention.api import varlen_attn_func

    q, k, v, dout, cu, max_seqlen = batch
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    fwd, bwd = [], []
    for i in range(ctx.sizes.warmup + ctx.sizes.reps):
        for x in leaves:
            x.grad = None
        laps = Laps(ctx.device)
        out = varlen_attn_func(*leaves, cu, max_seqlen, causal=True, backend=backend)
        laps.mark()
        out.backward(dout)
        laps.mark()
        if i >= ctx.sizes.warmup:
            f, b = laps.ms()
            fwd.append(f)
            bwd.append(b)
        del out
    return statistics.median(fwd), statistics.median(bwd)


def attention_batch(lengths, ctx: Ctx, seed: int):
    q, k, v, dout, offsets = qkv(lengths, ctx.sizes, ctx.device, ctx.dtype, seed)
    cu = torch.tensor(offsets, dtype=torch.int32, device=ctx.device)
    return q, k, v, dout, cu, max(lengths)


def unavailable(name: str, ctx: Ctx) -> str:
    from flexorch.workers.attention.kernels import DTYPES

    if name in ("flash_attn", "torch_cudnn", "torch_flash") and not ctx.cuda:
        return ctx.no_cuda(f"{name} is a CUDA kernel")
    if ctx.dtype not in DTYPES[name]:
        return f"{name} does not run {str(ctx.dtype).removeprefix('torch.')}"
    if name == "flash_attn":
        return "flash-attn is not installed (pip install flash-attn)"
    if name == "torch_flash":
        return "this torch has no aten::_flash_attention_forward"
    if name == "torch_cudnn":
        return "this torch has no cuDNN attention (aten::_scaled_dot_product_cudnn_attention)"
    return f"{name} is a CPU kernel; this run is on {ctx.device}"


def of_peak(tflops: float, ctx: Ctx) -> str:
    return f" ({100 * tflops / ctx.peak_tflops:.0f} % of peak)" if ctx.peak_tflops else ""


def backend_row(check: Check, ctx: Ctx, name: str, available: list[str], small, reference) -> None:
    sz = ctx.sizes
    with check.row(f"b.attn.{name}", f"attention {name} ({str(ctx.dtype).removeprefix('torch.')})") as r:
        if name not in available:
            raise SkipRow(unavailable(name, ctx))
        err = 0.0
        if name != "math":
            err = max(rel_error(g, w) for g, w in zip(fwd_bwd(small, name), reference, strict=True))
        tail = long_tail(*sz.tail)
        too_big = name == "math" and 3 * 4 * sz.heads * max(tail) ** 2 > MATH_SCORE_BYTES
        lengths = list(sz.small) if too_big else tail
        batch = small if too_big else attention_batch(tail, ctx, seed=1)
        f_ms, b_ms = time_fwd_bwd(batch, name, ctx)
        del batch
        fwd = attn_fwd_flops(lengths, sz.heads, sz.head_dim)
        f_tf, b_tf = fwd / f_ms / 1e9, BWD_OVER_FWD * fwd / b_ms / 1e9
        where = "small batch (the long tail's scores would not fit)" if too_big else f"long tail, {sum(lengths):,} tok"
        r.metrics = {"fwd_ms": f_ms, "bwd_ms": b_ms, "fwd_tflops": f_tf, "bwd_tflops": b_tf, "max_rel_err": err}
        r.metrics["batch"] = "small" if too_big else "long_tail"
        r.detail = (
            f"{where}: fwd {f_ms:.2f} ms {f_tf:.3g} TFLOP/s{of_peak(f_tf, ctx)}, bwd {b_ms:.2f} ms "
            f"{b_tf:.3g} TFLOP/s{of_peak(b_tf, ctx)}; "
            + ("the reference" if name == "math" else f"max error vs math {err:.2e} (out, dq, dk, dv)")
        )
        if err > TOLERANCE[ctx.dtype]:
            raise FailRow(f"error vs math {err:.2e} > {TOLERANCE[ctx.dtype]:.0e}; {r.detail}")


def section_attention(check: Check, ctx: Ctx) -> None:
    from flexorch.workers.attention.kernels import BACKENDS, available_backends

    kind = "bf16" if ctx.cuda else "fp32 (CPU)"
    with check.row("b.peak", f"{kind} matmul peak, {ctx.sizes.matmul}^3") as r:
        ctx.peak_tflops = matmul_tflops(ctx)
        r.metrics = {"tflops": ctx.peak_tflops}
        r.detail = f"{ctx.peak_tflops:.3g} TFLOP/s"
    available = available_backends(ctx.device, ctx.dtype)
    print(f"    backends here, fastest first: {available}; long tail: {long_tail(*ctx.sizes.tail)}", flush=True)
    small, reference = None, None
    try:
        small = attention_batch(list(ctx.sizes.small), ctx, seed=0)
        reference = fwd_bwd(small, "math")
    except Exception as e:  # noqa: BLE001 - every backend row then fails with this
        why = last_line(e)
        for name in BACKENDS:
            row = Row(f"b.attn.{name}", f"attention {name}", "failed", f"math reference on the small batch: {why}")
            check.add(row, started=False)
        return
    for name in BACKENDS:
        backend_row(check, ctx, name, available, small, reference)
    if ctx.cuda:
        torch.cuda.empty_cache()
