"""Benchmark: fwd+bwd of Ulysses and zigzag ring attention vs single-process attention on one packed batch.

    python -m benchmarks.measured.attention                 # CPU, degrees 2 and 4, about 1-2 minutes on 2 cores
    python -m benchmarks.measured.attention --device cuda   # GPU: flash-attn (or math kernel), bf16, degrees <= #GPUs

Each SP rank is a real process in a gloo (CPU) or NCCL (GPU) world; every case runs 1 warm-up and ``--reps``
timed fwd+bwd iterations between barriers, so a time is the group's wall time. Bytes are counted by wrapping
``dist.all_to_all_single`` and ``dist.batch_isend_irecv``: what one rank sends per fwd+bwd (an all-to-all's
own block is not counted). ``model MB`` is ``solver.cost_model.comm_bytes`` for the same shapes (float32 on
the wire on CPU), for comparison with the planner's assumptions. On CPU the single-process baseline and every
rank use ``--threads`` threads each; with more processes than cores the SP rows are bounded by the core count.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import random
import time

import torch
import torch.distributed as dist

from benchmarks.common import matmul_tflops, run_main  # noqa: E402
from flexorch.workers.attention.api import ulysses_attn_varlen_func, varlen_attn_func, zigzag_ring_attn_varlen_func  # noqa: E402
from flexorch.workers.attention.sharding import contiguous_layout, shard, zigzag_layout  # noqa: E402
from flexorch.workers.process_groups import ProcessGroupRegistry  # noqa: E402

METHODS = {
    "ulysses": (ulysses_attn_varlen_func, contiguous_layout),
    "ring": (zigzag_ring_attn_varlen_func, zigzag_layout),
}


def case_lengths(name: str, tokens: int, seed: int = 0) -> list[int]:
    """Document lengths of a benchmark case (they sum to ``tokens``)."""
    if name == "1 long doc":
        return [tokens]
    if name == "many short":
        return [64] * (tokens // 64) + ([tokens % 64] if tokens % 64 else [])
    # long tail: log-normal lengths (median ~150 tokens, a few in the thousands), capped at half the batch.
    rng, lengths, left = random.Random(seed), [], tokens
    while left > 0:
        n = min(left, tokens // 2, max(1, int(rng.lognormvariate(5.0, 1.4))))
        lengths.append(n)
        left -= n
    return lengths


CASES = ("1 long doc", "many short", "long tail")


def causal_flops(lengths: list[int], heads: int, head_dim: int) -> float:
    """fwd+bwd FLOPs of causal attention: fwd 2 matmuls of s^2/2 * h * hd MACs each, bwd 2.5x fwd."""
    fwd = sum(2 * 2 * s * s / 2 * heads * head_dim for s in lengths)
    return 3.5 * fwd


class CommCounter:
    """Counts bytes this rank sends through the two communication calls the SP methods use."""

    def __init__(self) -> None:
        self.bytes = 0
        a2a, p2p = dist.all_to_all_single, dist.batch_isend_irecv

        def all_to_all_single(output, input, *a, group=None, **kw):
            n = dist.get_world_size(group)
            self.bytes += input.numel() * input.element_size() * (n - 1) // n
            return a2a(output, input, *a, group=group, **kw)

        def batch_isend_irecv(ops):
            self.bytes += sum(op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is dist.isend)
            return p2p(ops)

        dist.all_to_all_single, dist.batch_isend_irecv = all_to_all_single, batch_isend_irecv


def _inputs(lengths, args, device, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    shapes = [
        (t, args.heads, args.head_dim),
        (t, args.kv_heads, args.head_dim),
        (t, args.kv_heads, args.head_dim),
    ]
    q, k, v, dout = (torch.randn(*s, generator=gen).to(device, dtype) for s in [*shapes, shapes[0]])
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    return q, k, v, dout, offsets


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def bench_single(lengths, args, device, dtype) -> float:
    q, k, v, dout, offsets = _inputs(lengths, args, device, dtype, 0)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    cu = torch.tensor(offsets, dtype=torch.int32, device=device)
    for i in range(1 + args.reps):
        if i == 1:
            _sync(device)
            t0 = time.perf_counter()
        varlen_attn_func(q, k, v, cu).backward(dout)
    _sync(device)
    return (time.perf_counter() - t0) / args.reps


def _sp_worker(rank, d, port, args, out_q):
    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.set_num_threads(args.threads)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    with ProcessGroupRegistry(store=store, rank=rank, world_size=d, epoch=0, backend=backend, timeout_s=600) as reg:
        group, counter = reg.world, CommCounter()
        for case in args.cases:
            lengths = case_lengths(case, args.tokens)
            for method, (fn, layout_fn) in METHODS.items():
                if method == "ulysses" and args.heads % d:
                    continue
                q, k, v, dout, offsets = _inputs(lengths, args, "cpu", dtype, 0)
                layout = layout_fn(offsets, rank, d)
                q, k, v = (shard(x, layout).to(device).requires_grad_() for x in (q, k, v))
                dout = shard(dout, layout).to(device)
                cu = layout.cu_seqlens.to(device)
                for i in range(1 + args.reps):
                    _sync(device)
                    dist.barrier(group)
                    if i == 1:
                        counter.bytes, t0 = 0, time.perf_counter()
                    fn(q, k, v, cu, layout.max_seqlen, group).backward(dout)
                _sync(device)
                dist.barrier(group)
                elapsed, sent = (time.perf_counter() - t0) / args.reps, counter.bytes / args.reps
                if rank == 0:
                    out_q.put((case, method, d, elapsed, sent, layout.cu_seqlens[-1].item()))
                    print(f"  [d={d}] {case:<11} {method:<7} {elapsed * 1e3:8.1f} ms", flush=True)


def bench_sp(d, args) -> list[tuple]:
    ctx = mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    out_q = ctx.Queue()
    procs = [ctx.Process(target=_sp_worker, args=(r, d, store.port, args, out_q)) for r in range(d)]
    for p in procs:
        p.start()
    rows, expected = [], len(args.cases) * (2 if args.heads % d == 0 else 1)
    while len(rows) < expected:
        if not any(p.is_alive() for p in procs) and out_q.empty():
            raise RuntimeError(f"degree {d}: workers exited after {len(rows)} of {expected} results")
        try:
            rows.append(out_q.get(timeout=1))
        except Exception:
            pass
    for p in procs:
        p.join(timeout=60)
    return rows


def model_mb(tokens, d, method, args) -> str:
    """The planner's bytes-per-device estimate for this shape (solver.cost_model), or n/a if unavailable."""
    try:
        from flexorch.solver.cost_model import comm_bytes
        from flexorch.solver.profiles import Profile

        profile = Profile(
            name="bench",
            a1_ms=0.0,
            a2_ms=0.0,
            b1_ms=0.0,
            act_bytes_per_token=1.0,
            memory_budget_bytes=1.0,
            num_layers=1,
            hidden=args.heads * args.head_dim,
            num_heads=args.heads,
            num_kv_heads=args.kv_heads,
            a2a_gbps={d: 1.0},
            bytes_per_element=2 if args.device == "cuda" else 4,
        )
        return f"{comm_bytes(tokens, d, method, profile) / 1e6:.1f}"
    except Exception:
        return "n/a"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192, help="tokens in the packed batch")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--degrees", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--reps", type=int, default=2, help="timed iterations per case (after 1 warm-up)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process (CPU)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES), help="which cases to run")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if args.device == "cuda" else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.set_num_threads(args.threads)
    if device.type == "cuda":
        args.degrees = [d for d in args.degrees if d <= torch.cuda.device_count()]
    print(
        f"{args.tokens} tokens, {args.heads} heads ({args.kv_heads} KV) x {args.head_dim}, {dtype}, "
        f"{device}, {args.threads} thread(s)/process, degrees {args.degrees}",
        flush=True,
    )
    base = {}
    for case in args.cases:
        base[case] = bench_single(case_lengths(case, args.tokens), args, device, dtype)
        print(f"  [d=1] {case:<11} single  {base[case] * 1e3:8.1f} ms", flush=True)
    rows = [(case, "single", 1, base[case], 0.0, args.tokens) for case in args.cases]
    for d in args.degrees:
        rows += bench_sp(d, args)
    peak = matmul_tflops(device) if device.type == "cuda" else None
    head = f"{'case':<11} {'method':<8} {'d':>2} {'ms fwd+bwd':>10} {'tokens/s':>10} {'speedup':>7}"
    head += f" {'MB sent/rank':>12}"
    head += f" {'model MB':>8}" + (f" {'TFLOP/s':>8} {'% matmul':>8}" if peak else "")
    print("\n" + head + "\n" + "-" * len(head))
    order = {"single": 0, "ulysses": 1, "ring": 2}
    for case in args.cases:
        lengths = case_lengths(case, args.tokens)
        for c, method, d, sec, sent, padded in sorted(
            (r for r in rows if r[0] == case), key=lambda r: (r[2], order[r[1]])
        ):
            line = f"{c:<11} {method:<8} {d:>2} {sec * 1e3:10.1f} {args.tokens / sec:10.0f}"
            line += f" {base[c] / sec:6.2f}x"
            line += f" {sent / 1e6:12.2f} {model_mb(padded, d, method, args) if d > 1 else '-':>8}"
            if peak:
                tf = causal_flops(lengths, args.heads, args.head_dim) / sec / 1e12
                line += f" {tf:8.1f} {100 * tf / peak:7.0f}%"
            print(line)
    shapes = {c: (len(case_lengths(c, args.tokens)), max(case_lengths(c, args.tokens))) for c in args.cases}
    print(f"\ndocuments per case (count, longest): {shapes}")
    if peak:
        print(f"measured bf16 matmul: {peak:.0f} TFLOP/s")


if __name__ == "__main__":
    raise SystemExit(run_main(main, "measured/attention"))
