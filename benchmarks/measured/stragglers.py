"""Speed-aware plans against speed-blind ones with one of 4 workers throttled by a CPU quota, side by side in one run.

The quick start's job on a local Ray (``flexorch train``, 4 CPU worker actors, the tiny model, documents with the
bundled Wikipedia lengths written like ``benchmarks.measured.train.write_workload``, ``plan.profile = "auto"``) runs
with ``[plan] speeds = "aware"`` and ``"blind"``, alternating (``--rounds``), so both see the same machine load. In
each run, once ``--warmup`` steps are recorded, one worker (``--worker``, found by the ``pid`` its records' rank
entries carry) goes into a cgroup v1 CPU group (``/sys/fs/cgroup/cpu/NAME``, its process with all its threads
through ``cgroup.procs``) whose quota is ``--quota`` of each ``--period``: 2.5 ms of each 10 ms, a quarter of a
core, half of its fair share (4 workers on 2 cores). The period is short because the quota throttles in lumps of
it: with the kernel's default 100 ms period the worker runs at full speed for 25 ms, then not at all for 75, so its
micro-batches (40-400 ms here) slow down by 1.1x to 3x depending on where they fall, not by one factor
(``--period 100000 --quota 25000`` measures that case). After ``--throttled`` steps that ran wholly under the
quota, the quota is lifted (``cpu.cfs_quota_us = -1``) and the run trains ``--after`` more steps. The group is
removed at the end, whatever happened (a cgroup that still holds a task cannot be removed: the worker is moved
back to the root group first).

Prints, per run: the worker's pid (and whether it stayed the same process through the run), the median step time
(``measured_ms``) before the throttle (steps after the first two), under it and after the lift; the worker's share
of the step's tokens (its ``local_tokens`` over all ranks' ``local_tokens``) in each step; the speed its plans were
priced with under the throttle (``plan.topology.speeds``) and in how many of those steps another worker was priced
lower; the speed the run estimated for it (the records' ``ranks[i].speed``, median under the throttle); how many
steps after the lift its share took to be back within 20 % of an even share (the first step that began after the
lift counts as 1); the kernel's count of throttled periods (``cpu.stat``); and the losses' largest gap to the
single-process reference (``flexorch.testing.reference``: every run's losses must equal it, the script fails
otherwise). Then, per round, blind over aware of the median step time over the steps throttled in both runs (the
runs see the same batches in the same order, so the same steps are compared).

    python -m benchmarks.measured.stragglers                 # ~8 minutes on 2 cores, as root
    python -m benchmarks.measured.stragglers --quick         # one round, fewer steps
    python -m benchmarks.measured.stragglers --check-cgroup  # can this machine throttle a process? (2 s)

Sources: the cgroup v1 CFS bandwidth control (``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``, ``cpu.stat``'s
``nr_throttled``): the kernel's Documentation/scheduler/sched-bwc.rst; ``cgroup.procs`` moves a whole thread group:
Documentation/admin-guide/cgroup-v1/cgroups.rst.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import run_main
from benchmarks.measured.train import write_workload
from flexorch.records.writer import read_records

FLEXORCH = str(Path(sys.executable).with_name("flexorch"))
CPU_ROOT = Path("/sys/fs/cgroup/cpu")
PERIOD_US = 10_000
WORKERS = 4
SKIP = 2
"""Steps left out of the median before the throttle (the first compiles and warms up, the second may wait on it)."""
EVEN_WITHIN = 0.2
"""The share counts as back once it is within this fraction of an even share (1 / workers)."""


class CpuQuota:
    """A cgroup v1 CPU group with a bandwidth quota, for one process at a time; a context manager that removes the
    group on exit (moving what it still holds back to the root group first)."""

    def __init__(self, name: str, period_us: int = PERIOD_US, root: Path = CPU_ROOT):
        self.root, self.path, self.period_us = root, root / name, period_us

    def __enter__(self) -> CpuQuota:
        self.path.mkdir()
        (self.path / "cpu.cfs_period_us").write_text(str(self.period_us))
        return self

    def set_quota(self, quota_us: int) -> None:
        """``quota_us`` of CPU per period for everything in the group; -1: no limit."""
        (self.path / "cpu.cfs_quota_us").write_text(str(quota_us))

    def add(self, pid: int) -> int:
        """Move process ``pid`` with all its threads into the group; returns how many of its threads are in it."""
        (self.path / "cgroup.procs").write_text(str(pid))
        tasks = set((self.path / "tasks").read_text().split())
        return sum(1 for t in os.listdir(f"/proc/{pid}/task") if t in tasks)

    def stat(self) -> dict[str, int]:
        """``cpu.stat``: nr_periods, nr_throttled, throttled_time (ns)."""
        return {k: int(v) for k, v in (line.split() for line in (self.path / "cpu.stat").read_text().splitlines())}

    def __exit__(self, *exc) -> None:
        if not self.path.exists():
            return
        try:
            self.set_quota(-1)
        except OSError:
            pass
        for pid in (self.path / "cgroup.procs").read_text().split():
            try:
                (self.root / "cgroup.procs").write_text(pid)
            except OSError:  # it ended meanwhile
                pass
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except OSError:  # a task that was ending may hold it a moment longer
                time.sleep(0.1)
        print(f"warning: could not remove {self.path}")


def unavailable_reason() -> str | None:
    """Why a CPU quota cannot be set here (None: it can)."""
    if os.geteuid() != 0:
        return "not root"
    if not (CPU_ROOT / "cpu.cfs_quota_us").exists():
        return f"no cgroup v1 cpu controller at {CPU_ROOT}"
    return None


def check_cgroup(quota_us: int, period_us: int) -> int:
    """Throttle a busy child for 2 s and print the CPU share it got: the quota works here if it is near
    ``quota_us / period_us``."""
    child = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        with CpuQuota(f"flexorch-stragglers-check-{os.getpid()}", period_us) as group:
            group.set_quota(quota_us)
            threads = group.add(child.pid)
            t0, c0 = time.monotonic(), _cpu_s(child.pid)
            time.sleep(2.0)
            share = (_cpu_s(child.pid) - c0) / (time.monotonic() - t0)
            stat = group.stat()
    finally:
        child.kill()
        child.wait()
    print(
        f"a busy process with {threads} thread(s) in a group of quota {quota_us}/{period_us} us got {share:.2f} "
        f"of a core over 2 s (expected <= {quota_us / period_us:.2f}); throttled in {stat['nr_throttled']} of "
        f"{stat['nr_periods']} periods"
    )
    return 0 if share <= quota_us / period_us * 1.2 + 0.02 else 1


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _config(root: Path, corpus: Path, args, speeds: str) -> Path:
    path = root / f"{speeds}.toml"
    path.write_text(
        f"steps = {args.steps}\nworkers = {WORKERS}\nbatch_size = {args.batch}\nseed = 0\n"
        f'[model]\npreset = "tiny"\n'
        f"[data]\nsource = '{corpus}'\nmax_context = {args.max_context}\n"
        f'[plan]\nprofile = "auto"\ntokens_per_worker = {args.tokens_per_worker}\ntime_limit_s = {args.time_limit}\n'
        f'speeds = "{speeds}"\n' + (f'refit = "{args.refit}"\n' if args.refit else "")
    )
    return path


def _read_new(path: Path, seen: list[dict], offset: int) -> int:
    """Append the whole lines of ``path`` past ``offset`` to ``seen`` (train records only); the new offset."""
    if not path.exists():
        return offset
    with path.open("rb") as f:
        f.seek(offset)
        data = f.read()
    end = data.rfind(b"\n") + 1
    for line in data[:end].splitlines():
        rec = json.loads(line)
        if rec.get("source") == "train" and not rec.get("skipped"):
            seen.append(rec)
    return offset + end


def _entry(rec: dict, worker: int) -> dict | None:
    ids = rec.get("worker_ids") or []
    return rec["ranks"][ids.index(worker)] if worker in ids and rec.get("ranks") else None


def _share(rec: dict, worker: int) -> float | None:
    """The worker's ``local_tokens`` over all ranks' in the step (None: it was not in the step)."""
    mine = _entry(rec, worker)
    total = sum(e.get("local_tokens") or 0 for e in rec["ranks"] if e)
    return None if mine is None or not total else (mine.get("local_tokens") or 0) / total


def _even(share: float | None) -> bool:
    """Within ``EVEN_WITHIN`` of an even share of the step's tokens."""
    return share is not None and abs(share * WORKERS - 1) <= EVEN_WITHIN


def _priced(rec: dict, worker: int) -> tuple[float, float]:
    """The speed the step's plan was priced with for ``worker`` and the lowest it gave any other worker (1.0 each
    without speeds in the plan's topology)."""
    ids = rec.get("worker_ids") or []
    speeds = ((rec.get("plan") or {}).get("topology") or {}).get("speeds") or [1.0] * len(ids)
    mine = speeds[ids.index(worker)] if worker in ids else 1.0
    return mine, min((s for w, s in zip(ids, speeds, strict=True) if w != worker), default=1.0)


def _window(rec: dict) -> tuple[float, float]:
    """When the step began and ended (unix s), from its record: written after ``overhead_ms`` of bookkeeping that
    follows the ``measured_ms`` from dispatch to the last outcome."""
    end = rec["time"] - (rec.get("overhead_ms") or 0.0) / 1e3
    return end - rec["measured_ms"] / 1e3, end


def _stop(proc: subprocess.Popen) -> None:
    """End the `flexorch train` process this script started, and its process group (its local Ray)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _run(args, config: Path, run_dir: Path, tag: str) -> dict:
    """One `flexorch train` run with the worker throttled, then lifted; what it measured."""
    log = run_dir.with_suffix(".log")
    cmd = [FLEXORCH, "train", "--config", str(config), "--run-dir", str(run_dir)]
    seen: list[dict] = []
    offset, pid, threads, t_throttle, t_lift, stat = 0, None, 0, None, None, {}
    t0 = time.monotonic()
    with log.open("w") as out, CpuQuota(f"flexorch-stragglers-{os.getpid()}-{tag}", args.period) as group:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            while True:
                done = proc.poll() is not None
                offset = _read_new(run_dir / "steps.jsonl", seen, offset)
                if t_throttle is None and len(seen) >= args.warmup:
                    pid = (_entry(seen[-1], args.worker) or {}).get("pid")
                    if pid is None:
                        raise RuntimeError(f"step {seen[-1]['step']}: no pid recorded for worker {args.worker}")
                    group.set_quota(args.quota)
                    threads = group.add(pid)
                    t_throttle = time.time()
                elif t_lift is None and t_throttle is not None:
                    if sum(1 for r in seen if _window(r)[0] >= t_throttle) >= args.throttled:
                        stat = group.stat()
                        group.set_quota(-1)
                        t_lift = time.time()
                if done:
                    break
                if time.monotonic() - t0 > args.timeout:
                    raise RuntimeError(f"{tag}: no end after {args.timeout:.0f} s")
                time.sleep(0.1)
            if proc.returncode != 0:
                print(log.read_text()[-4000:])
                raise RuntimeError(f"{tag}: flexorch train exited {proc.returncode}")
            stat = stat or group.stat()
        finally:
            _stop(proc)
    return {"records": seen, "pid": pid, "threads": threads, "t_throttle": t_throttle, "t_lift": t_lift,
            "stat": stat, "seconds": time.monotonic() - t0}  # fmt: skip


def _loss_gap(config: Path, corpus: Path, args, records: list[dict], cache: dict) -> float:
    """The losses' largest relative gap to the single-process reference on the same batches (``cache``: the
    reference's losses by the batches' documents; every run trains the same batches in the same order)."""
    from flexorch.config import CorpusConfig, load_train_config
    from flexorch.data.corpus import load_corpus
    from flexorch.testing.reference import reference_train

    key = tuple(tuple(r["doc_ids"]) for r in records)
    if key not in cache:
        cfg = load_train_config(config, {})
        loaded = load_corpus(CorpusConfig(source=str(corpus), max_context=args.max_context))
        cache[key], _ = reference_train(cfg.model, cfg.optim, [loaded.get_stored(r["doc_ids"]) for r in records], 0)
    return max(abs(r["loss"] - x) / max(abs(x), 1e-9) for r, x in zip(records, cache[key], strict=True))


def _phases(run: dict, worker: int) -> dict:
    """Split a run's steps into before / throttled / after the lift, and the worker's share and speed in each."""
    recs, t_on, t_off = run["records"], run["t_throttle"], run["t_lift"]
    t_on = t_on if t_on is not None else float("inf")
    t_off = t_off if t_off is not None else float("inf")
    before = [r for r in recs[SKIP:] if _window(r)[1] <= t_on]
    under = [r for r in recs if _window(r)[0] >= t_on and _window(r)[1] <= t_off]
    after = [r for r in recs if _window(r)[0] >= t_off]
    back = next((i + 1 for i, r in enumerate(after) if _even(_share(r, worker))), None)
    speeds = [e.get("speed") for r in under if (e := _entry(r, worker)) and e.get("speed") is not None]
    priced = [_priced(r, worker) for r in under]
    pids = {e.get("pid") for r in recs if (e := _entry(r, worker))}
    return {
        "before": before,
        "under": under,
        "after": after,
        "back": back,
        "share_before": [_share(r, worker) for r in recs if _window(r)[1] <= t_on],
        "share_under": [_share(r, worker) for r in under],
        "share_after": [_share(r, worker) for r in after],
        "speed": statistics.median(speeds) if speeds else None,
        "priced": [p for p, _ in priced],
        "others_slower": sum(1 for p, other in priced if other < p),
        "pids": pids,
    }


def _med(recs: list[dict]) -> float:
    return statistics.median(r["measured_ms"] for r in recs) if recs else float("nan")


def _shares(xs) -> str:
    return " ".join("-" if s is None else f"{s:.2f}" for s in xs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="aware then blind, this many times (default 3)")
    ap.add_argument("--warmup", type=int, default=4, help="steps recorded before the throttle (default 4)")
    ap.add_argument("--throttled", type=int, default=8, help="steps wholly under the quota (default 8)")
    ap.add_argument("--after", type=int, default=6, help="steps after the lift (default 6)")
    ap.add_argument("--quota", type=int, default=2_500, help="us of CPU per period (default 2500)")
    ap.add_argument(
        "--period", type=int, default=PERIOD_US, help="cpu.cfs_period_us: the quota's period in us (default 10000)"
    )
    ap.add_argument("--worker", type=int, default=3, help="the worker id to throttle (default 3)")
    ap.add_argument("--batch", type=int, default=32, help="documents per step (default 32)")
    ap.add_argument("--max-context", type=int, default=2048)
    ap.add_argument("--tokens-per-worker", type=int, default=1024)
    ap.add_argument("--time-limit", type=float, default=0.5, help="[plan] time_limit_s of both runs (default 0.5)")
    ap.add_argument("--scale", type=float, default=1.0, help="document lengths divided by this (default 1)")
    ap.add_argument("--refit", choices=["on", "off"], help="[plan] refit (default: the run's own, 'auto')")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds one run may take (default 900)")
    ap.add_argument("--quick", action="store_true", help="one round, 6 steps throttled and 4 after")
    ap.add_argument("--check-cgroup", action="store_true", help="only check that a quota throttles a process here")
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.throttled, args.after = 1, 6, 4
    args.steps = args.warmup + args.throttled + args.after + 4  # the steps the throttle and the lift straddle, spare
    why = unavailable_reason()
    if why is not None:
        print(f"a CPU quota cannot be set here: {why}")
        return 2
    if args.check_cgroup:
        return check_cgroup(args.quota, args.period)
    work = Path(tempfile.mkdtemp(prefix="flexorch-stragglers-"))
    corpus = work / "corpus"
    write_workload(corpus, args.batch * (args.steps + 2), args.scale, args.max_context, seed=1)
    print(
        f"stragglers: 4 workers on a local Ray, {os.cpu_count()} CPUs; worker {args.worker} throttled to "
        f"{args.quota}/{args.period} us after {args.warmup} steps, for {args.throttled} steps, then lifted for "
        f"{args.after}; {args.steps} steps of {args.batch} documents (Wikipedia lengths / {args.scale:g}, <= "
        f"{args.max_context} tokens), {args.tokens_per_worker} tokens per worker, tiny model; load "
        f"{os.getloadavg()[0]:.2f}",
        flush=True,
    )
    rows, runs, references = [], {}, {}
    for rnd in range(args.rounds):
        for speeds in ("aware", "blind"):
            config = _config(work, corpus, args, speeds)
            run = _run(args, config, work / f"run-{speeds}-{rnd}", f"{speeds}{rnd}")
            read_records(work / f"run-{speeds}-{rnd}" / "steps.jsonl", validate=True)
            gap = _loss_gap(config, corpus, args, run["records"], references)
            if gap > 1e-4:
                print(f"{speeds} round {rnd}: losses differ from the reference by {gap:.2e} (relative)")
                return 1
            ph = _phases(run, args.worker)
            runs[rnd, speeds] = ph
            rows.append((rnd, speeds, run, ph, gap))
            print(
                f"  round {rnd} {speeds}: worker {args.worker} pid {run['pid']} ({run['threads']} threads moved), "
                f"median step {_med(ph['before']):.0f} ms before, {_med(ph['under']):.0f} throttled "
                f"({len(ph['under'])} steps), {_med(ph['after']):.0f} after; its share before "
                f"[{_shares(ph['share_before'])}] throttled [{_shares(ph['share_under'])}] after the lift "
                f"[{_shares(ph['share_after'])}]; plans priced it at [{_shares(ph['priced'])}] under the quota, "
                f"another worker lower in {ph['others_slower']} of those steps ({run['seconds']:.0f} s)",
                flush=True,
            )
            if len(ph["pids"]) != 1:
                print(f"  note: worker {args.worker} ran as pids {sorted(ph['pids'], key=str)} in this run")
    print()
    print(f"{'round':>5} {'plans':>6} {'pid':>8} {'before ms':>9} {'thr. ms':>8} {'steps':>5} {'after ms':>8} "
          f"{'share thr.':>10} {'speed':>5} {'back in':>7} {'throttled':>11} {'loss gap':>8} {'run s':>5}")  # fmt: skip
    for rnd, speeds, run, ph, gap in rows:
        shares = [s for s in ph["share_under"] if s is not None]
        st = run["stat"]
        print(
            f"{rnd:5d} {speeds:>6} {run['pid']!s:>8} {_med(ph['before']):9.0f} {_med(ph['under']):8.0f} "
            f"{len(ph['under']):5d} {_med(ph['after']):8.0f} "
            f"{statistics.median(shares) if shares else float('nan'):10.2f} "
            f"{ph['speed'] if ph['speed'] is not None else float('nan'):5.2f} "
            f"{ph['back'] if ph['back'] is not None else 'never':>7} "
            f"{st.get('nr_throttled', 0):>4}/{st.get('nr_periods', 0):<6} {gap:8.1e} {run['seconds']:5.0f}"
        )
    print()
    ratios = []
    for rnd in range(args.rounds):
        aware, blind = runs[rnd, "aware"], runs[rnd, "blind"]
        both = {r["step"] for r in aware["under"]} & {r["step"] for r in blind["under"]}
        a = _med([r for r in aware["under"] if r["step"] in both])
        b = _med([r for r in blind["under"] if r["step"] in both])
        ratios.append(b / a)
        print(
            f"round {rnd}: over the {len(both)} steps throttled in both runs ({min(both, default=0)}-"
            f"{max(both, default=0)}), median step {a:.0f} ms aware, {b:.0f} ms blind: blind/aware {b / a:.2f}x; "
            f"the share back within {EVEN_WITHIN:.0%} of even {aware['back']} step(s) after the lift aware, "
            f"{blind['back']} blind"
        )
    backs = [runs[k]["back"] for k in runs if k[1] == "aware"]
    print(
        f"blind/aware throttled, per round: {', '.join(f'{x:.2f}x' for x in ratios)} (median "
        f"{statistics.median(ratios):.2f}x; the issue asks >= 1.25x); aware share back after the lift in "
        f"{', '.join(str(x) for x in backs)} step(s) (the issue asks <= 3); load at the end {os.getloadavg()[0]:.2f}"
    )
    print(
        "thr. ms: median step time under the quota; share thr.: the worker's median share of the step's tokens "
        "under the quota (even: 0.25); speed: the run's estimate for it under the quota (median); back in: steps "
        "after the lift until its share is within 20 % of even (1 = the first step begun after the lift); "
        "throttled: periods the kernel throttled its group / periods it ran; loss gap: largest relative gap to "
        "the single-process reference"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main(main, "measured/stragglers"))
