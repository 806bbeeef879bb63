"""d. one training step of a 1B-class model: FSDP2 on a world of one, bf16, full activation checkpointing, through
``flexorch.workers.sharded_step.run_sharded_step``: tokens/s and MFU (row ``d.step``), the allocator's peak against
the planner's prediction (row ``d.memory``)."""

from __future__ import annotations

import gc
import math
import statistics
import time

import numpy as np
import torch

from flexorch.config.model import ModelConfig

from .check import Check, Ctx, FailRow, SkipRow
from .measure import BWD_OVER_FWD, attn_fwd_flops, long_tail, offsets_of, sync
from .one_worker import one_rank_world, sharded_model, train_config
from .sizes import MEMORY_SLACK

__all__ = ["section_step", "step_flops", "step_task", "train_steps"]


def step_task(step: int, lengths: list[int], vocab: int):
    """A one-rank StepWork of one micro-batch holding ``lengths`` (one block of random tokens) and its blocks."""
    from flexorch.work.step import DocRef, GroupWork, StepWork

    tokens = np.random.default_rng(step).integers(0, vocab, sum(lengths)).astype(np.int32)
    offsets = offsets_of(lengths)
    docs = tuple(DocRef(i, 0, offsets[i], n) for i, n in enumerate(lengths))
    work = (GroupWork(0, (0,), "ulysses", docs),)
    task = StepWork(step, 0, 1, (), work, sum(n - 1 for n in lengths), micro_batches=1)
    return task, {0: tokens}


def train_steps(ctx: Ctx) -> dict:
    """Warm-up then timed steps through ``run_sharded_step``, as ``Worker._run_step`` calls it on a world of one;
    the planner's prediction of this micro-batch's memory from the same measurements calibration makes."""
    from flexorch.control.calibration import model_state_plan
    from flexorch.workers.calibrate import activation_bytes_per_token
    from flexorch.workers.optim import build_optimizer
    from flexorch.workers.sharded_step import run_sharded_step
    from flexorch.workers.step_context import StepContext

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
            step_ctx = StepContext(model, optimizer, scheduler, reg.group, None, cfg.optim, cfg.model.vocab_size)
            outcome = run_sharded_step(step_ctx, task, blocks)
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
