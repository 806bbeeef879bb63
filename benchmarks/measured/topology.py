"""Topology-aware plans against blind ones on emulated hosts joined by a slow link, side by side in one run.

Two emulated hosts (``tests/emulated_hosts.py``: network namespaces on a bridge, a ``ray start`` node in each, the
hostname resolving to loopback in each) of 2 CPU slots, their links rate-limited (``--rate``, a ``tbf`` qdisc on both
ends). On that cluster ``flexorch train --address HEAD`` runs the same 4-worker job (Wikipedia-distributed document
lengths scaled to a CPU context, the tiny model, ``plan.profile = "auto"``: each run calibrates on its workers) with
``[plan] topology = "aware"`` and ``"blind"``, alternating (``--rounds``), so both see the same machine load:

* aware: ranks contiguous per host, groups placed and priced by host (calibrated inside a host and across), hybrid
  groups allowed;
* blind: ranks in worker-id order, every group priced as inside one node (as before topologies).

Prints, per run: how its ranks lay on the hosts, the median step time (steps after the first two; ``measured_ms``),
the groups of degree 2 that spanned the two hosts, the hybrid groups, and the losses' largest gap to the
single-process reference (``flexorch.testing.reference``); then the blind/aware ratio of the median step times per
round. Every run's losses must equal the reference (the script fails otherwise).

    python -m benchmarks.measured.topology             # ~8 minutes on 2 cores, as root
    python -m benchmarks.measured.topology --quick     # one round, fewer steps
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from benchmarks.common import ROOT, run_main
from benchmarks.measured.train import write_workload
from flexorch.config import CorpusConfig, load_train_config
from flexorch.data.corpus import load_corpus
from flexorch.records.writer import read_records
from flexorch.testing.reference import reference_train

FLEXORCH = str(Path(sys.executable).with_name("flexorch"))
SKIP = 2
"""Steps left out of each run's median (the first compiles and warms up, the second may still wait on it)."""


def _config(root: Path, corpus: Path, args, topology: str) -> Path:
    path = root / f"{topology}.toml"
    path.write_text(
        f"steps = {args.steps}\nworkers = 4\nbatch_size = {args.batch}\nseed = 0\n"
        f'[model]\npreset = "tiny"\n'
        f"[data]\nsource = '{corpus}'\nmax_context = {args.max_context}\n"
        f'[plan]\nprofile = "auto"\ntokens_per_worker = {args.tokens_per_worker}\ntime_limit_s = 0.5\n'
        f'topology = "{topology}"\n'
    )
    return path


def _train(hosts, config: Path, run_dir: Path, timeout_s: float) -> tuple[int | None, str]:
    cmd = [FLEXORCH, "train", "--address", hosts.head_address, "--config", str(config), "--run-dir", str(run_dir)]
    try:
        out = subprocess.run(cmd, env=hosts.client_env(), capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        return None, (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
    return out.returncode, out.stdout + out.stderr


def _spanning(records, degree: int) -> int:
    """Groups of ``degree`` whose ranks lay on two hosts, over every step."""
    n = 0
    for r in records:
        nodes = r["nodes"]
        for mb in r["plan"]["micro_batches"]:
            n += sum(1 for g in mb if g["degree"] == degree and len({nodes[i] for i in g["ranks"]}) > 1)
    return n


def _kinds(records) -> Counter:
    return Counter(g["kind"] for r in records for mb in r["plan"]["micro_batches"] for g in mb if g["degree"] > 1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", default="40mbit", help="the hosts' link rate (tc units), both ends (default 40mbit)")
    ap.add_argument("--rounds", type=int, default=2, help="aware then blind, this many times (default 2)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=12)
    ap.add_argument("--max-context", type=int, default=2048)
    ap.add_argument("--tokens-per-worker", type=int, default=512)
    ap.add_argument("--scale", type=float, default=2.0, help="document lengths divided by this (default 2)")
    ap.add_argument("--quick", action="store_true", help="one round of 6 steps")
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.steps = 1, 6
    sys.path.insert(0, str(ROOT))  # tests/emulated_hosts.py: the harness lives beside the tests
    from tests.emulated_hosts import EmulatedHosts, unavailable_reason

    why = unavailable_reason()
    if why is not None:
        print(f"emulated hosts cannot be made here: {why}")
        return 2
    work = Path(tempfile.mkdtemp(prefix="flexorch-topology-"))
    corpus = work / "corpus"
    write_workload(corpus, args.batch * (args.steps + 2), args.scale, args.max_context, seed=1)
    print(
        f"topology: 2 emulated hosts x 2 workers, link {args.rate}; {args.steps} steps of {args.batch} documents "
        f"(Wikipedia lengths / {args.scale:g}, <= {args.max_context} tokens), {args.tokens_per_worker} tokens per "
        f"worker, tiny model; load {os.getloadavg()[0]:.2f}"
    )
    rows, medians = [], {}
    with EmulatedHosts(2, workers_per_host=2, rate=args.rate) as hosts:
        host_of = {ip: f"h{i}" for i, ip in enumerate(hosts.host_ips)}
        for rnd in range(args.rounds):
            for topology in ("aware", "blind"):
                config = _config(work, corpus, args, topology)
                run_dir = work / f"run-{topology}-{rnd}"
                t0 = time.monotonic()
                rc, out = _train(hosts, config, run_dir, timeout_s=900)
                if rc != 0:
                    print(out[-4000:])
                    print(f"{topology} round {rnd}: flexorch train exited {rc}")
                    return 1
                records = read_records(run_dir / "steps.jsonl", validate=True)
                cfg = load_train_config(config, {})
                loaded = load_corpus(CorpusConfig(source=str(corpus), max_context=args.max_context))
                ref, _ = reference_train(cfg.model, cfg.optim, [loaded.get_stored(r["doc_ids"]) for r in records], 0)
                gap = max(abs(r["loss"] - x) / max(abs(x), 1e-9) for r, x in zip(records, ref, strict=True))
                if gap > 1e-4:
                    print(f"{topology} round {rnd}: losses differ from the reference by {gap:.2e} (relative)")
                    return 1
                steps = [r["measured_ms"] for r in records[SKIP:]]
                med = statistics.median(steps)
                medians.setdefault(rnd, {})[topology] = med
                layout = "".join(host_of.get(n, "?")[-1] for n in records[-1]["nodes"])
                kinds = _kinds(records)
                rows.append(
                    (rnd, topology, layout, med, min(steps), _spanning(records, 2), kinds.get("hybrid", 0),
                     dict(kinds), gap, time.monotonic() - t0)
                )  # fmt: skip
                print(
                    f"  round {rnd} {topology:5s}: ranks on hosts {layout}, median step {med:7.0f} ms, "
                    f"{rows[-1][5]} degree-2 groups across hosts ({time.monotonic() - t0:.0f} s)",
                    flush=True,
                )
    print()
    print(f"{'round':>5} {'plans':>6} {'rank->host':>10} {'median ms':>9} {'min ms':>7} {'2-span':>6} "
          f"{'hybrid':>6} {'SP groups by kind':>34} {'loss gap':>8} {'run s':>5}")  # fmt: skip
    for rnd, topology, layout, med, low, span2, hyb, kinds, gap, secs in rows:
        print(f"{rnd:5d} {topology:>6} {layout:>10} {med:9.0f} {low:7.0f} {span2:6d} {hyb:6d} "
              f"{json.dumps(kinds, sort_keys=True):>34} {gap:8.1e} {secs:5.0f}")  # fmt: skip
    ratios = [m["blind"] / m["aware"] for m in medians.values()]
    print(
        f"blind/aware median step time per round: {', '.join(f'{x:.2f}x' for x in ratios)} "
        f"(>1: the topology-aware plans are faster); load at the end {os.getloadavg()[0]:.2f}"
    )
    print(
        "rank->host: each rank's host in rank order at the last step; 2-span: groups of degree 2 whose ranks lay on "
        "both hosts, over all steps; loss gap: largest relative gap to the single-process reference"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main(main, "measured/topology"))
