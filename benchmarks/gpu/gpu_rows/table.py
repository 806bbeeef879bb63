"""The table: printed, and written with the environment and every row's numbers to ``<out>/table.md`` and
``<out>/table.json``; its exit code is 1 when any row failed."""

from __future__ import annotations

import json
import platform
import sys
from dataclasses import asdict

import torch

from .check import Check, Ctx, Row
from .sizes import MEMORY_SLACK

__all__ = ["NOTES", "environment", "markdown", "write_table"]

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
