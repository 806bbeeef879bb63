"""The same decoder shape built through Transformers vs flexorch's own decoder: step time side by side in one run.

The issue's target: on CPU with 4 workers, a Hugging Face model (``[model] hf = DIR``: Transformers' Llama with
flexorch's sequence-parallel attention registered through its ``AttentionInterface``) costs at most 1.1x the step
time of flexorch's own LLaMA-style decoder of the same shape.

Both models have the same shape (hidden size, SwiGLU width, layers, heads, kv heads, vocabulary, RMSNorm epsilon,
RoPE base; the Llama config is written with ``save_pretrained`` into a temporary directory) and the same parameter
count. Both train through the real :class:`~flexorch.control.driver.TrainingDriver` on 4 Ray worker actors (one
torch thread each), on the same corpus, seed and batches, with the same fixed cost profile, so the planner sees the
same inputs (the plans are compared step by step and the steps whose plans differ are counted). Both drivers are up
at once and step in interleaved rounds (own, HF, HF, own, ...: ``--rounds`` rounds of ``--steps-per-round`` steps
each, after ``--warmup`` steps of each that are not counted), so the noise of a shared machine falls on both. Per
mode (``replicate``, then ``fsdp`` unless ``--modes replicate``) the table gives the median of ``measured_ms``
(dispatch to the last outcome, the driver's step time), of ``compute_ms`` (the slowest rank's micro-batches), of
the step's wall time around ``driver.step()``, tokens per second, and the ratios HF / own: of the medians, and the
median of the per-step ratios (step i of both runs trained the same batch). The target is judged on the per-step
ratio of step times over the steps whose plans are identical (the planner is time-limited, ``--time-limit``, and on
a busy machine may return another plan for the same batch: planner noise, not the model's cost).

A single-process part comes first (one thread, no Ray): forward + backward of each model on the same packed
documents with single-device varlen attention, interleaved; ``--profile`` adds torch.profiler's top operators of
each, by self CPU time, and the operators whose time differs most.

    python -m benchmarks.measured.hf_step_time            # about 5 minutes on 2 cores: replicate and fsdp
    python -m benchmarks.measured.hf_step_time --quick    # about 2 minutes: replicate only, fewer steps
    python -m benchmarks.measured.hf_step_time --quick --json runs/hf_step_time.json --profile
    python -m benchmarks.measured.hf_step_time --quick --families all   # a row per family (about 15 minutes)

``--families`` builds each family's twin of the same shape instead of Llama alone, one family after another, each
against the same own decoder: Mistral and Gemma 3 with a 256-token sliding window (on every layer; on 5 of 6), so
the 900-byte documents run windowed attention; Qwen3, OLMo 2 and Gemma 3 add q/k norms (their parameter count is
a little larger: the table gives both); Phi-3 fuses its projections; Gemma 3's MLP is GeGLU (tanh GELU); Qwen3-MoE
has 4 experts of half the MLP's width, 2 per token (as many active parameters as the dense decoder), and trains its
router loss (its counting pass, ``router_ms``, is reported: part of the MoE row's ratio).
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import json
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np

from benchmarks.common import run_main, save_hf_config, start_local_ray  # noqa: E402
from benchmarks.measured.fixed_profile import write_fixed_profile  # noqa: E402
from flexorch.config import CorpusConfig, ModelConfig, OptimConfig, PlanSettings, TrainConfig  # noqa: E402
from flexorch.config.sharding import ShardingSettings  # noqa: E402

TARGET = 1.1
_RUNS = itertools.count()
SHAPE_KEYS = ("vocab_size", "dim", "num_layers", "num_heads", "num_kv_heads", "ffn_dim", "rope_theta", "norm_eps")
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "olmo2", "gemma3_text", "qwen3_moe")
WINDOW = 256
FAMILY_OPTIONS = {  # beyond the shape: what makes each twin run as its family does
    "mistral": {"sliding_window": WINDOW},
    "qwen2": {},
    "qwen3": {},
    "phi3": {"pad_token_id": None},
    "olmo2": {"pad_token_id": None},
    "gemma3_text": {"sliding_window": WINDOW, "sliding_window_pattern": 6, "tie_word_embeddings": False},
    # 4 experts of half the MLP's width, 2 per token: a token computes with as many parameters as the dense twin's;
    # the router loss trains (over the global batch: one more forward without the head per step, ``router_ms``)
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "output_router_logits": True,
                  "router_aux_loss_coef": 0.01},
}  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------
# The two models
# ---------------------------------------------------------------------------------------------------------------


def own_model(dim: int, layers: int, heads: int, kv_heads: int, ffn: int, vocab: int) -> ModelConfig:
    return ModelConfig(
        vocab_size=vocab, dim=dim, num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, ffn_dim=ffn
    )


def hf_twin(own: ModelConfig, directory: Path, family: str = "llama") -> ModelConfig:
    """A Transformers config of ``family`` and ``own``'s shape saved into ``directory``; its ModelConfig (``[model]
    hf``), checked to have the same shape (Llama: and parameter count; the families with q/k norms have a few more)."""
    from flexorch.config.hf import hf_model_config

    options = {"head_dim": own.head_dim, **FAMILY_OPTIONS[family]} if family != "llama" else {}
    if family == "qwen3_moe":
        options["moe_intermediate_size"] = own.ffn_dim // 2
    save_hf_config(own, directory, family, initializer_range=own.init_std, max_position_embeddings=4096, **options)
    hf = ModelConfig.from_dict(hf_model_config(str(directory)))
    keys = SHAPE_KEYS if family == "llama" else SHAPE_KEYS[:6]
    diff = {k: (getattr(own, k), getattr(hf, k)) for k in keys if getattr(own, k) != getattr(hf, k)}
    if diff or (family == "llama" and hf.num_params() != own.num_params()):
        raise RuntimeError(f"the {family} twin differs: {diff}, params {hf.num_params()} vs {own.num_params()}")
    return hf


def label(cfg: ModelConfig) -> str:
    return "own" if cfg.hf is None else f"hf-{cfg.family}"


def other(names) -> str:
    """The HF model's label among ``names`` (the other is ``own``)."""
    return next(n for n in names if n != "own")


# ---------------------------------------------------------------------------------------------------------------
# Part 1: one process, forward + backward
# ---------------------------------------------------------------------------------------------------------------


def sample_docs(lengths: list[int], vocab: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, min(vocab, 257), n) for n in lengths]


def fwd_bwd(model, batch) -> float:
    from flexorch.testing.reference import reference_loss_sum

    model.zero_grad(set_to_none=True)
    loss = reference_loss_sum(model, batch)
    loss.backward()
    return float(loss.detach())


def single_process(models: list[ModelConfig], sizes: list[int], reps: int, profile: bool) -> dict:
    """Median forward+backward ms of each model on the same packed documents (``sizes``: tokens per pack, each
    three documents of 1/2, 1/4, 1/4), one thread, the models interleaved (order flipped every repetition)."""
    import torch

    from flexorch.testing.reference import pack_documents
    from flexorch.workers.model_source import build_model

    torch.set_num_threads(1)
    built = {label(m): build_model(m, 0) for m in models}
    out: dict = {"sizes": {}}
    for n in sizes:
        batch = pack_documents(sample_docs([n - 2 * (n // 4), n // 4, n // 4], models[0].vocab_size))
        times: dict[str, list[float]] = {k: [] for k in built}
        for m in built.values():  # warm-up: allocator, Transformers' lazy imports
            fwd_bwd(m, batch)
        for i in range(reps):
            order = list(built) if i % 2 == 0 else list(built)[::-1]
            for k in order:
                t0 = time.perf_counter()
                fwd_bwd(built[k], batch)
                times[k].append((time.perf_counter() - t0) * 1e3)
        ms = {k: float(np.median(t)) for k, t in times.items()}
        hf = other(built)
        pairwise = float(np.median(np.array(times[hf]) / np.array(times["own"])))
        out["sizes"][n] = {"ms": ms, "ratio": ms[hf] / ms["own"], "pairwise": pairwise}
        if profile and n == max(sizes):
            out["profile_tokens"] = n
            out["profile"] = {k: profile_ops(m, batch) for k, m in built.items()}
    return out


def profile_ops(model, batch, reps: int = 3) -> dict[str, list[float]]:
    """``{operator: [self CPU ms, calls]}`` per forward+backward (torch.profiler, averaged over ``reps``)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(reps):
            fwd_bwd(model, batch)
    return {e.key: [e.self_cpu_time_total / 1e3 / reps, e.count / reps] for e in prof.key_averages()}


def report_single(r: dict, top: int = 12) -> None:
    hf = other(next(iter(r["sizes"].values()))["ms"])
    print("single process, 1 thread, forward+backward (median ms, models interleaved):")
    print(f"| tokens | own ms | {hf} ms | HF/own | pairwise HF/own |")
    print("|---:|---:|---:|---:|---:|")
    for n, row in r["sizes"].items():
        print(f"| {n} | {row['ms']['own']:.1f} | {row['ms'][hf]:.1f} | {row['ratio']:.3f}x | {row['pairwise']:.3f}x |")
    if "profile" not in r:
        return
    p_own, p_hf = r["profile"]["own"], r["profile"][hf]
    for name, p in (("own", p_own), (hf, p_hf)):
        total = sum(ms for ms, _ in p.values())
        print(
            f"\n  top operators of {name} at {r['profile_tokens']} tokens, self CPU ms per forward+backward "
            f"(total {total:.1f}; calls):"
        )
        for op, (ms, calls) in sorted(p.items(), key=lambda kv: -kv[1][0])[:top]:
            print(f"    {ms:8.2f}  {calls:6.0f}  {op}")
    zero = [0.0, 0.0]
    ops = set(p_own) | set(p_hf)
    diffs = {op: p_hf.get(op, zero)[0] - p_own.get(op, zero)[0] for op in ops}
    print(f"\n  largest time differences, {hf} minus own (self CPU ms per forward+backward; timings are noisy):")
    for op, d in sorted(diffs.items(), key=lambda kv: -abs(kv[1]))[:top]:
        print(f"    {d:+8.2f}  {op}  (own {p_own.get(op, zero)[0]:.2f}, hf {p_hf.get(op, zero)[0]:.2f})")
    calls = {op: p_hf.get(op, zero)[1] - p_own.get(op, zero)[1] for op in ops}
    more = sorted((op for op in ops if calls[op]), key=lambda op: -abs(calls[op]))[:top]
    print(f"\n  operators called a different number of times (calls per forward+backward, own -> {hf}; exact):")
    for op in more:
        print(
            f"    {p_own.get(op, zero)[1]:6.0f} -> {p_hf.get(op, zero)[1]:6.0f}  {op}  (hf self "
            f"{p_hf.get(op, zero)[0]:.2f} ms, own {p_own.get(op, zero)[0]:.2f} ms)"
        )


# ---------------------------------------------------------------------------------------------------------------
# Part 2: 4 Ray workers through the training driver
# ---------------------------------------------------------------------------------------------------------------


def doc_lengths(n: int, max_bytes: int, seed: int = 1) -> list[int]:
    """Long-tailed byte lengths (a few near ``max_bytes`` that need SP, most short)."""
    rng = np.random.default_rng(seed)
    return [int(x) for x in np.clip(rng.lognormal(np.log(max_bytes / 5), 0.9, n), 8, max_bytes)]


def write_corpus(root: Path, lengths: list[int]) -> Path:
    """Real text (the standard library's sources) cut into documents of the given byte sizes."""
    import argparse as a
    import textwrap

    text = (inspect.getsource(textwrap) + inspect.getsource(a)).encode()
    root.mkdir(parents=True, exist_ok=True)
    pos = 0
    for i, n in enumerate(lengths):
        if pos + n > len(text):
            pos = 0
        (root / f"doc_{i:03d}.txt").write_bytes(text[pos : pos + n])
        pos += n
    return root


def write_profile(path: Path, model: ModelConfig) -> Path:
    """A fixed CPU profile with the model's shape (no calibration: the planner gets the same inputs every run)."""
    return write_fixed_profile(path, model, "bench-hf-cpu")


def make_driver(args, model: ModelConfig, mode: str, data: CorpusConfig, corpus, profile: Path, steps: int):
    from flexorch.control.driver import TrainingDriver

    run_dir = args.out / f"{mode}-{label(model)}-{next(_RUNS)}"  # our decoder runs once per family
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = TrainConfig(
        steps=steps,
        workers=args.workers,
        batch_size=args.batch,
        seed=0,
        run_dir=str(run_dir),
        model=model,
        optim=OptimConfig(lr=1e-3, warmup_steps=1),
        data=data,
        plan=PlanSettings(profile=str(profile), tokens_per_worker=args.tokens_per_worker, time_limit_s=args.time_limit),
        sharding=ShardingSettings(mode=mode),
    )
    driver = TrainingDriver(cfg, corpus=corpus)
    driver.setup()
    return driver


def timed_step(driver) -> dict:
    t0 = time.perf_counter()
    rec = driver.step().record
    rec = dict(rec)
    rec["wall_ms"] = (time.perf_counter() - t0) * 1e3
    return rec


def compare_mode(args, models: list[ModelConfig], mode: str, data, corpus, profile: Path) -> dict:
    """Both models up at once, warmed up, then interleaved rounds; the kept step records of each."""
    steps = args.warmup + args.rounds * args.steps_per_round
    t0 = time.perf_counter()
    drivers = {}
    try:
        for m in models:
            drivers[label(m)] = make_driver(args, m, mode, data, corpus, profile, steps)
        names = list(drivers)
        for name in names:
            for _ in range(args.warmup):
                timed_step(drivers[name])
        kept: dict[str, list[dict]] = {n: [] for n in names}
        for r in range(args.rounds):
            order = names if r % 2 == 0 else names[::-1]
            for name in order:
                for _ in range(args.steps_per_round):
                    kept[name].append(timed_step(drivers[name]))
            print(
                f"  {mode} round {r + 1}/{args.rounds} ({' then '.join(order)}): "
                + "  ".join(
                    f"{n} {np.median([x['measured_ms'] for x in kept[n][-args.steps_per_round :]]):7.1f} ms"
                    for n in names
                )
                + f"   ({time.perf_counter() - t0:.0f} s)",
                flush=True,
            )
    finally:
        for d in drivers.values():
            d.shutdown()
    return kept


def rank_compute(record: dict) -> float:
    """Median over the ranks of each rank's compute time (start to end of its micro-batches): less sensitive than
    ``compute_ms`` (the slowest rank) to one rank descheduled on a busy machine."""
    return float(np.median([r["compute_end_ms"] for r in record["ranks"] if r is not None]))


def summarise(kept: dict[str, list[dict]], params: dict[str, int]) -> dict:
    name_hf = other(kept)
    own, hf = kept["own"], kept[name_hf]
    same_plan = [a["plan"] == b["plan"] and a["doc_ids"] == b["doc_ids"] for a, b in zip(own, hf, strict=True)]
    rows = {}
    for name, recs in kept.items():
        rows[name] = {
            "params": params[name],
            "steps": len(recs),
            "step_ms": float(np.median([r["measured_ms"] for r in recs])),
            "compute_ms": float(np.median([r["compute_ms"] for r in recs])),
            "wall_ms": float(np.median([r["wall_ms"] for r in recs])),
            "tokens_per_s": float(np.median([r["tokens_per_s"] for r in recs])),
            "step_ms_all": [r["measured_ms"] for r in recs],
            "compute_ms_all": [r["compute_ms"] for r in recs],
            "rank_compute_ms": float(np.median([rank_compute(r) for r in recs])),
            "shapes": [r["shape"] for r in recs],
            "status": [r["status"] for r in recs],
            "plan_wait_ms": float(np.median([r["plan_wait_ms"] for r in recs])),
            "router_ms": float(np.median([r.get("router_ms") or 0.0 for r in recs])),  # MoE: the routing count
        }
    pairs = [(a, b) for (a, b), same in zip(zip(own, hf, strict=True), same_plan, strict=True) if same]
    ratio = {
        "step": rows[name_hf]["step_ms"] / rows["own"]["step_ms"],
        "compute": rows[name_hf]["compute_ms"] / rows["own"]["compute_ms"],
        "wall": rows[name_hf]["wall_ms"] / rows["own"]["wall_ms"],
        "pairwise_step": float(np.median([b["measured_ms"] / a["measured_ms"] for a, b in pairs])) if pairs else None,
        "pairwise_compute": float(np.median([b["compute_ms"] / a["compute_ms"] for a, b in pairs])) if pairs else None,
        "rank_compute": rows[name_hf]["rank_compute_ms"] / rows["own"]["rank_compute_ms"],
        "pairwise_rank_compute": float(np.median([rank_compute(b) / rank_compute(a) for a, b in pairs]))
        if pairs
        else None,
        "same_plan_steps": sum(same_plan),
        "steps": len(same_plan),
    }
    return {"rows": rows, "ratio": ratio}


def report(results: dict[str, dict]) -> list[str]:
    print(
        "\n| model | mode | params | median step ms | median compute ms | median wall ms | tokens/s | "
        "HF/own step | HF/own compute | pairwise HF/own step | pairwise HF/own compute |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    verdicts = []
    for key, r in results.items():
        mode = key.split(" ")[-1]
        ratio = r["ratio"]
        for name, row in r["rows"].items():
            cells = ["", "", "", ""]
            if name != "own":
                pw = ratio["pairwise_step"], ratio["pairwise_compute"]
                cells = [
                    f"{ratio['step']:.3f}x",
                    f"{ratio['compute']:.3f}x",
                    f"{pw[0]:.3f}x" if pw[0] is not None else "n/a",
                    f"{pw[1]:.3f}x" if pw[1] is not None else "n/a",
                ]
            print(
                f"| {name} | {mode} | {row['params']:,} | {row['step_ms']:.1f} | {row['compute_ms']:.1f} | "
                f"{row['wall_ms']:.1f} | {row['tokens_per_s']:.0f} | " + " | ".join(cells) + " |"
            )
        pw, pc = ratio["pairwise_step"], ratio["pairwise_compute"]
        # judged on steps whose plans are identical (the planner, time-limited on a busy machine, can return a
        # different plan for the same batch: that is the planner's noise, not the model's cost)
        judged = pw if pw is not None else ratio["step"]
        statuses = {n: Counter(row["status"]) for n, row in r["rows"].items()}
        verdicts.append(
            f"{key}: target (HF step time at most {TARGET}x own's) {'met' if judged <= TARGET else 'NOT met'}: "
            f"median of the per-step ratios over the {ratio['same_plan_steps']}/{ratio['steps']} steps with identical "
            f"plans: step "
            + (f"{pw:.3f}x" if pw is not None else "n/a")
            + ", compute "
            + (f"{pc:.3f}x" if pc is not None else "n/a")
            + f"; ratio of the medians over all steps: step {ratio['step']:.3f}x, compute {ratio['compute']:.3f}x, "
            f"wall {ratio['wall']:.3f}x; median rank's compute {ratio['rank_compute']:.3f}x, pairwise "
            + (f"{ratio['pairwise_rank_compute']:.3f}x" if ratio["pairwise_rank_compute"] is not None else "n/a")
            + "".join(
                f"; {n}'s router-loss counting pass: median {row['router_ms']:.0f} ms a step"
                for n, row in r["rows"].items()
                if row["router_ms"]
            )
            + " (planner status: "
            + "; ".join(f"{n} " + ", ".join(f"{k} {c}" for k, c in st.items()) for n, st in statuses.items())
            + ")"
        )
    return verdicts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="replicate only, fewer steps (about 2 minutes)")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=688)
    ap.add_argument("--vocab", type=int, default=320)
    ap.add_argument("--batch", type=int, default=8, help="documents per step")
    ap.add_argument("--tokens-per-worker", type=int, default=512)
    ap.add_argument("--max-doc-bytes", type=int, default=900)
    ap.add_argument("--modes", default=None, help="comma-separated sharding modes (default replicate,fsdp)")
    ap.add_argument(
        "--time-limit", type=float, default=1.0, help="planner time limit, s (long enough to solve to optimality)"
    )
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 8, --quick 4)")
    ap.add_argument("--steps-per-round", type=int, default=None, help="steps of one model per round (default 2)")
    ap.add_argument("--single-reps", type=int, default=None, help="single-process repetitions (default 8, --quick 4)")
    ap.add_argument("--no-ray", action="store_true", help="the single-process part only")
    ap.add_argument("--profile", action="store_true", help="torch.profiler's top operators in the single process")
    ap.add_argument("--out", type=Path, default=None, help="run directories (default: a temporary directory)")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    ap.add_argument(
        "--families",
        default="llama",
        help=f"comma-separated twins to compare with our decoder, or 'all' ({', '.join(FAMILIES)}; default llama)",
    )
    args = ap.parse_args(argv)
    args.rounds = args.rounds or (4 if args.quick else 8)
    args.steps_per_round = args.steps_per_round or 2
    args.single_reps = args.single_reps or (4 if args.quick else 8)
    modes = (args.modes or ("replicate" if args.quick else "replicate,fsdp")).split(",")

    families = FAMILIES if args.families == "all" else tuple(args.families.split(","))
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        ap.error(f"--families: unknown {unknown}; choose among {', '.join(FAMILIES)} or 'all'")

    tmp = tempfile.TemporaryDirectory(prefix="flexorch-hf-bench-")
    args.out = args.out or Path(tmp.name)
    own = own_model(args.dim, args.layers, args.heads, args.kv_heads, args.ffn, args.vocab)
    twins = {f: hf_twin(own, args.out / f, f) for f in families}
    params = {label(m): m.num_params() for m in (own, *twins.values())}
    print(
        f"shape: dim {own.dim}, {own.num_layers} layers, {own.num_heads} heads ({own.num_kv_heads} kv), ffn "
        f"{own.ffn_dim}, vocab {own.vocab_size}, rope theta {own.rope_theta:g}, eps {own.norm_eps:g}; parameters: "
        + ", ".join(f"{k} {v:,}" for k, v in params.items()),
        flush=True,
    )
    results: dict = {"shape": {k: getattr(own, k) for k in SHAPE_KEYS}, "params": params, "single_process": {}}

    for family, hf in twins.items():
        single = single_process([own, hf], [128, 512, 1024], args.single_reps, args.profile)
        report_single(single)
        results["single_process"][family] = single

    if not args.no_ray:
        import ray

        from flexorch.data.corpus import load_corpus

        start_local_ray(2 * args.workers + 1)  # both models' workers + the driver
        corpus_dir = write_corpus(args.out / "corpus", doc_lengths(64, args.max_doc_bytes))
        data = CorpusConfig(source=str(corpus_dir), max_context=1024, tokenizer="byte")
        corpus = load_corpus(data)
        profile = write_profile(args.out / "profile.json", own)
        print(
            f"\n{args.workers} Ray workers (1 thread each), {args.batch} documents per step, "
            f"{args.tokens_per_worker} tokens per worker; {args.warmup} warm-up steps each, then {args.rounds} "
            f"interleaved rounds of {args.steps_per_round} steps; modes {', '.join(modes)}",
            flush=True,
        )
        runs = {}
        try:
            for hf in twins.values():
                for mode in modes:
                    kept = compare_mode(args, [own, hf], mode, data, corpus, profile)
                    runs[f"{label(hf)} {mode}"] = summarise(kept, params)
        finally:
            ray.shutdown()
        verdicts = report(runs)
        print()
        for v in verdicts:
            print(v)
        results["runs"] = runs
        results["verdicts"] = verdicts
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1, default=str))
        print(f"\nwrote {args.json}")
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main(main, "measured/hf_step_time"))
