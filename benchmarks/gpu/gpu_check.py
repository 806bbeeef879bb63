"""One command for a lent GPU machine: the CUDA tests, the attention kernels, SP attention on one GPU, a 1B-class
training step and a GPU calibration, in one table.

    python3 -m benchmarks.gpu.gpu_check               # one H100: under 8 minutes
    python3 -m benchmarks.gpu.gpu_check --dry         # the same code paths on CPU with tiny sizes (under a minute)
    python3 -m benchmarks.gpu.gpu_check --out DIR     # table.json, table.md, profile.json, ... (default runs/gpu_check)

Torch only: nothing this script imports pulls in Ray (the GPU machine has none); run as a module from the
repository root, it imports ``flexorch`` from the checkout without ``pip install -e .``. The rows live in
``benchmarks/gpu/gpu_rows/``, one module per row or group of rows (its docstring says what each measures):

a. every test marked ``gpu`` (``gpu_rows.gpu_tests``);
b. the matmul peak and each attention backend's time, TFLOP/s and error against ``math`` (``gpu_rows.attention``);
c. Ulysses and zigzag ring attention at degrees 2 and 4, every rank on the one device (``gpu_rows.sp_attention``);
d. one FSDP2 training step of a 1.1B decoder: tokens/s, MFU, peak memory vs the planner (``gpu_rows.train_step``);
e. a calibration written as ``<out>/profile.json`` and loaded back, then the planner's time for d's batch from it
   against d's measured step (``gpu_rows.calibration``).

Every row is passed, failed or skipped with its reason; a failing row never stops the others, and the exit code is
1 when any row failed. ``--dry`` runs every row on the CPU (CUDA-only rows skipped with "no CUDA").
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import gpu_results_path, run_main
from benchmarks.gpu.gpu_rows.attention import section_attention
from benchmarks.gpu.gpu_rows.calibration import section_calibration
from benchmarks.gpu.gpu_rows.check import Check, Ctx, FailRow, Row, SkipRow
from benchmarks.gpu.gpu_rows.gpu_tests import junit_outcomes, section_tests
from benchmarks.gpu.gpu_rows.measure import attn_fwd_flops, long_tail
from benchmarks.gpu.gpu_rows.sizes import DRY, FULL
from benchmarks.gpu.gpu_rows.sp_attention import section_sp
from benchmarks.gpu.gpu_rows.table import write_table
from benchmarks.gpu.gpu_rows.train_step import section_step

__all__ = [
    "Check",
    "Ctx",
    "DRY",
    "FULL",
    "FailRow",
    "Row",
    "SkipRow",
    "attn_fwd_flops",
    "junit_outcomes",
    "long_tail",
    "main",
]


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
    raise SystemExit(run_main(main, "gpu/gpu_check", gpu_results_path("gpu/gpu_check")))
