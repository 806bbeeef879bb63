"""The planner on nodes (a benchmark, not a test): topology-aware against blind plans after a worker is lost, and
hybrid groups allowed or not, every plan priced by the topology-aware cost model.

Clusters of 64, 256 and 1,024 GPUs in nodes of 8 (NVLink inside, InfiniBand across: the built-in A100 tables,
``flexorch.solver.profiles``), one worker lost in the middle of the rank order (node ``nodes // 2 - 1`` keeps 7), so
every rank after it shifts by one and rank-order blocks straddle node boundaries. Per step, on the same batch:

- ``aware``: ``StepPlanner.plan(..., topology=...)``: groups priced where they will lie, placed inside nodes where
  they fit, hybrid groups (Ulysses 8 inside a node x ring across nodes) where they span nodes;
- ``blind``: the same planner without the topology (``[plan] topology = "blind"``), its plan then run on the nodes:
  the same groups on the same ranks, priced where they lie (``solver.simulator.step_time_ms`` of the plan with the
  topology): a group across a node boundary pays the inter-node figures;
- ``no hybrid``: topology-aware, hybrid groups not offered (``PlannerConfig(hybrid=False)``).

Ratios per step: ``blind / aware`` and ``no-hybrid / aware`` (above 1: the aware planner's plan is faster), median and
worst (the step where the aware plan gains most; below 1 would be a step it loses).

Models: ``7b-mha`` is FlexSP's GPT-7B (``gpt-7b-a100``: 32 heads, 32 KV heads). ``llama3-8b`` is the same profile
scaled to Llama-3-8B's shape: 32 layers, hidden 4096, 32 heads, 8 KV heads (the ring and the all-to-alls move a
quarter of the K/V bytes), ``a2`` (the per-token linear term) times 6.98 / 6.44, the ratio of non-embedding
parameters (Llama-3-8B: 32 x (4096^2 x 2.5 + 3 x 4096 x 14336); GPT-7B: 32 x 12 x 4096^2), ``a1`` (attention
scores: same layers, same hidden) and the activation bytes per token kept.
Lengths: the bundled Wikipedia lengths, and ``code``, the byte lengths of the Python standard library's ``.py`` files
(a code distribution), both at most the setting's context. Batches from ``flexorch.data.stream.DocumentStream``.

    python -m benchmarks.sim.topology            # 3 steps per setting, all six settings (~10 minutes on 2 cores)
    python -m benchmarks.sim.topology --quick    # 1 step of the 64- and 256-GPU settings
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sysconfig
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402

from benchmarks.common import run_main  # noqa: E402
from flexorch.data.lengths import bundled_lengths_path, read_lengths  # noqa: E402
from flexorch.data.stream import DocumentStream  # noqa: E402
from flexorch.solver import PlannerConfig, get_profile  # noqa: E402
from flexorch.solver.simulator import step_time_ms  # noqa: E402
from flexorch.solver.step_planner import StepPlanner  # noqa: E402
from flexorch.solver.topology import Topology  # noqa: E402
from flexorch.solver.validation import largest_degree  # noqa: E402

K = 1024
SETTINGS = (  # (GPUs, model, lengths, context, batch, planner budget s)
    (64, "llama3-8b", "wiki", 128 * K, 256, 1.0),
    (64, "7b-mha", "code", 128 * K, 256, 1.0),
    (256, "llama3-8b", "code", 256 * K, 512, 1.5),
    (256, "7b-mha", "wiki", 384 * K, 512, 1.5),
    (1024, "llama3-8b", "wiki", 384 * K, 1024, 2.0),
    (1024, "7b-mha", "code", 256 * K, 1024, 2.0),
)


def profile_of(model: str):
    base = get_profile("gpt-7b-a100")
    if model == "7b-mha":
        return base
    layer_llama = 4096**2 * 2.5 + 3 * 4096 * 14336
    layer_gpt = 12 * 4096**2
    return base.with_overrides(name="llama3-8b-a100", num_kv_heads=8, a2_ms=base.a2_ms * layer_llama / layer_gpt)


def lengths_of(source: str) -> np.ndarray:
    if source == "wiki":
        return read_lengths(bundled_lengths_path())
    root = Path(sysconfig.get_paths()["stdlib"])
    return np.array([p.stat().st_size for p in root.rglob("*.py") if p.stat().st_size > 0], dtype=np.int64)


def lost_one(gpus: int) -> Topology:
    """Nodes of 8, the node in the middle of the rank order one worker short."""
    sizes = [8] * (gpus // 8)
    sizes[len(sizes) // 2 - 1] = 7
    return Topology(tuple(sizes))


def run_setting(gpus, model, source, context, batch, budget, steps) -> dict:
    profile = profile_of(model)
    topo = lost_one(gpus)
    n = topo.num_devices
    data = lengths_of(source)
    data = data[(data > 0) & (data <= min(context, largest_degree(n) * profile.tokens_per_device))]
    stream = DocumentStream(data.size, batch, seed=0)
    cfg = PlannerConfig(time_limit_s=budget)
    out = {"blind": [], "nohybrid": [], "aware_ms": [], "hybrid_groups": 0, "straddling": 0, "solve_s": []}
    with StepPlanner(profile, cfg) as aware, StepPlanner(profile, dataclasses.replace(cfg, hybrid=False)) as flat:
        for _ in range(steps):
            seqs = data[list(stream.next_batch().doc_ids)]
            t0 = time.perf_counter()
            a = aware.plan(seqs, n, with_baselines=False, topology=topo)
            out["solve_s"].append(time.perf_counter() - t0)
            b = aware.plan(seqs, n, with_baselines=False)  # blind: no topology
            c = flat.plan(seqs, n, with_baselines=False, topology=topo)
            blind_ms = step_time_ms(dataclasses.replace(b.plan, topology=topo), profile)
            out["aware_ms"].append(a.predicted_ms)
            out["blind"].append(blind_ms / a.predicted_ms)
            out["nohybrid"].append(c.predicted_ms / a.predicted_ms)
            out["hybrid_groups"] += sum(g.kind == "hybrid" for mb in a.plan.micro_batches for g in mb.groups)
            out["straddling"] += sum(topo.spans(g.ranks) and g.degree <= 8 for mb in b.plan.micro_batches
                                     for g in mb.groups)  # fmt: skip
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3, help="steps per setting")
    ap.add_argument("--quick", action="store_true", help="1 step of the 64- and 256-GPU settings")
    args = ap.parse_args(argv)
    settings = [s for s in SETTINGS if not args.quick or s[0] <= 256]
    steps = 1 if args.quick else args.steps
    print(f"topology: {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}; nodes of 8, node nodes/2-1 short one")
    print(
        f"{'GPUs':>5} {'model':>10} {'data':>5} {'ctx':>5} {'batch':>5} {'budget':>6} {'steps':>5} "
        f"{'aware ms':>9} {'blind/aware med':>15} {'worst':>6} {'no-hybrid/aware med':>19} {'worst':>6} "
        f"{'hybrid grp':>10} {'blind straddling':>16} {'solve s':>7}"
    )
    for gpus, model, source, context, batch, budget in settings:
        r = run_setting(gpus, model, source, context, batch, budget, steps)
        print(
            f"{gpus - 1:>5} {model:>10} {source:>5} {context // K:>4}K {batch:>5} {budget:>6.1f} {steps:>5} "
            f"{np.median(r['aware_ms']):>9.0f} {np.median(r['blind']):>14.3f}x {max(r['blind']):>5.2f}x "
            f"{np.median(r['nohybrid']):>18.3f}x {max(r['nohybrid']):>5.2f}x {r['hybrid_groups']:>10} "
            f"{r['straddling']:>16} {np.median(r['solve_s']):>7.2f}",
            flush=True,
        )
    print(
        "blind/aware, no-hybrid/aware: step time of that plan over the topology-aware plan's, both priced on the "
        "nodes (>1: aware is faster); worst = the largest ratio over the steps. hybrid grp: hybrid groups in the aware "
        "plans; blind straddling: groups of <= 8 ranks the blind plans put across a node boundary."
    )
    print(f"load at the end {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main(main, "sim/topology"))
