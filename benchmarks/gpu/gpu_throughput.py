"""`flexorch train` through Ray against a plain Transformers loop on the same documents, on a lent GPU.

    bash .gpu/setup.sh && export PYTHONPATH=/tmp/site:$PWD     # on the GPU machine (../shared/tools/gpu-pack)
    python3 -m benchmarks.gpu.gpu_throughput                        # 1.1B Llama at 16K context, 10 steps: ~4 minutes
    python3 -m benchmarks.gpu.gpu_throughput --rows 1.1b@16384,1.1b@65536,3b@16384
    python3 -m benchmarks.gpu.gpu_throughput --rows 1.1b@16384,1.1b@65536 --steps 6 --budget-s 520   # one device call
    python3 -m benchmarks.gpu.gpu_throughput --dry                  # CPU, a tiny Llama, 3 steps: the same code paths

Each row is a Llama shape from a ``config.json`` (random init) and a ``max_context``:

* **flexorch**: ``flexorch train`` in a subprocess, a local Ray, one GPU worker, ``[sharding] fsdp`` bf16, the
  standard library's sources as documents with the byte tokenizer, ``batch_size`` 16, ``[model] compile`` and
  ``attention`` at their defaults (compiled layers, the measured kernel), ``activation_checkpointing`` and
  ``tokens_per_worker`` 'auto' unless given (``--recompute``, ``--tokens-per-worker``: the budget read from the
  device, recompute only where memory needs it), AdamW at lr 3e-4. Figures from its ``steps.jsonl``, steps 2 to N;
  the device budget from its start-up line; every step that ran out of memory (a recovery with ``out_of_memory``)
  is counted.
* **plain**: the same documents (each step's ``doc_ids`` from the run's corpus store) from the same initial weights,
  one document per forward through Transformers' ``...ForCausalLM`` with ``sdpa`` attention, bf16 autocast over
  fp32 weights, gradient checkpointing (``--plain-recompute``), fused AdamW with the run's hyperparameters, schedule
  and clipping: the loop a user writes first. Its losses are the run's, up to bf16 rounding ("loss gap").

MFU = (6 x parameters x tokens + causal attention: 3.5 x 4 x sum(L^2)/2 x heads x head_dim x layers) / time / the
datasheet's dense bf16 peak (989 TFLOP/s for an H100 or H200 SXM); the matmul rate measured in the same run is
printed beside it. Output: a table, and ``<out>/gpu_throughput.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import ROOT, gpu_results_path, matmul_tflops, run_main  # noqa: E402

SHAPES = {
    "1.1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                 num_key_value_heads=4, vocab_size=32000, use_cache=False),
    "3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
               num_key_value_heads=8, vocab_size=128256),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512),
}  # fmt: skip
"""TinyLlama-1.1B's shape; Llama-3.2-3B's (untied here); a tiny one for --dry."""
PEAK_TFLOPS = 989.0
"""Dense bf16 peak of an H100/H200 SXM (NVIDIA's datasheets)."""


def write_model(directory: Path, shape: str, context: int) -> None:
    import transformers

    transformers.LlamaConfig(**SHAPES[shape], max_position_embeddings=max(context, 2048)).save_pretrained(directory)


def write_config(path: Path, model_dir: Path, run_dir: Path, args, context: int) -> None:
    gpu = not args.dry
    tokens = '"auto"' if args.tokens_per_worker == "auto" else max(int(args.tokens_per_worker), context)
    path.write_text(
        f"""steps = {args.steps}
workers = 1
batch_size = {args.batch_size}
use_gpu = {"true" if gpu else "false"}
worker_threads = {8 if gpu else 1}
run_dir = "{run_dir}"
checkpoint_every = 0

[model]
hf = "{model_dir}"

[data]
tokenizer = "byte"
max_context = {context}

[optim]
lr = 3e-4

[sharding]
mode = "fsdp"
precision = "{"bf16" if gpu else "fp32"}"
activation_checkpointing = "{args.recompute}"

[plan]
tokens_per_worker = {tokens}
"""
    )


def run_flexorch(cfg: Path, run_dir: Path, log: Path, timeout_s: float, steps: int) -> dict:
    """``flexorch train --config cfg``; its trained steps' records and its output. A run stopped at ``timeout_s``
    after all its steps trained (in its final checkpoint: a 1.1B model's 17 GiB of state) still counts, and says so."""
    cmd = [sys.executable, "-c", "import sys; from flexorch.cli.main import main; sys.exit(main())", "train"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    t0 = time.perf_counter()
    stopped = None
    with log.open("w") as f:
        try:
            proc = subprocess.run([*cmd, "--config", str(cfg)], stdout=f, stderr=subprocess.STDOUT, env=env,
                                  timeout=timeout_s, check=False)  # fmt: skip
            code = proc.returncode
        except subprocess.TimeoutExpired:
            code, stopped = None, f"stopped at --timeout-s {timeout_s:.0f} s after its last step (in its final save)"
    wall = time.perf_counter() - t0
    text = log.read_text()
    path = run_dir / "steps.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    trained = [s for s in records if s.get("source") == "train" and not s.get("skipped")]
    finished = code == 0 and "done:" in text
    if not trained or not (finished or (stopped and len(trained) >= steps)):
        why = f"exit {code}" if code is not None else f"killed at --timeout-s {timeout_s:.0f} s"
        raise RuntimeError(f"flexorch train failed ({why}); the end of its output:\n{text[-3000:]}")
    return {"wall_s": wall, "steps": trained, "log": text, "stopped": stopped}


def summarise_flexorch(res: dict, params: int, shape: dict) -> dict:
    kept = res["steps"][1:] or res["steps"]  # step 1 pays compilation and warm-up
    tokens = sum(sum(s["seq_lengths"]) for s in kept)
    seconds = sum(s["measured_ms"] for s in kept) / 1e3
    rank = [s["ranks"][0] for s in kept if s.get("ranks") and s["ranks"][0]]
    peak_act = max((r.get("peak_activation_bytes") or 0) for r in rank) if rank else 0
    state = max((r.get("state_bytes") or 0) for r in rank) if rank else 0
    mbs = [len(s["plan"]["micro_batches"]) for s in kept if s.get("plan")]
    return {
        "tokens_per_s": tokens / seconds,
        "tflops": step_flops(kept, params, shape) / seconds / 1e12,
        "micro_batches": f"{min(mbs)}-{max(mbs)}" if mbs else "?",
        "peak_activation_gib": peak_act / 2**30,
        "state_gib": state / 2**30,
        "first_step_s": res["steps"][0]["measured_ms"] / 1e3,
        "losses": [round(s["loss"], 4) for s in res["steps"]],
        "out_of_memory_steps": sum(
            any("out_of_memory" in rec for rec in s.get("recoveries") or []) for s in res["steps"]
        ),
        "budget": next((ln for ln in res["log"].splitlines() if "memory budget from the device" in ln), None),
        "recompute_groups": {  # groups of steps 2-N by the mode they ran in ('auto' recompute)
            mode: sum(m == mode for s in kept for row in s.get("recompute") or [] for m in row)
            for mode in ("none", "selective", "full")
        },
        "packings": {  # steps of steps 2-N by the bytes the planner packed them for
            mode: sum((s.get("recompute_packing") or {}).get("packing") == mode for s in kept)
            for mode in ("full", "none", "selective")
        },
        "recompute_measured": next((ln for ln in res["log"].splitlines() if "recompute 'auto'" in ln), None),
        "attention": attention_line(res["log"]),
        "calibration": next((ln for ln in res["log"].splitlines() if ln.startswith("profile: calibrated")), None),
        "used_of_free_pct": used_of_free(res["log"], state + peak_act),
        "wall_s": res["wall_s"],
        "stopped": res["stopped"],
    }


def attention_line(log: str) -> str | None:
    """The worker's line on the attention kernel it chose (with the times it measured, where it measured)."""
    lines = [ln[ln.index("attention kernel") :] for ln in log.splitlines() if "attention kernel" in ln]
    return next((ln for ln in lines if "measured" in ln), lines[-1] if lines else None)


def used_of_free(log: str, used_bytes: float) -> float | None:
    """Peak bytes the worker held (model state + activations) over the device's free memory at start (from the
    budget line of ``tokens_per_worker = "auto"``), in per cent; None without that line."""
    import re

    m = re.search(r"memory budget from the device: ([0-9.]+) GiB free", log)
    return 100 * used_bytes / (float(m.group(1)) * 2**30) if m else None


def step_flops(steps: list[dict], params: int, shape: dict) -> float:
    heads, layers = shape["num_attention_heads"], shape["num_hidden_layers"]
    head_dim = shape["hidden_size"] // heads
    total = 0.0
    for s in steps:
        lengths = s["seq_lengths"]
        attn_fwd = 4.0 * sum(float(n) * n for n in lengths) / 2 * heads * head_dim
        total += 6.0 * params * sum(lengths) + 3.5 * attn_fwd * layers
    return total


def same_training(run_toml: Path, steps: list[dict]) -> tuple:
    """What the plain loop needs to train what the flexorch run trained: the run's config, each step's documents
    (the corpus store the run prepared, opened as it is; ``doc_ids`` of each step's record) and its initial weights
    (``build_model``: the same (model, seed) gives the same values anywhere)."""
    from flexorch.config.load import load_train_config
    from flexorch.data.corpus import load_corpus

    cfg = load_train_config(run_toml)
    corpus = load_corpus(cfg.data)
    return cfg, [corpus.get_tokens(s["doc_ids"]) for s in steps]


def plain_model(cfg, model_dir: Path, device: torch.device, recompute: bool):
    """Transformers' ``...ForCausalLM``, ``sdpa`` attention, flexorch's initial weights, fp32 on ``device``."""
    import transformers

    from flexorch.workers.model_source import build_model

    config = transformers.AutoConfig.from_pretrained(model_dir)
    config._attn_implementation = "sdpa"
    model = transformers.AutoModelForCausalLM.from_config(config)
    init = build_model(cfg.model, cfg.seed)
    missing, unexpected = model.load_state_dict(init.state_dict(), strict=False)
    tied = {"lm_head.weight"} if cfg.model.tie_embeddings else set()
    if unexpected or set(missing) - tied:
        raise RuntimeError(f"flexorch's weights do not fit Transformers' model: missing {missing}, extra {unexpected}")
    del init
    if recompute:
        if hasattr(model, "activation_checkpointing_enable"):  # Transformers 5.24's name; 5.17 has the older one
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.to(device).train()


def plain_loop(model, optim, docs: list[list], device: torch.device) -> dict:
    """The plain Transformers loop on ``docs`` (each step's documents, token arrays), one document per forward,
    bf16 autocast over fp32 weights; AdamW (fused on a GPU) with the run's hyperparameters, schedule and clipping.
    Seconds per step after the first, and every step's loss (sum of token losses / predicted tokens, as flexorch)."""
    import functools

    from flexorch.workers.optim import lr_factor

    cuda = device.type == "cuda"
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": optim.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]  # fmt: skip
    opt = torch.optim.AdamW(groups, lr=optim.lr, betas=optim.betas, eps=optim.eps, fused=cuda)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, functools.partial(lr_factor, cfg=optim))
    times, losses = [], []
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    for step_docs in docs:
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        n_pred = sum(len(d) - 1 for d in step_docs)
        total = 0.0
        for doc in step_docs:
            if len(doc) < 2:
                continue
            ids = torch.as_tensor(doc, dtype=torch.int64).view(1, -1).to(device)  # (1, n)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
                loss = model(input_ids=ids, labels=ids).loss * (len(doc) - 1) / n_pred
            loss.backward()
            total += float(loss.detach())
        if optim.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(params, optim.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
        losses.append(total)
    kept = times[1:] or times
    tokens = sum(sum(len(d) for d in s) for s in docs[1:] or docs)
    return {
        "tokens_per_s": tokens / sum(kept),
        "seconds": sum(kept),
        "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
        "losses": [round(x, 4) for x in losses],
    }


def loss_gap(flexorch_losses: list[float], plain_losses: list[float]) -> float:
    """Largest relative difference of the two loops' losses, step by step (the same documents and weights)."""
    return max(abs(a - b) / abs(b) for a, b in zip(flexorch_losses, plain_losses, strict=False))


def compare_plain(steps: list[dict], tmp: Path, device: torch.device, args, r: dict) -> dict:
    """The plain loop on the run's ``steps``: its figures, its ratio to the run and the largest loss difference;
    or ``plain_failed`` when it runs out of memory (its full logits at long context), the run's figures standing."""
    cfg, docs = same_training(tmp / "run.toml", steps)
    model = None
    try:
        model = plain_model(cfg, tmp / "model", device, args.plain_recompute)
        plain = plain_loop(model, cfg.optim, docs, device)
    except torch.OutOfMemoryError as e:
        return {"plain_failed": f"out of memory: {str(e)[:200]}"}
    finally:
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    shape = SHAPES[r["row"].partition("@")[0]]
    plain["tflops"] = step_flops(steps[1:] or steps, r["params"], shape) / plain["seconds"] / 1e12
    return {
        "plain": plain,
        "ratio": r["flexorch"]["tokens_per_s"] / plain["tokens_per_s"],
        "loss_gap": loss_gap(r["flexorch"]["losses"], plain["losses"]),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1.1b@16384", help="comma-separated SHAPE@CONTEXT (shapes: 1.1b, 3b)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--recompute", default="auto", help="flexorch's [sharding] activation_checkpointing")
    ap.add_argument("--tokens-per-worker", default="auto", help="[plan] tokens_per_worker: 'auto' or a number")
    ap.add_argument("--plain-recompute", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--no-plain", action="store_true", help="skip the plain loop")
    ap.add_argument("--timeout-s", type=float, default=420.0, help="per flexorch run")
    ap.add_argument("--plain-steps", type=int, default=None, help="steps of the plain loop (default: all)")
    ap.add_argument(
        "--budget-s", type=float, default=None,
        help="wall seconds for everything: a row after the first is skipped (and said so) when the time left is below "
        "what the last row took, so one device call returns with what it measured",
    )  # fmt: skip
    ap.add_argument("--out", default="runs/gpu_throughput")
    ap.add_argument("--dry", action="store_true", help="CPU, a tiny Llama, 3 steps")
    args = ap.parse_args(argv)
    if args.dry:
        rows = args.rows if all(r.startswith("tiny@") for r in args.rows.split(",")) else "tiny@256"
        args.rows, args.steps, args.batch_size, args.tokens_per_worker = rows, 3, 4, "512"
    device = torch.device("cuda" if torch.cuda.is_available() and not args.dry else "cpu")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    peak = matmul_tflops(device)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"gpu_throughput on {gpu}" + (f": bf16 matmul measured {peak:.0f} TFLOP/s" if peak else ""), flush=True)
    results = []
    started, row_s = time.monotonic(), None
    for row in args.rows.split(","):
        left = None if args.budget_s is None else args.budget_s - (time.monotonic() - started)
        if left is not None and row_s is not None and left < row_s:
            results.append({"row": row, "params": 0, "failed": f"skipped: {left:.0f} s left of --budget-s, a row "
                            f"took {row_s:.0f} s"})  # fmt: skip
            print(f"{row} skipped ({left:.0f} s left)", flush=True)
            continue
        row_t0 = time.monotonic()
        shape_name, _, ctx = row.partition("@")
        context = int(ctx)
        shape = SHAPES[shape_name]
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            write_model(tmp / "model", shape_name, context)
            write_config(tmp / "run.toml", tmp / "model", tmp / "run", args, context)
            from flexorch.config.hf import hf_model_config
            from flexorch.config.model import ModelConfig

            model = ModelConfig.from_dict(hf_model_config(str(tmp / "model")))
            params = model.active_params()  # what a token computes with (an MoE model: its routed experts only)
            r = {"row": row, "params": params}
            try:
                res = run_flexorch(tmp / "run.toml", tmp / "run", out / f"flexorch_{shape_name}_{context}.log",
                                   args.timeout_s, args.steps)  # fmt: skip
                r["flexorch"] = summarise_flexorch(res, params, shape)
                r["flexorch"]["mfu_pct"] = 100 * r["flexorch"]["tflops"] / PEAK_TFLOPS
                print(f"{row} flexorch: {json.dumps(r['flexorch'])}", flush=True)
                if not args.no_plain:
                    r.update(compare_plain(res["steps"][: args.plain_steps or None], tmp, device, args, r))
                    print(f"{row} plain: {json.dumps(r.get('plain') or r.get('plain_failed'))}"
                          + (f"; largest loss difference {r['loss_gap']:.2e}" if "loss_gap" in r else ""),
                          flush=True)  # fmt: skip
            except Exception as e:  # noqa: BLE001 - one failed row is reported, the others go on
                r["failed"] = f"{type(e).__name__}: {e}"
                print(f"{row} failed: {r['failed'][-2000:]}", flush=True)
            results.append(r)
            row_s = time.monotonic() - row_t0
            (out / "gpu_throughput.json").write_text(json.dumps({"device": gpu, "matmul": peak, "rows": results}))
    print(table(results, gpu, peak))
    return 1 if any("failed" in r for r in results) else 0


def _slashed(counts: dict) -> str:
    return "/".join(str(v) for v in counts.values())


def table(results: list[dict], gpu: str, peak: float | None) -> str:
    lines = [
        f"\n{gpu}; MFU against {PEAK_TFLOPS:.0f} TFLOP/s (datasheet dense bf16)"
        + (f"; the matmul measured {peak:.0f}" if peak else ""),
        "| row | params | flexorch tok/s | MFU | micro-batches | peak act GiB | state GiB | used of free | "
        "groups none/selective/full | steps packed for full/none/selective | OOM steps | plain tok/s | plain MFU | "
        "ratio | loss gap |",
        "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        if "failed" in r:
            lines.append(f"| {r['row']} | {r['params'] / 1e9:.2f}B | failed: {r['failed'][:80]} |")
            continue
        f, p = r["flexorch"], r.get("plain")
        plain = (
            f"{p['tokens_per_s']:,.0f} | {100 * p['tflops'] / PEAK_TFLOPS:.1f} % | {r['ratio']:.2f}x | "
            f"{r['loss_gap']:.1e}"
            if p
            else f"{r.get('plain_failed', '-')[:40]} | - | - | -"
        )
        lines.append(
            f"| {r['row']} | {r['params'] / 1e9:.2f}B | {f['tokens_per_s']:,.0f} | {f['mfu_pct']:.1f} % | "
            f"{f['micro_batches']} | {f['peak_activation_gib']:.1f} | {f['state_gib']:.1f} | "
            + ("-" if f.get("used_of_free_pct") is None else f"{f['used_of_free_pct']:.0f} %")
            + f" | {_slashed(f['recompute_groups'])} | {_slashed(f['packings'])} | "
            f"{f['out_of_memory_steps']} | {plain} |"
        )
    notes = [
        f"- {r['row']}: {r['flexorch'][key]}"
        for r in results
        for key in ("budget", "recompute_measured", "attention", "calibration", "stopped")
        if r.get("flexorch", {}).get(key)
    ]
    return "\n".join(lines + notes)


if __name__ == "__main__":
    raise SystemExit(run_main(main, "gpu/gpu_throughput", gpu_results_path("gpu/gpu_throughput")))
