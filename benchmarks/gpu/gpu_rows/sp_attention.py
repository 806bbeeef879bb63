"""c. SP attention, every rank on the one device: Ulysses and zigzag ring attention at each degree in spawned ranks of a
gloo world (NCCL refuses two ranks on one GPU), outputs and gradients against the single-device result
(rows ``c.<method>.d<degree>``)."""

from __future__ import annotations

import queue
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from .check import Check, Ctx, FailRow, Row, SkipRow, last_line
from .measure import long_tail, qkv, rel_error
from .sizes import TOLERANCE

__all__ = ["SP_BACKEND", "SP_METHODS", "run_sp_job", "section_sp", "sp_verdict"]

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
