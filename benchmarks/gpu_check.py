"""One command for a lent GPU machine: the CUDA tests, the attention kernels, SP attention on one GPU, a 1B-class
training step and a GPU calibration, in one table.

    python3 benchmarks/gpu_check.py               # one H100: under 8 minutes
    python3 benchmarks/gpu_check.py --dry         # the same code paths on CPU with tiny sizes (under a minute)
    python3 benchmarks/gpu_check.py --out DIR     # table.json, table.md, profile.json, ... (default runs/gpu_check)

Torch only: nothing this script imports pulls in Ray (the GPU machine has none), and it puts the repository root on
``sys.path`` itself, so a checkout runs it without ``pip install -e .``. The rows:

a. every test marked ``gpu``: ``pytest -m gpu`` in a subprocess, each test's outcome from its JUnit XML;
b. the measured matmul peak, then each attention backend's forward and backward time and TFLOP/s on a long-tail
   varlen batch, and its error against the ``math`` reference on a small batch;
c. Ulysses and zigzag ring attention at degrees 2 and 4 with every rank on the one device (a gloo world: NCCL
   refuses two ranks on one GPU), outputs and gradients against the single-device result;
d. one training step of a 1.1B decoder (FSDP2 on a world of one, bf16, full activation checkpointing) through
   ``flexorch.workers.sharded_step.run_sharded_step``: tokens/s, MFU, peak memory against the planner's prediction;
e. a calibration through the project's path (``flexorch.control.calibration.calibrate`` on a one-worker group in
   this process) written as ``<out>/profile.json`` and loaded back with ``flexorch.solver.profiles.get_profile``;
   then the planner's time for d's batch from that profile against d's measured step time.

Every row is passed, failed or skipped with its reason; a failing row never stops the others, and the exit code is
1 when any row failed. ``--dry`` runs every row on the CPU (CUDA-only rows skipped with "no CUDA").
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import platform
import queue
import signal
import statistics
import subprocess
import sys
import time
import traceback
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flexorch.config.model import ModelConfig  # noqa: E402

# bf16 (and fp16) results against a reference of the same dtype: within 2e-2 of max(1, the reference's largest
# magnitude), the bound tests/test_sp_attention.py uses against float64; fp32 within 1e-4 (observed ~1e-6).
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


# ---------------------------------------------------------------------------------------------------------------
# Rows: status, reason, timing; a failing row is recorded and the next one runs
# ---------------------------------------------------------------------------------------------------------------


class SkipRow(Exception):
    """Raised inside a row: the row is skipped with this reason."""


class FailRow(Exception):
    """Raised inside a row: the row failed with this reason (no traceback needed)."""


@dataclass
class Row:
    """One line of the table."""

    key: str
    """Stable id, the same in both modes: 'a.pytest', 'a.test:<test id>', 'b.attn.<backend>', 'c.ring.d4', ..."""
    name: str
    status: str = "passed"
    """'passed', 'failed' or 'skipped'."""
    reason: str = ""
    """Why it failed or was skipped (a failure's last traceback line)."""
    detail: str = ""
    """What was measured, in words."""
    time_s: float = 0.0
    metrics: dict = field(default_factory=dict)
    """The numbers behind ``detail`` (table.json)."""


def last_line(exc: BaseException | None = None) -> str:
    """The last line of the current traceback (the exception and its message)."""
    lines = traceback.format_exc().strip().splitlines()
    return lines[-1] if lines else repr(exc)


class Check:
    """Collects rows and prints a progress line as each starts and ends."""

    def __init__(self) -> None:
        self.rows: list[Row] = []

    @contextlib.contextmanager
    def row(self, key: str, name: str):
        r = Row(key, name)
        print(f"[{key}] {name} ...", flush=True)
        t0 = time.perf_counter()
        try:
            yield r
        except SkipRow as e:
            r.status, r.reason = "skipped", str(e)
        except FailRow as e:
            r.status, r.reason = "failed", str(e)
        except Exception as e:  # noqa: BLE001 - one row's failure must not stop the others
            r.status, r.reason = "failed", last_line(e)
        r.time_s += time.perf_counter() - t0  # plus any share of a job run before the row
        self.add(r)

    def add(self, r: Row, *, started: bool = True) -> None:
        """Record ``r``; ``started`` False: a row with no start line of its own (named in its line)."""
        self.rows.append(r)
        said = r.reason or r.detail
        head = "    " if started else f"[{r.key}] "
        print(f"{head}{r.status} ({r.time_s:.1f} s){': ' + said if said else ''}", flush=True)


@dataclass
class Ctx:
    """What every row reads: the mode's sizes, the device, the output directory, the measured peak."""

    sizes: Sizes
    device: torch.device
    out: Path
    dry: bool
    peak_tflops: float | None = None
    step: dict | None = None
    """d.step's measurements (its batch and median step time), for e.predict."""

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def dtype(self) -> torch.dtype:
        """Attention rows: bf16 on CUDA (the fused kernels' dtype), fp32 on CPU."""
        return torch.bfloat16 if self.cuda else torch.float32

    def no_cuda(self, what: str = "") -> str:
        why = "no CUDA" if not torch.cuda.is_available() else "no CUDA (--dry runs on the CPU)"
        return f"{why}{': ' + what if what else ''}"


# ---------------------------------------------------------------------------------------------------------------
# Batches, timing, FLOPs
# ---------------------------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------------------------
# a. the CUDA tests
# ---------------------------------------------------------------------------------------------------------------


def gpu_test_files() -> list[str]:
    """Test modules holding tests marked ``gpu`` (collecting all of tests/ would import Ray in most modules)."""
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py") if "mark.gpu" in p.read_text())


def run_pytest(ctx: Ctx) -> tuple[int | None, str, Path]:
    """``pytest -m gpu`` in its own session (killed whole at the timeout); (exit code or None, output, xml path).
    ``--noconftest``: tests/conftest.py imports Ray at session end, and the GPU tests use none of its fixtures."""
    xml = ctx.out / "pytest-gpu.xml"
    xml.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-rA", "--noconftest", "-p", "no:cacheprovider"]
    cmd += ["-o", "junit_family=xunit1", f"--junitxml={xml}", *gpu_test_files()]
    env = dict(os.environ)
    if ctx.dry:
        env["CUDA_VISIBLE_DEVICES"] = ""  # --dry is CPU only, even on a GPU machine: every CUDA test skips
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = proc.communicate(timeout=ctx.sizes.pytest_timeout_s)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the session we started: pytest and the workers it spawned
        output, _ = proc.communicate()
        code = None
    (ctx.out / "pytest-gpu.log").write_text(output)
    return code, output, xml


def junit_outcomes(xml: Path) -> list[tuple[str, str, str]]:
    """(test id, passed/failed/skipped, message) of every test case in a pytest JUnit XML (xunit1: file attribute)."""
    out = []
    for case in ET.parse(xml).getroot().iter("testcase"):
        file = case.get("file", "")
        module = file.removesuffix(".py").replace("/", ".")
        inner = case.get("classname", "").removeprefix(module).strip(".")
        test_id = "::".join(x for x in (file, *inner.split("."), case.get("name", "")) if x)
        status, message = "passed", ""
        for tag, st in (("failure", "failed"), ("error", "failed"), ("skipped", "skipped")):
            el = case.find(tag)
            if el is not None:
                text = (el.get("message") or el.text or "").strip()
                status, message = st, (text.splitlines() or [""])[0][:300]
                break
        out.append((test_id, status, message))
    return out


def section_tests(check: Check, ctx: Ctx) -> None:
    t0, outcomes = time.perf_counter(), []
    with check.row("a.pytest", "pytest -m gpu (every test marked gpu)") as r:
        code, output, xml = run_pytest(ctx)
        if code is None:
            raise FailRow(
                f"pytest did not finish within {ctx.sizes.pytest_timeout_s:.0f} s ({ctx.out / 'pytest-gpu.log'})"
            )
        if not xml.is_file():
            tail = output.strip().splitlines()[-1:] or ["no output"]
            raise FailRow(f"pytest exited {code} without a JUnit XML: {tail[0]}")
        outcomes = junit_outcomes(xml)
        counts = {s: sum(o[1] == s for o in outcomes) for s in ("passed", "failed", "skipped")}
        r.metrics = {"exit_code": code, **counts}
        r.detail = f"{len(outcomes)} tests: " + ", ".join(f"{n} {s}" for s, n in counts.items()) + f" (exit {code})"
        if ctx.dry:
            r.detail += "; --dry hides CUDA from pytest, so every CUDA test skips"
        if code not in (0, 1, 5):  # 1: some test failed (its row says which); 5: nothing collected
            raise FailRow(f"pytest exited {code}: {r.detail}")
    for test_id, status, message in outcomes:
        if status == "skipped" and not ctx.cuda:
            message = ctx.no_cuda(f"pytest: {message}")
        check.add(Row(f"a.test:{test_id}", test_id, status, message), started=False)
    print(f"    tests listed ({time.perf_counter() - t0:.1f} s)", flush=True)


# ---------------------------------------------------------------------------------------------------------------
# b. attention backends
# ---------------------------------------------------------------------------------------------------------------


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


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max(1, max |want|), in float32."""
    want = want.float()
    return float((got.float() - want).abs().max()) / max(1.0, float(want.abs().max()))


def attention_batch(lengths, ctx: Ctx, seed: int):
    q, k, v, dout, offsets = qkv(lengths, ctx.sizes, ctx.device, ctx.dtype, seed)
    cu = torch.tensor(offsets, dtype=torch.int32, device=ctx.device)
    return q, k, v, dout, cu, max(lengths)


def unavailable(name: str, ctx: Ctx) -> str:
    from flexorch.workers.attention.kernels import DTYPES

    if name in ("flash_attn", "torch_flash") and not ctx.cuda:
        return ctx.no_cuda(f"{name} is a CUDA kernel")
    if ctx.dtype not in DTYPES[name]:
        return f"{name} does not run {str(ctx.dtype).removeprefix('torch.')}"
    if name == "flash_attn":
        return "flash-attn is not installed (pip install flash-attn)"
    if name == "torch_flash":
        return "this torch has no aten::_flash_attention_forward"
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


# ---------------------------------------------------------------------------------------------------------------
# c. SP attention, every rank on the one device
# ---------------------------------------------------------------------------------------------------------------

SP_METHODS = ("ulysses", "ring")
SP_BACKEND = "gloo"  # NCCL refuses two ranks on one GPU; gloo with the tensors on CUDA is what is left


def _probe_collective(method: str, group, rank: int, d: int, device) -> str | None:
    """Run the collective ``method`` uses on a few elements of ``device``; None if the data arrived, else why not."""
    try:
        if method == "ulysses":
            send = torch.arange(d, dtype=torch.float32, device=device) + rank * d
            recv = torch.empty_like(send)
            dist.all_to_all_single(recv, send, group=group)
            want = torch.arange(d, device=device) * d + rank
        else:
            from flexorch.workers.attention.ring import _Ring  # the ring's own hop: host-staged on gloo

            recv = _Ring(group).start(torch.full((4,), float(rank), device=device), tag=0).wait()
            want = torch.full((4,), float((rank - 1) % d), device=device)
        return None if torch.equal(recv.float(), want.float()) else f"wrong data arrived ({recv.tolist()})"
    except Exception as e:  # noqa: BLE001 - reported in the row
        return last_line(e)


def _sp_compare(method: str, group, rank: int, d: int, spec: dict, device) -> dict:
    """This rank's shard of ``method``'s output and q/k/v gradients against single-device attention on the whole
    batch (both in ``spec``'s dtype on ``device``): relative errors, and whether padding got any gradient."""
    from flexorch.workers.attention.api import ulysses_attn_varlen_func, varlen_attn_func, zigzag_ring_attn_varlen_func
    from flexorch.workers.attention.kernels import resolve_backend
    from flexorch.workers.attention.sharding import contiguous_layout, shard, zigzag_layout

    fn, layout_fn = {
        "ulysses": (ulysses_attn_varlen_func, contiguous_layout),
        "ring": (zigzag_ring_attn_varlen_func, zigzag_layout),
    }[method]
    dtype, sizes = getattr(torch, spec["dtype"]), spec["sizes"]
    lengths = [*long_tail(*sizes.sp_tail), *sizes.sp_odd]
    q, k, v, dout, offsets = qkv(lengths, sizes, torch.device("cpu"), torch.float32, seed=7)  # same on every rank
    cu = torch.tensor(offsets, dtype=torch.int32, device=device)
    leaves = [x.to(device, dtype).requires_grad_() for x in (q, k, v)]
    ref_out = varlen_attn_func(*leaves, cu, max(lengths), causal=True)
    ref_out.backward(dout.to(device, dtype))
    ref = [ref_out.detach(), *(x.grad for x in leaves)]
    layout = layout_fn(offsets, rank, d)
    local = [shard(x, layout).to(device, dtype).requires_grad_() for x in (q, k, v)]
    out = fn(*local, layout.cu_seqlens.to(device), layout.max_seqlen, group, causal=True)
    out.backward(shard(dout, layout).to(device, dtype))
    real, idx = layout.loss_mask.to(device), layout.index[layout.loss_mask].to(device)
    got = [out.detach(), *(x.grad for x in local)]
    errors = {n: rel_error(g[real], w[idx]) for n, g, w in zip(("out", "dq", "dk", "dv"), got, ref, strict=True)}
    leak = any(int(torch.count_nonzero(x.grad[~real])) for x in local)
    return {"errors": errors, "padding_grad": leak, "kernel": resolve_backend(None, local[0])}


def _sp_case(store, rank: int, world: int, d: int, epoch: int, method: str, spec: dict, device) -> dict | None:
    """``method`` on ranks ``0..d-1`` of a fresh gloo world of every rank (a broken collective cannot spill into the
    next case); None on the ranks outside the group."""
    from flexorch.workers.process_groups import ProcessGroupRegistry

    try:
        with ProcessGroupRegistry(
            store=store, rank=rank, world_size=world, epoch=epoch, backend=SP_BACKEND, timeout_s=spec["pg_timeout_s"]
        ) as reg:
            reg.ensure([tuple(range(d))])  # a collective over the world: members and the rest alike
            if rank >= d:
                return None
            group = reg.group(range(d))
            why = _probe_collective(method, group, rank, d, device)
            if why is not None:
                op = "all_to_all_single" if method == "ulysses" else "batch_isend_irecv"
                return {"status": "skipped", "reason": f"{SP_BACKEND} cannot {op} {device.type} tensors: {why}"}
            return {"status": "done", **_sp_compare(method, group, rank, d, spec, device)}
    except Exception as e:  # noqa: BLE001 - sent to the parent
        return {"status": "failed", "reason": last_line(e)}


def _sp_rank(rank: int, world: int, port: int, spec: dict, results) -> None:
    """A spawned rank: every (degree, method) case in turn on ``spec['device']``; each result, then 'done', goes to
    the parent as ``(case key, rank, result)``."""
    try:
        torch.set_num_threads(1)
        device = torch.device(spec["device"])
        if device.type == "cuda":
            torch.cuda.set_device(device)
        wait = timedelta(seconds=2 * spec["pg_timeout_s"])  # outlasts a peer stuck in a collective until its timeout
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=wait)
        cases = [(d, m) for d in spec["sizes"].sp_degrees for m in SP_METHODS]
        for epoch, (d, method) in enumerate(cases):
            result = _sp_case(store, rank, world, d, epoch, method, spec, device)
            if result is not None:
                results.put((f"{method}.d{d}", rank, result))
    except BaseException as e:  # noqa: BLE001
        results.put(("*", rank, {"status": "failed", "reason": last_line(e)}))
    finally:
        results.put(("done", rank, None))


def run_sp_job(ctx: Ctx) -> dict[str, dict[int, dict]]:
    """Spawn as many ranks as the largest degree (their store on a free TCP port), run every case, and collect
    ``{case key: {rank: result}}`` within the time limit; what is left is killed. A rank that died or ran out of
    time has its reason under ``"*"``."""
    import torch.multiprocessing as tmp

    mp = tmp.get_context("spawn")
    world = max(ctx.sizes.sp_degrees)
    spec = {
        "device": "cuda:0" if ctx.cuda else "cpu",
        "dtype": "bfloat16",
        "sizes": ctx.sizes,
        "pg_timeout_s": ctx.sizes.job_timeout_s / 4,
    }
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    results = mp.Queue()
    procs = [mp.Process(target=_sp_rank, args=(r, world, store.port, spec, results), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    got: dict[str, dict[int, dict]] = {"*": {}}
    done, deadline = set(), time.monotonic() + ctx.sizes.job_timeout_s
    try:
        while len(done) < world and time.monotonic() < deadline:
            try:
                key, rank, payload = results.get(timeout=1.0)
            except queue.Empty:
                if not any(p.is_alive() for p in procs):
                    break
                continue
            if key == "done":
                done.add(rank)
            else:
                got.setdefault(key, {})[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    for r, p in enumerate(procs):
        if r not in done:
            why = f"exit code {p.exitcode}" if p.exitcode is not None else "killed"
            got["*"].setdefault(r, {"status": "failed", "reason": f"rank {r} did not finish in time ({why})"})
    return got


def sp_verdict(key: str, d: int, got: dict, r: Row, tol: float) -> None:
    """Fill row ``r`` from every member rank's result of case ``key``."""
    per_rank = got.get(key, {})
    for rank in range(d):
        res = per_rank.get(rank) or got["*"].get(rank) or {"status": "failed", "reason": "no result"}
        if res["status"] == "failed":
            raise FailRow(f"rank {rank}: {res['reason']}")
        if res["status"] == "skipped":
            raise SkipRow(res["reason"])
    errors = {n: max(per_rank[k]["errors"][n] for k in range(d)) for n in ("out", "dq", "dk", "dv")}
    leak = any(per_rank[k]["padding_grad"] for k in range(d))
    r.metrics = {"max_rel_err": errors, "padding_grad": leak, "collective": SP_BACKEND}
    kernel = per_rank[0]["kernel"]
    r.detail = f"{SP_BACKEND}, kernel {kernel}; max error vs one device: " + ", ".join(
        f"{n} {e:.1e}" for n, e in errors.items()
    )
    if leak:
        raise FailRow(f"gradient on padding tokens; {r.detail}")
    if max(errors.values()) > tol:
        raise FailRow(f"error above {tol:.0e}: {r.detail}")


def section_sp(check: Check, ctx: Ctx) -> None:
    where, world = ("cuda:0" if ctx.cuda else "CPU"), max(ctx.sizes.sp_degrees)
    print(f"    batch: {[*long_tail(*ctx.sizes.sp_tail), *ctx.sizes.sp_odd]} tokens per document", flush=True)
    print(f"    spawning {world} ranks on {where} ({SP_BACKEND}) for degrees {ctx.sizes.sp_degrees} ...", flush=True)
    t0 = time.perf_counter()
    try:
        got = run_sp_job(ctx)
    except Exception as e:  # noqa: BLE001 - every SP row fails with this
        got = {"*": {0: {"status": "failed", "reason": last_line(e)}}}
    spent = time.perf_counter() - t0
    print(f"    ranks done in {spent:.1f} s", flush=True)
    cases = [(d, m) for d in ctx.sizes.sp_degrees for m in SP_METHODS]
    for d, method in cases:
        with check.row(f"c.{method}.d{d}", f"SP {method} degree {d}, ranks on {where}, bf16") as r:
            r.time_s = spent / len(cases)
            sp_verdict(f"{method}.d{d}", d, got, r, TOLERANCE[torch.bfloat16])


# ---------------------------------------------------------------------------------------------------------------
# d. one training step of a 1B-class model; e. calibration
# ---------------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def one_rank_world(ctx: Ctx):
    """A torch.distributed world of one rank (FSDP2 needs one), with a worker's backend: gloo + NCCL on CUDA."""
    from flexorch.workers.process_groups import ProcessGroupRegistry

    backend = "cpu:gloo,cuda:nccl" if ctx.cuda else "gloo"
    with ProcessGroupRegistry(
        store=dist.HashStore(), rank=0, world_size=1, epoch=0, backend=backend, timeout_s=ctx.sizes.job_timeout_s
    ) as reg:
        yield reg


def train_config(ctx: Ctx):
    """The run the step and the calibration stand for: one worker, fsdp, bf16, full activation checkpointing."""
    from flexorch.config import CorpusConfig, OptimConfig, PlanSettings, ShardingSettings, TrainConfig

    tpw = ctx.sizes.tokens_per_worker
    return TrainConfig(
        workers=1,
        use_gpu=ctx.cuda,
        run_dir=str(ctx.out),
        model=ctx.sizes.model,
        optim=OptimConfig(lr=1e-4, warmup_steps=1),
        data=CorpusConfig(max_context=tpw),
        plan=PlanSettings(tokens_per_worker=tpw),
        sharding=ShardingSettings(mode="fsdp", precision="bf16", activation_checkpointing="full"),
    )


def sharded_model(ctx: Ctx, cfg):
    """The decoder as a sharded worker builds it (``flexorch.workers.actor.Worker._build_sharded`` / ``_reshard``)."""
    from flexorch.workers.fsdp import build_mesh, fill_initial, sharded_decoder

    mesh = build_mesh("fsdp", 1, None, ctx.device.type)
    model = sharded_decoder(
        cfg.model, mesh, precision="bf16", recompute="full", device=ctx.device if ctx.cuda else None
    )
    fill_initial(model, cfg.model, cfg.seed)
    return model


def step_task(step: int, lengths: list[int], vocab: int):
    """A one-rank StepTask of one micro-batch holding ``lengths`` (one block of random tokens) and its blocks."""
    from flexorch.tasks.step import DocRef, GroupWork, StepTask

    tokens = np.random.default_rng(step).integers(0, vocab, sum(lengths)).astype(np.int32)
    offsets = offsets_of(lengths)
    docs = tuple(DocRef(i, 0, offsets[i], n) for i, n in enumerate(lengths))
    work = (GroupWork(0, (0,), "ulysses", docs),)
    task = StepTask(step, 0, 1, (), work, sum(n - 1 for n in lengths), micro_batches=1)
    return task, {0: tokens}


def train_steps(ctx: Ctx) -> dict:
    """Warm-up then timed steps through ``run_sharded_step``, as ``Worker._run_step`` calls it on a world of one;
    the planner's prediction of this micro-batch's memory from the same measurements calibration makes."""
    from flexorch.control.calibration import model_state_plan
    from flexorch.workers.calibrate import activation_bytes_per_token
    from flexorch.workers.optim import build_optimizer
    from flexorch.workers.sharded_step import run_sharded_step

    cfg, sz = train_config(ctx), ctx.sizes
    lengths = long_tail(*sz.step_tail)
    tokens = sum(lengths)
    with one_rank_world(ctx) as reg:
        model = sharded_model(ctx, cfg)
        optimizer, scheduler = build_optimizer(model, cfg.optim, foreach=True)
        act_per_token = activation_bytes_per_token(model, cfg.model.vocab_size)
        step_s, losses, outcome = [], [], None
        for step in range(1 + sz.reps):
            task, blocks = step_task(step, lengths, cfg.model.vocab_size)
            if step == 1 and ctx.cuda:
                torch.cuda.reset_peak_memory_stats(ctx.device)
            sync(ctx.device)
            t0 = time.perf_counter()
            outcome = run_sharded_step(
                model, optimizer, scheduler, task, blocks, reg.group, None, cfg.optim, vocab_size=cfg.model.vocab_size
            )
            sync(ctx.device)
            step_s.append(time.perf_counter() - t0)
            losses.append(outcome.loss)
            print(f"    step {step}: {step_s[-1]:.2f} s, loss {outcome.loss:.4f}", flush=True)
        peak = torch.cuda.max_memory_allocated(ctx.device) if ctx.cuda else None
    state = model_state_plan(cfg, 1)
    return {
        "params": cfg.model.num_params(),
        "tokens": tokens,
        "lengths": lengths,
        "step_s": statistics.median(step_s[1:]),
        "losses": losses,
        "saved_bytes": outcome.peak_activation_bytes,
        "act_bytes_per_token": act_per_token,
        "state_bytes": state.total,
        "predicted_bytes": state.total + tokens * act_per_token,
        "peak_bytes": peak,
    }


def step_flops(res: dict, cfg: ModelConfig) -> float:
    """6 N T (forward 2 N T + backward 4 N T per token, N = every parameter; Kaplan et al., arXiv 2001.08361, Sec.
    2.1; PaLM's MFU, arXiv 2204.02311, App. B) plus causal attention's forward and backward in every layer. The
    recomputation of activation checkpointing is not counted: MFU counts the model's FLOPs, not the hardware's."""
    attn = (1 + BWD_OVER_FWD) * attn_fwd_flops(res["lengths"], cfg.num_heads, cfg.head_dim) * cfg.num_layers
    return 6.0 * res["params"] * res["tokens"] + attn


def section_step(check: Check, ctx: Ctx) -> None:
    cfg, res = ctx.sizes.model, None
    n = cfg.num_params()
    size = f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"
    name = f"train step: {size} params, FSDP2 world of 1, bf16, full activation checkpointing"
    with check.row("d.step", name) as r:
        res = train_steps(ctx)
        tok_s = res["tokens"] / res["step_s"]
        mfu = step_flops(res, cfg) / res["step_s"] / 1e12 / ctx.peak_tflops if ctx.peak_tflops else None
        r.metrics = {k: v for k, v in res.items() if k != "lengths"} | {"tokens_per_s": tok_s, "mfu": mfu}
        r.detail = (
            f"{res['params']:,} params, {res['tokens']:,} tokens ({len(res['lengths'])} docs, longest "
            f"{max(res['lengths']):,}): {res['step_s']:.2f} s/step, {tok_s:,.0f} tokens/s, MFU "
            + (f"{100 * mfu:.1f} %" if mfu is not None else "n/a (no peak)")
            + f"; loss {res['losses'][0]:.3f} -> {res['losses'][-1]:.3f}; saved for backward "
            f"{res['saved_bytes'] / 2**20:,.1f} MiB (plan {res['tokens'] * res['act_bytes_per_token'] / 2**20:,.1f})"
        )
        if not all(math.isfinite(x) for x in res["losses"]):
            raise FailRow(f"loss not finite: {res['losses']}")
        ctx.step = res
    with check.row("d.memory", "peak memory (torch.cuda.max_memory_allocated) vs the planner's prediction") as r:
        if not ctx.cuda:
            raise SkipRow(ctx.no_cuda("the allocator's peak is measured on CUDA"))
        if res is None:
            raise FailRow("the training step failed")
        ratio = res["peak_bytes"] / res["predicted_bytes"]
        r.metrics = {"peak_bytes": res["peak_bytes"], "predicted_bytes": res["predicted_bytes"], "ratio": ratio}
        r.detail = (
            f"peak {res['peak_bytes'] / 2**30:.2f} GiB vs predicted {res['predicted_bytes'] / 2**30:.2f} GiB "
            f"(model state {res['state_bytes'] / 2**30:.2f} + {res['tokens']:,} tokens x "
            f"{res['act_bytes_per_token'] / 1e3:,.1f} kB): {ratio:.2f}x"
        )
        if ratio > MEMORY_SLACK:
            raise FailRow(f"more than {MEMORY_SLACK}x the prediction: {r.detail}")
    gc.collect()  # the model's FSDP hooks hold reference cycles: free its memory before the calibration builds one
    if ctx.cuda:
        torch.cuda.empty_cache()


class LocalGroup:
    """The worker group ``flexorch.control.calibration.calibrate`` drives (``size``, ``call``): one worker in this
    process, running what ``flexorch.workers.actor.Worker.probe`` and ``.activation_bytes_per_token`` run."""

    size = 1

    def __init__(self, model, reg, vocab_size: int) -> None:
        self.model, self.reg, self.vocab_size = model, reg, vocab_size

    def call(self, method: str, *args):
        from flexorch.workers.calibrate import activation_bytes_per_token, run_probes

        if method == "activation_bytes_per_token":
            return [activation_bytes_per_token(self.model, self.vocab_size)]
        if method != "probe":
            raise ValueError(f"LocalGroup has no method {method!r}")

        return [run_probes(self.model, args[0], 0, 1, self.reg.group, None, self.vocab_size, every_rank=True)]


def section_calibration(check: Check, ctx: Ctx) -> None:
    planned = None  # the calibrated profile as the planner uses it, for e.predict
    with check.row("e.profile", f"calibration -> {ctx.out / 'profile.json'}, loaded back") as r:
        from flexorch.control.calibration import calibrate, fitted_profile  # inside the row: a failed import is a row
        from flexorch.solver.profiles import get_profile

        cfg = train_config(ctx)
        with one_rank_world(ctx) as reg:
            group = LocalGroup(sharded_model(ctx, cfg), reg, cfg.model.vocab_size)
            profile, report = calibrate(
                group, cfg, repeats=ctx.sizes.cal_repeats, publish=lambda e: print(f"    {e['message']}", flush=True)
            )
        path = ctx.out / "profile.json"
        path.write_text(profile.to_json())
        (ctx.out / "calibration.json").write_text(json.dumps(report, indent=1))
        loaded = get_profile(str(path))
        if loaded != profile:
            raise FailRow(f"{path} loads as a different profile")
        planned = fitted_profile(loaded, cfg)
        keys = ("a1_ms", "a2_ms", "b1_ms", "act_bytes_per_token", "model_state_bytes", "memory_budget_bytes")
        r.metrics = {k: getattr(loaded, k) for k in keys} | {
            "tokens_per_device": planned.tokens_per_device,
            "median_rel_error": report["median_rel_error"],
            "max_rel_error": report["max_rel_error"],
        }
        r.detail = (
            f"a1 {loaded.a1_ms:.3g} ms/tok^2, a2 {loaded.a2_ms:.3g} ms/tok, b1 {loaded.b1_ms:.3g} ms, "
            f"{loaded.act_bytes_per_token:,.0f} B/token, model state {loaded.model_state_bytes / 2**30:.2f} GiB; "
            f"planner: {planned.tokens_per_device:,} tokens/device; fit error median "
            f"{100 * report['median_rel_error']:.1f} %, max {100 * report['max_rel_error']:.1f} %"
        )
        bad = [k for k in keys if not (math.isfinite(getattr(loaded, k)) and getattr(loaded, k) >= 0)]
        if bad or loaded.act_bytes_per_token <= 0:
            raise FailRow(f"profile constants not usable: {bad or 'act_bytes_per_token'}; {r.detail}")
    with check.row("e.predict", "the calibrated planner's time for d.step's batch vs the measured step") as r:
        from flexorch.solver.cost_model import group_time_ms

        if ctx.step is None:
            raise SkipRow("d.step did not run or failed")
        if planned is None:
            raise FailRow("no calibrated profile (e.profile failed)")
        predicted = group_time_ms(ctx.step["lengths"], 1, "ulysses", planned)  # one worker: one group of degree 1
        measured = 1e3 * ctx.step["step_s"]
        err = abs(predicted - measured) / measured
        r.metrics = {"predicted_ms": predicted, "measured_ms": measured, "rel_error": err}
        r.detail = (
            f"{len(ctx.step['lengths'])} documents, {ctx.step['tokens']:,} tokens: predicted {predicted:,.1f} ms, "
            f"measured {measured:,.1f} ms (median of {ctx.sizes.reps}): error {100 * err:.1f} %"
        )
        if ctx.dry:
            r.detail += " (not judged in --dry: a tiny model on shared CPU cores)"
        elif err > PREDICT_SLACK:
            raise FailRow(f"off by more than {100 * PREDICT_SLACK:.0f} %: {r.detail}")


# ---------------------------------------------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------------------------------------------

NOTES = [
    "attention FLOPs: forward 4 * sum(L^2)/2 * h * hd over the documents L (causal half; FlashAttention-2, "
    "arXiv 2307.08691, Sec. 4.1), backward 2.5x the forward; TFLOP/s = FLOPs / the median time of each pass",
    "peak: the median rate of an n^3 matmul (2 n^3 FLOPs), bf16 on CUDA, fp32 on CPU; % of peak against it",
    "errors: max |x - ref| / max(1, max |ref|) over out, dq, dk, dv; bf16 within 2e-2, fp32 within 1e-4",
    "MFU: (6 * params * tokens + layers * 3.5 * attention forward FLOPs) / step time / peak (recomputation not "
    "counted)",
    "predicted memory: the planner's model state (flexorch.solver.model_state, fsdp on 1 worker, bf16 gathers) + "
    "tokens x activation bytes per token as calibration measures them (flexorch.workers.calibrate); "
    f"d.memory fails above {MEMORY_SLACK}x",
    "SP rows: every rank in its own process on the one device, a gloo world per method; a collective gloo cannot "
    "run on the device's tensors is a skipped row with gloo's error",
]


def environment(ctx: Ctx) -> dict:
    from flexorch.workers.attention.flash import flash_attn_module

    env = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "device": torch.cuda.get_device_name(ctx.device) if ctx.cuda else platform.processor() or "cpu",
        "flash_attn": flash_attn_module() is not None,
        "ray_imported": "ray" in sys.modules,
    }
    return env


def markdown(rows: list[Row], header: str) -> str:
    lines = [header, "", "| row | status | s | result |", "|---|---|---:|---|"]
    for r in rows:
        text = (f"{r.reason}" if r.status != "passed" else r.detail).replace("|", "/")
        lines.append(f"| {r.name} | {r.status} | {r.time_s:.1f} | {text} |")
    return "\n".join(lines)


def write_table(check: Check, ctx: Ctx, wall_s: float) -> int:
    counts = {s: sum(r.status == s for r in check.rows) for s in ("passed", "failed", "skipped")}
    env = environment(ctx)
    header = (
        f"gpu_check {'--dry ' if ctx.dry else ''}on {env['device']} (torch {env['torch']}, CUDA {env['cuda']}, "
        f"flash-attn {'yes' if env['flash_attn'] else 'no'}): {wall_s:.0f} s, "
        + ", ".join(f"{n} {s}" for s, n in counts.items())
    )
    table = markdown(check.rows, header)
    notes = "\n".join(f"- {n}" for n in NOTES)
    print("\n" + table + "\n\n" + notes, flush=True)
    (ctx.out / "table.md").write_text(table + "\n\n" + notes + "\n")
    data = {
        "mode": "dry" if ctx.dry else "full",
        "wall_s": wall_s,
        "environment": env,
        "counts": counts,
        "rows": [asdict(r) for r in check.rows],
        "notes": NOTES,
    }
    (ctx.out / "table.json").write_text(json.dumps(data, indent=1, default=str))
    print(f"\nwritten: {ctx.out / 'table.md'}, {ctx.out / 'table.json'}", flush=True)
    return 1 if counts["failed"] else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry", action="store_true", help="every row on the CPU with tiny sizes (CUDA rows skipped)")
    ap.add_argument("--out", type=Path, default=Path("runs/gpu_check"), help="where the table and profile go")
    ap.add_argument("--only", default="abcde", help="the sections to run, e.g. 'bd' (default: all)")
    args = ap.parse_args(argv)
    if not args.dry and not torch.cuda.is_available():
        print("no CUDA device here: run with --dry for the CPU check", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cpu") if args.dry else torch.device("cuda", 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    ctx = Ctx(DRY if args.dry else FULL, device, args.out, args.dry)
    check, t0 = Check(), time.perf_counter()
    sections = {
        "a": section_tests,
        "b": section_attention,
        "c": section_sp,
        "d": section_step,
        "e": section_calibration,
    }
    for letter, run in sections.items():
        if letter in args.only:
            print(
                f"== {letter}. {run.__name__.removeprefix('section_')} ({time.perf_counter() - t0:.0f} s)", flush=True
            )
            run(check, ctx)
    return write_table(check, ctx, time.perf_counter() - t0)


if __name__ == "__main__":
    sys.exit(main())
