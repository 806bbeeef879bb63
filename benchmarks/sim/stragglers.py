"""Slow and fast workers (a benchmark, not a test): speed-aware against speed-blind plans on a cluster whose devices
do not all run at one pace, every plan priced at the true speeds.

Clusters of 64, 256 and 1,024 GPUs in nodes of 8 (NVLink inside, InfiniBand across: FlexSP's A100 tables,
``flexorch.solver.profiles``, profile ``gpt-7b-a100``, FlexSP's GPT-7B). Four scenarios, each a speed per rank
(``Topology.speeds``, relative; a group runs at its slowest member's pace, ``solver.simulator``):

- ``gpu 0.5x``: one GPU (local rank 3 of node ``nodes // 2``) at half speed (a throttled GPU, a busy host);
- ``gpu 0.8x``: the same GPU at 0.8x (the console's "slow" threshold, ``solver.worker_speeds.SLOW_BELOW``);
- ``node 0.7x``: all 8 GPUs of node ``nodes // 2`` at 0.7x (a node's power cap, a shared host);
- ``half H100``: the last half of the nodes in rank order H100s among A100s, at 989 / 312 = 3.17x: the datasheets'
  dense bf16 rates (NVIDIA H100 SXM5 989.4 TFLOP/s, A100 SXM4 312 TFLOP/s). Not normalised to the median: the A100s
  stay at 1.0, so every time in the row is comparable to the all-A100 cluster's (``uniform``). The planner's choices
  do not depend on that scale (every price divides by a speed). The cost model's step costs (``profile.step_ms``:
  gradient sync, optimizer) do not scale with speed.

Per step, on the same batch (``flexorch.data.stream.DocumentStream``, seed 0):

- ``aware``: ``StepPlanner.plan(..., topology=Topology(nodes, speeds=...))``: the planner prices each group at its
  slowest rank's pace and moves work off slow ranks (``solver.paced``);
- ``blind``: the same planner on the same nodes without the speeds (``[plan] speeds = "blind"``), its plan then run
  at the true speeds: the same groups on the same ranks, priced by ``solver.simulator.step_time_ms`` of the plan with
  the speeds (``dataclasses.replace(plan, topology=with_speeds)``). One blind plan per batch serves every scenario;
  priced without speeds it is ``uniform``, the step on a cluster of equal A100s.

Columns: ``blind/aware`` per step, median, min and max over the steps (above 1: the speed-aware plan is faster; the
max is the blind planner's worst step, a min below 1 a step the aware plan loses); ``aware/uni``: the aware step over
the uniform one; ``N/sum(s)``: the uniform cluster's capacity over this one's (64 GPUs, one at 0.5x: 64 / 63.5), the
``aware/uni`` that spreading the uniform plan's work perfectly would give (``profile.step_ms`` is 0 here); ``work``:
busy time per rank at nominal speed (the plan's groups priced on the nodes without speeds) on the affected ranks
(the slow GPU or node, the H100s) over the others', in the blind and the aware plans (inf: the others idle).

Lengths: the bundled Wikipedia lengths (FlexSP's public release), and ``code``, the byte lengths of the Python
standard library's ``.py`` files (a code distribution, as a byte-level tokenizer sees the files), both at most the
setting's context, as ``benchmarks/sim/topology.py`` and ``benchmarks/sim/planner_quality.py`` draw them; contexts
and global batches are theirs.

    python -m benchmarks.sim.stragglers            # 5 / 4 / 3 steps at 64 / 256 / 1,024 GPUs (a few minutes)
    python -m benchmarks.sim.stragglers --quick    # 1 step of the 64- and 256-GPU settings
    python -m benchmarks.sim.stragglers --steps 2 --gpus 64 --budget-scale 2

The planner's budget is wall time (1, 1.5 and 2 s at 64, 256 and 1,024 GPUs, as in ``benchmarks/sim/topology.py``):
on a loaded machine both planners find worse plans, and the ratios move by tens of percent from run to run; the
results file gives the load.
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
from flexorch.solver.simulator import group_timings, step_time_ms  # noqa: E402
from flexorch.solver.step_planner import StepPlanner  # noqa: E402
from flexorch.solver.topology import Topology  # noqa: E402
from flexorch.solver.validation import largest_degree  # noqa: E402

K = 1024
PER_NODE = 8
H100_OVER_A100 = 989.4 / 312.0  # dense bf16 TFLOP/s, NVIDIA's H100 SXM5 and A100 SXM4 datasheets
SETTINGS = (  # (GPUs, lengths, context, global batch, planner budget s, steps)
    (64, "wiki", 384 * K, 512, 1.0, 5),  # planner_quality's wiki64 (FlexSP's GPT-7B setting)
    (64, "code", 128 * K, 256, 1.0, 5),  # topology's 64-GPU 7b-mha row
    (256, "wiki", 384 * K, 512, 1.5, 4),  # topology's 256-GPU 7b-mha row
    (256, "code", 256 * K, 512, 1.5, 4),  # topology's 256-GPU code row
    (1024, "wiki", 384 * K, 1024, 2.0, 3),  # topology's 1,024-GPU wiki row
    (1024, "code", 256 * K, 1024, 2.0, 3),  # topology's 1,024-GPU 7b-mha row
)
PROFILE = get_profile("gpt-7b-a100")
SCENARIOS = ("gpu 0.5x", "gpu 0.8x", "node 0.7x", "half H100")


def lengths_of(source: str) -> np.ndarray:
    if source == "wiki":
        return read_lengths(bundled_lengths_path())
    root = Path(sysconfig.get_paths()["stdlib"])
    return np.array([p.stat().st_size for p in root.rglob("*.py") if p.stat().st_size > 0], dtype=np.int64)


def scenario(name: str, gpus: int) -> tuple[tuple[float, ...], frozenset[int]]:
    """Each rank's speed for scenario ``name`` on ``gpus`` GPUs in nodes of 8, and the affected ranks."""
    nodes = gpus // PER_NODE
    mid = (nodes // 2) * PER_NODE  # first rank of node nodes // 2
    speeds = [1.0] * gpus
    if name in ("gpu 0.5x", "gpu 0.8x"):
        affected = {mid + 3}
        speeds[mid + 3] = 0.5 if name == "gpu 0.5x" else 0.8
    elif name == "node 0.7x":
        affected = set(range(mid, mid + PER_NODE))
        for r in affected:
            speeds[r] = 0.7
    elif name == "half H100":
        affected = set(range(mid, gpus))
        for r in affected:
            speeds[r] = H100_OVER_A100
    else:
        raise ValueError(f"unknown scenario {name!r}; known: {', '.join(SCENARIOS)}")
    return tuple(speeds), frozenset(affected)


def work_share(plan, affected: frozenset[int]) -> float:
    """Work per rank on ``affected`` over work per rank on the others: each rank's busy time at nominal speed (the
    plan's groups priced on its nodes without speeds, ``solver.simulator.group_timings``); inf when the others idle."""
    nominal = dataclasses.replace(plan, topology=plan.topology.without_speeds())
    load = np.zeros(plan.num_devices)
    for t in group_timings(nominal, PROFILE):
        load[t.first_rank : t.first_rank + t.degree] += t.time_ms
    mask = np.zeros(plan.num_devices, dtype=bool)
    mask[list(affected)] = True
    mine, others = load[mask].mean(), load[~mask].mean()
    return float(mine / others) if others > 0 else float("inf")


def run_setting(gpus, source, context, batch, budget, steps, scenarios=SCENARIOS) -> dict:
    """Plan ``steps`` batches blind once and aware per scenario; every figure per scenario, per step."""
    profile = PROFILE
    topo = Topology.uniform(gpus // PER_NODE, PER_NODE)
    data = lengths_of(source)
    data = data[(data > 0) & (data <= min(context, largest_degree(gpus) * profile.tokens_per_device))]
    stream = DocumentStream(data.size, batch, seed=0)
    cases = {name: scenario(name, gpus) for name in scenarios}
    out = {name: {"ratio": [], "aware": [], "blind": [], "uniform": [], "share_b": [], "share_a": [], "solve": []}
           for name in scenarios}  # fmt: skip
    with StepPlanner(profile, PlannerConfig(time_limit_s=budget)) as planner:
        for _ in range(steps):
            seqs = data[list(stream.next_batch().doc_ids)]
            blind = planner.plan(seqs, gpus, with_baselines=False, topology=topo)
            uniform_ms = step_time_ms(blind.plan, profile)
            for name, (speeds, affected) in cases.items():
                true = topo.with_speeds(speeds)
                t0 = time.perf_counter()
                aware = planner.plan(seqs, gpus, with_baselines=False, topology=true)
                solve_s = time.perf_counter() - t0
                aware_ms = step_time_ms(dataclasses.replace(aware.plan, topology=true), profile)
                blind_ms = step_time_ms(dataclasses.replace(blind.plan, topology=true), profile)
                o = out[name]
                o["ratio"].append(blind_ms / aware_ms)
                o["aware"].append(aware_ms)
                o["blind"].append(blind_ms)
                o["uniform"].append(uniform_ms)
                o["share_b"].append(work_share(blind.plan, affected))
                o["share_a"].append(work_share(aware.plan, affected))
                o["solve"].append(solve_s)
    for name, (speeds, _) in cases.items():
        out[name]["capacity"] = gpus / sum(speeds)
    return out


HEADER = (
    f"{'GPUs':>5} {'data':>5} {'ctx':>5} {'batch':>5} {'steps':>5} {'scenario':>10} {'uniform ms':>10} "
    f"{'blind ms':>9} {'aware ms':>9} {'blind/aware med':>15} {'min':>6} {'max':>6} {'aware/uni':>9} "
    f"{'N/sum(s)':>8} {'work blind':>10} {'work aware':>10} {'solve s':>7}"
)


def row(gpus, source, context, batch, steps, name, r) -> str:
    med = np.median
    return (
        f"{gpus:>5} {source:>5} {context // K:>4}K {batch:>5} {steps:>5} {name:>10} {med(r['uniform']):>10.0f} "
        f"{med(r['blind']):>9.0f} {med(r['aware']):>9.0f} {med(r['ratio']):>14.3f}x {min(r['ratio']):>5.2f}x "
        f"{max(r['ratio']):>5.2f}x {med(np.array(r['aware']) / np.array(r['uniform'])):>9.3f} "
        f"{r['capacity']:>8.3f} {med(r['share_b']):>10.2f} {med(r['share_a']):>10.2f} {med(r['solve']):>7.2f}"
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=None, help="steps per setting (default 5 / 4 / 3 by size)")
    ap.add_argument("--gpus", type=int, action="append", choices=(64, 256, 1024), help="only these sizes (repeat)")
    ap.add_argument("--quick", action="store_true", help="1 step of the 64- and 256-GPU settings")
    ap.add_argument("--budget-scale", type=float, default=1.0, help="planner budgets times this (1.0: 1 / 1.5 / 2 s)")
    args = ap.parse_args(argv)
    sizes = set(args.gpus or ((64, 256) if args.quick else (64, 256, 1024)))
    if args.steps is not None and args.steps < 1:
        ap.error("--steps must be >= 1")
    if not args.budget_scale > 0:
        ap.error("--budget-scale must be > 0")
    print(
        f"stragglers: {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}; gpt-7b-a100, nodes of 8; "
        f"H100 = {H100_OVER_A100:.2f}x an A100; planner budget 1 / 1.5 / 2 s x {args.budget_scale:g}"
    )
    print(HEADER)
    t0 = time.perf_counter()
    for gpus, source, context, batch, budget, default_steps in SETTINGS:
        if gpus not in sizes:
            continue
        steps = 1 if args.quick else (args.steps or default_steps)
        result = run_setting(gpus, source, context, batch, budget * args.budget_scale, steps)
        for name in SCENARIOS:
            print(row(gpus, source, context, batch, steps, name, result[name]), flush=True)
    print(
        "uniform: the blind plan on equal A100s; blind, aware: each plan priced at the true speeds (medians over the "
        "steps); blind/aware: per step (>1: speed-aware is faster), median, min, max; aware/uni: the aware step over "
        "the uniform one; N/sum(s): that ratio if the uniform plan's work were spread perfectly; work: busy time per "
        "rank at nominal speed on the slow GPU / slow node / H100s over the others' (inf: the others idle); solve s: "
        "the aware plan's wall time (median)."
    )
    print(f"load at the end {os.getloadavg()[0]:.2f}; {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main(main, "sim/stragglers"))
