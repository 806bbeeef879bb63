"""Where a GPU micro-batch's time goes, and what each option buys: attention kernels, regional torch.compile, recompute.

    python3 -m benchmarks.gpu.gpu_profile               # one H100/H200: about 4 minutes
    python3 -m benchmarks.gpu.gpu_profile --dry         # the same code paths on CPU, tiny sizes (seconds)
    python3 -m benchmarks.gpu.gpu_profile --only attention --out DIR

Torch (+ Transformers for the HF rows) only, no Ray: it runs on a lent GPU machine from a checkout. Two tables:

* **attention**: one micro-batch's documents (16384, 16384, 7828 tokens, the planner's micro-batch of the 1.1B run)
  at TinyLlama's heads (32 x 64, 4 KV heads) and a Llama-3.2-3B's (24 x 128, 8 KV heads); every varlen attention
  the GPU has: flexorch's ``torch_flash`` (torch's fused FlashAttention-2 kernels), cuDNN's fused attention (torch
  SDPA's ``CUDNN_ATTENTION`` per document, and aten's ragged ``_cudnn_attention_forward``), FlexAttention with a
  document mask (arXiv 2412.05496), flash-attn when installed. Forward and backward ms, TFLOP/s, error against
  flexorch's ``math`` reference in fp32 on a small batch.
* **model**: forward + backward (the chunked loss, ``flexorch.workers.chunked_loss``) of the 1.1B Llama through
  Transformers and of flexorch's own decoder of the same shape, bf16 weights, eager vs regional ``torch.compile``
  (each decoder layer compiled, the graph broken at the attention call: ``flexorch.workers.model.call_attention``)
  and recompute none / selective (each layer's MLP) / full: ms, model TFLOP/s, MFU against the matmul rate
  measured in the same run and against the datasheet's dense bf16 peak, peak memory, and a ``torch.profiler``
  breakdown of one iteration into matmuls, attention, compiled fusions, eager elementwise (norms, RoPE, SiLU,
  adds), copies and casts, the loss and host gaps.

Every row is printed as it finishes and written to ``<out>/gpu_profile.json``; a row that fails says why and the
others go on; ``--budget-s`` stops starting new rows past that many seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.common import gpu_results_path, run_main, save_hf_config
from benchmarks.gpu.gpu_rows.measure import BWD_OVER_FWD, attn_fwd_flops, offsets_of
from flexorch.config.model import ModelConfig

DATASHEET_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0}
"""Dense bf16 peak of the SXM parts (NVIDIA's datasheets), the denominator of the issue's MFU."""

FULL = {
    "lengths": (16384, 16384, 7828),
    "small": (1024, 700, 300, 1),
    "shapes": ((32, 4, 64), (24, 8, 128)),
    "model_docs": ((16384,), (16384, 16384, 7828)),
    "model": dict(vocab_size=32000, dim=2048, num_layers=22, num_heads=32, num_kv_heads=4, ffn_dim=5632),
    "matmul": 8192,
    "reps": 3,
}
DRY = {
    "lengths": (96, 64, 33),
    "small": (40, 17, 1),
    "shapes": ((4, 2, 16),),
    "model_docs": ((64,), (64, 32)),
    "model": dict(vocab_size=256, dim=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=128),
    "matmul": 256,
    "reps": 1,
}

CATEGORIES = (
    ("attention", ("flash", "fmha", "cudnn", "attn", "flex", "triton_tem")),
    ("matmul", ("gemm", "nvjet", "xmma", "cutlass", "cublas", "wgmma", "sm90_")),
    ("loss", ("log_softmax", "logsoftmax", "nll_loss", "cross_entropy")),
    ("optimizer", ("adam", "multi_tensor")),
    ("compiled fusions", ("triton_",)),
    ("copies and casts", ("copy", "cast", "cat_", "catarray", "fill", "memcpy", "memset", "to_copy")),
    ("elementwise (norms, RoPE, SiLU, adds)", ("elementwise", "reduce", "vectorized", "pow", "mul", "add", "silu")),
)


def category(kernel: str) -> str:
    name = kernel.lower()
    for cat, keys in CATEGORIES:
        if any(k in name for k in keys):
            return cat
    return "other"


class Timer:
    """Milliseconds of a region: CUDA events on a GPU, the clock on a CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    @contextlib.contextmanager
    def __call__(self, out: list):
        if self.device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            yield
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            yield
            out.append((time.perf_counter() - t0) * 1e3)


def matmul_tflops(device, n: int) -> float:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    timer, ms = Timer(device), []
    for _i in range(8):
        with timer(ms):
            a @ b
    return 2 * n**3 / (statistics.median(ms[3:]) * 1e-3) / 1e12


# ----------------------------------------------------------------------------------------------------- attention
def _docs(offsets):
    return list(zip(offsets[:-1], offsets[1:], strict=True))


def torch_flash(q, k, v, offsets):
    from flexorch.workers.attention.api import varlen_attn_func
    from flexorch.workers.attention.kernels import default_backend

    cu = torch.tensor(offsets, dtype=torch.int32, device=q.device)
    return varlen_attn_func(q, k, v, cu, backend=default_backend(q.device, q.dtype))


def math_reference(q, k, v, offsets):
    from flexorch.workers.attention.api import varlen_attn_func

    cu = torch.tensor(offsets, dtype=torch.int32, device=q.device)
    return varlen_attn_func(q, k, v, cu, backend="math")


def cudnn_sdpa(q, k, v, offsets):
    """torch SDPA restricted to cuDNN's fused attention, one call per document (GQA inside the kernel)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    outs = []
    for a, b in _docs(offsets):
        qi, ki, vi = (x[a:b].transpose(0, 1)[None] for x in (q, k, v))  # (L, h, hd) -> (1, h, L, hd)
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION] if b - a > 1 else [SDPBackend.MATH]):  # cuDNN: L > 1
            o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, enable_gqa=True)
        outs.append(o[0].transpose(0, 1))  # (1, h, L, hd) -> (L, h, hd)
    return torch.cat(outs)


def cudnn_sdpa_expanded(q, k, v, offsets):
    """As :func:`cudnn_sdpa` with K/V repeated to every query head (cuDNN without GQA support)."""
    rep = q.shape[1] // k.shape[1]
    return cudnn_sdpa(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), offsets)  # (t, h_kv) -> (t, h)


def cudnn_ragged(q, k, v, offsets):
    """aten's ragged cuDNN attention over the packed batch (one call), K/V repeated to every query head."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)  # (t, h_kv, hd) -> (t, h, hd)
    cu = torch.tensor(offsets, dtype=torch.int32, device=q.device)
    longest = max(b - a for a, b in _docs(offsets))
    return torch.ops.aten._cudnn_attention_forward(q, k, v, None, cu, cu, longest, longest, True, 0.0, True)[0]


_FLEX: dict = {}


def flex(q, k, v, offsets):
    """FlexAttention (compiled Triton kernels) with a causal document mask; block-sparse over the packed batch."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    key = (tuple(offsets), q.device)
    if key not in _FLEX:
        lengths = torch.tensor([b - a for a, b in _docs(offsets)], device=q.device)
        doc = torch.repeat_interleave(torch.arange(len(lengths), device=q.device), lengths)

        def mask(b, h, qi, ki):
            return (doc[qi] == doc[ki]) & (qi >= ki)

        t = offsets[-1]
        _FLEX[key] = create_block_mask(mask, None, None, t, t, device=q.device)
        _FLEX.setdefault("fn", torch.compile(flex_attention, dynamic=False))
    q4, k4, v4 = (x.transpose(0, 1)[None] for x in (q, k, v))  # (t, h, hd) -> (1, h, t, hd)
    return _FLEX["fn"](q4, k4, v4, block_mask=_FLEX[key], enable_gqa=True)[0].transpose(0, 1)


def flash_attn_pkg(q, k, v, offsets):
    from flexorch.workers.attention.api import varlen_attn_func

    cu = torch.tensor(offsets, dtype=torch.int32, device=q.device)
    return varlen_attn_func(q, k, v, cu, backend="flash_attn")


ATTENTION = {
    "torch_flash": torch_flash,
    "cudnn_sdpa": cudnn_sdpa,
    "cudnn_sdpa_expanded": cudnn_sdpa_expanded,
    "flex": flex,
    "flash_attn": flash_attn_pkg,
}


def qkv(lengths, shape, device, dtype, seed=0):
    h, h_kv, hd = shape
    g = torch.Generator(device="cpu").manual_seed(seed)
    t = sum(lengths)
    mk = [torch.randn(t, n, hd, generator=g) for n in (h, h_kv, h_kv)]
    return [x.to(device=device, dtype=dtype).requires_grad_() for x in mk]


def run_attention(fn, q, k, v, offsets):
    for x in (q, k, v):
        x.grad = None
    out = fn(q, k, v, offsets)
    out.backward(torch.ones_like(out) * 0.01 + out.detach() * 0.0)
    return out.detach(), q.grad, k.grad, v.grad


def attention_error(fn, cfg, shape, device, dtype) -> float:
    small = cfg["small"]
    offsets = offsets_of(small)
    got = run_attention(fn, *qkv(small, shape, device, dtype), offsets)
    want = run_attention(math_reference, *qkv(small, shape, device, torch.float32), offsets)
    pairs = zip(got, want, strict=True)
    return max(float((a.float() - b).abs().max()) / max(1.0, float(b.abs().max())) for a, b in pairs)


def attention_row(name, fn, cfg, shape, device, dtype) -> dict:
    lengths, offsets = cfg["lengths"], offsets_of(cfg["lengths"])
    q, k, v = qkv(lengths, shape, device, dtype, seed=1)
    timer, fwd, bwd = Timer(device), [], []
    dout = torch.randn(q.shape, device=device, dtype=dtype)
    for _i in range(2 + cfg["reps"]):
        for x in (q, k, v):
            x.grad = None
        with timer(fwd):
            out = fn(q, k, v, offsets)
        with timer(bwd):
            out.backward(dout)
    f_ms, b_ms = statistics.median(fwd[2:]), statistics.median(bwd[2:])
    flops = attn_fwd_flops(lengths, shape[0], shape[2])
    return {
        "fwd_ms": f_ms,
        "bwd_ms": b_ms,
        "fwd_tflops": flops / f_ms / 1e9,
        "bwd_tflops": BWD_OVER_FWD * flops / b_ms / 1e9,
        "fwd_bwd_ms": f_ms + b_ms,
        "error": attention_error(fn, cfg, shape, device, dtype),
    }


# ---------------------------------------------------------------------------------------------------------- model
def model_config(kind: str, cfg: dict, tmp: Path) -> ModelConfig:
    own = ModelConfig(**cfg["model"], loss_chunk_tokens=4096)
    if kind == "own":
        return own
    from flexorch.config.hf import hf_model_config

    save_hf_config(own, tmp, max_position_embeddings=131072)
    return ModelConfig.from_dict({**hf_model_config(str(tmp)), "loss_chunk_tokens": 4096})


def packed(docs, vocab, device):
    from flexorch.testing.reference import pack_documents

    g = torch.Generator().manual_seed(0)
    batch = pack_documents([torch.randint(0, vocab, (n,), generator=g) for n in docs])
    return {
        "tokens": batch.tokens.to(device),
        "pos": batch.position_ids.to(device),
        "labels": batch.labels.to(device),
        "cu": batch.cu_seqlens.to(device),
        "max": batch.max_seqlen,
    }


def fwd_bwd(model, b) -> None:
    import functools

    from flexorch.workers.attention.api import varlen_attn_func

    attn = functools.partial(varlen_attn_func, cu_seqlens=b["cu"], max_seqlen=b["max"])
    model(b["tokens"], b["pos"], attn, labels=b["labels"]).backward()


def set_compiled(model, on: bool) -> None:
    for layer in model.layers:
        if on:
            layer.compile()
        else:
            layer._compiled_call_impl = None


def breakdown(model, b, device) -> dict:
    """One iteration under torch.profiler: device time per category, and the share of the wall time no kernel ran."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        fwd_bwd(model, b)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    wall_us = (time.perf_counter() - t0) * 1e6
    by: dict[str, float] = {}
    spans = []
    for e in prof.events():
        if e.device_type.name != "CUDA" or e.time_range.elapsed_us() <= 0:
            continue
        by[category(e.name)] = by.get(category(e.name), 0.0) + e.time_range.elapsed_us() / 1e3
        spans.append((e.time_range.start, e.time_range.end))
    busy, end = 0.0, -1.0
    for s, e in sorted(spans):
        busy += max(0.0, e - max(s, end))
        end = max(end, e)
    top = sorted(
        ((a.key, a.self_device_time_total / 1e3) for a in prof.key_averages() if a.self_device_time_total > 0),
        key=lambda kv: -kv[1],
    )[:8]
    return {"ms": by, "busy_pct": 100.0 * busy / wall_us if spans else None, "top": top}


def model_rows(kind: str, cfg: dict, device, deadline: float, emit) -> None:
    from flexorch.workers.model_source import build_model, set_activation_checkpointing

    with tempfile.TemporaryDirectory() as tmp:
        mcfg = model_config(kind, cfg, Path(tmp))
        model = build_model(mcfg, 0, device=device).to(torch.bfloat16 if device.type == "cuda" else torch.float32)
    params = mcfg.num_params()
    peak = cfg["peak"]
    for compiled in (False, True):
        set_compiled(model, compiled)
        torch._dynamo.reset()
        for recompute in ("full", "selective", "none"):
            set_activation_checkpointing(model, recompute)
            for docs in cfg["model_docs"]:
                name = f"{kind} {'compiled' if compiled else 'eager'} recompute={recompute} docs={list(docs)}"
                if time.monotonic() > deadline:
                    emit("model", name, {"skipped": "past --budget-s"})
                    continue
                emit("model", name, _model_row(model, mcfg, params, docs, device, cfg["reps"], peak))
    set_compiled(model, False)


def _model_row(model, mcfg, params, docs, device, reps, peak) -> dict:
    try:
        b = packed(docs, mcfg.vocab_size, device)
        timer, ms = Timer(device), []
        t0 = time.perf_counter()
        with timer(ms):
            fwd_bwd(model, b)  # warm-up (compiles, when compiled)
        first_s = time.perf_counter() - t0
        model.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        for _ in range(reps):
            with timer(ms):
                fwd_bwd(model, b)
            model.zero_grad(set_to_none=True)
        wall = statistics.median(ms[1:])
        flops = 6.0 * params * sum(docs) + (1 + BWD_OVER_FWD) * mcfg.num_layers * attn_fwd_flops(
            docs, mcfg.num_heads, mcfg.head_dim
        )
        row = {
            "ms": wall,
            "first_s": first_s,
            "tflops": flops / wall / 1e9,
            "mfu_measured_pct": 100 * flops / wall / 1e9 / peak["measured"],
            "mfu_datasheet_pct": 100 * flops / wall / 1e9 / peak["datasheet"] if peak["datasheet"] else None,
            "tokens_per_s": sum(docs) / wall * 1e3,
            "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
        }
        row["profile"] = breakdown(model, b, device)
        model.zero_grad(set_to_none=True)
        return row
    except Exception as e:  # noqa: BLE001 - a failing row is reported, the others go on
        model.zero_grad(set_to_none=True)
        return {"failed": f"{type(e).__name__}: {str(e)[:300]}"}
    finally:
        if device.type == "cuda":
            torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------------------------- main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry", action="store_true", help="CPU, tiny sizes")
    ap.add_argument("--only", default="attention,model", help="comma-separated: attention, model")
    ap.add_argument("--models", default="hf,own", help="comma-separated: hf, own")
    ap.add_argument("--out", default="runs/gpu_profile")
    ap.add_argument("--budget-s", type=float, default=330.0)
    args = ap.parse_args(argv)
    t_start = time.monotonic()
    deadline = t_start + args.budget_s
    cuda = torch.cuda.is_available() and not args.dry
    device = torch.device("cuda" if cuda else "cpu")
    cfg = dict(DRY if args.dry or not cuda else FULL)
    dtype = torch.bfloat16 if cuda else torch.float32
    gpu = torch.cuda.get_device_name(device) if cuda else "cpu"
    measured = matmul_tflops(device, cfg["matmul"])
    datasheet = next((v for k, v in DATASHEET_BF16_TFLOPS.items() if k in gpu), None)
    cfg["peak"] = {"measured": measured, "datasheet": datasheet}
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {"device": gpu, "torch": torch.__version__, "matmul_tflops": measured, "rows": []}
    print(f"gpu_profile on {gpu}, torch {torch.__version__}: bf16 matmul {measured:.0f} TFLOP/s", flush=True)

    def emit(section, name, row):
        results["rows"].append({"section": section, "name": name, **row})
        print(f"[{time.monotonic() - t_start:6.1f}s] {section} | {name} | {_brief(row)}", flush=True)
        (out_dir / "gpu_profile.json").write_text(json.dumps(results, indent=1, default=str))

    only = set(args.only.split(","))
    if "attention" in only:
        for shape in cfg["shapes"]:
            for name, fn in ATTENTION.items():
                if not cuda and name not in ("torch_flash",):
                    continue
                label = f"{name} h={shape[0]} kv={shape[1]} hd={shape[2]} docs={list(cfg['lengths'])}"
                if time.monotonic() > deadline:
                    emit("attention", label, {"skipped": "past --budget-s"})
                    continue
                try:
                    emit("attention", label, attention_row(name, fn, cfg, shape, device, dtype))
                except Exception as e:  # noqa: BLE001 - one kernel that cannot run is a row, not the end
                    emit("attention", label, {"failed": f"{type(e).__name__}: {str(e)[:300]}"})
                finally:
                    if cuda:
                        torch.cuda.empty_cache()
    if "model" in only:
        for kind in args.models.split(","):
            try:
                model_rows(kind, cfg, device, deadline, emit)
            except Exception as e:  # noqa: BLE001
                emit("model", kind, {"failed": f"{type(e).__name__}: {str(e)[:300]}"})
    print(f"done in {time.monotonic() - t_start:.0f} s: {out_dir / 'gpu_profile.json'}", flush=True)
    return 0


def _brief(row: dict) -> str:
    if "failed" in row or "skipped" in row:
        return row.get("failed") or row["skipped"]
    if "fwd_ms" in row:
        return (
            f"fwd {row['fwd_ms']:.1f} ms ({row['fwd_tflops']:.0f} TFLOP/s), bwd {row['bwd_ms']:.1f} ms "
            f"({row['bwd_tflops']:.0f}), error {row['error']:.1e}"
        )
    prof = row["profile"]
    cats = ", ".join(f"{k} {v:.0f}" for k, v in sorted(prof["ms"].items(), key=lambda kv: -kv[1]))
    mem = f", peak {row['peak_gib']:.1f} GiB" if row["peak_gib"] is not None else ""
    return (
        f"{row['ms']:.1f} ms, {row['tokens_per_s']:,.0f} tok/s, {row['tflops']:.0f} TFLOP/s "
        f"(MFU {row['mfu_measured_pct']:.1f} % of measured), first {row['first_s']:.1f} s{mem}; "
        f"busy {prof['busy_pct'] or 0:.0f} %; ms: {cats}; top: {[(k[:50], round(v)) for k, v in prof['top'][:4]]}"
    )


if __name__ == "__main__":
    raise SystemExit(run_main(main, "gpu/gpu_profile", gpu_results_path("gpu/gpu_profile")))
