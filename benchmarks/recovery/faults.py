"""``python -m benchmarks.recovery.recovery --faults``: what each kind of failure costs, from the fault to the next
trained step.

Faults, each hitting the run half-way through a step, under replicated, fsdp and hsdp model state:

- ``killed process``: SIGKILL of one worker process (its sockets close; Ray reports the actor dead at once).
- ``killed node``: SIGKILL of a node's raylet and its processes, the worker among them (a machine that crashed:
  Ray reports the node dead only when its health check gives up; the worker's peers see its sockets close).
- ``frozen worker``: SIGSTOP of one worker process (its sockets stay open: only its heartbeat tells).
- ``frozen node``: SIGSTOP of a node's raylet and every process on it (a power loss or a partition: nothing closes).
  Run twice: with Ray's default health check, and with it lowered (``--ray-health-check-ms``, a second cluster),
  where Ray's notice of the node's death comes before the heartbeat's timeout.
- ``lost driver``: SIGKILL of the TrainingDriver actor's process under ``flexorch train`` (``run_train``): a new
  driver resumes from the last checkpoint (one is written every step here) and trains the lost step again.
- ``drained node``: ``ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION --deadline-remaining-seconds 60`` of the
  node (a preemption notice) half-way through a step: its worker leaves at the next step boundary, handing off its
  shards under fsdp and hsdp. Nothing is lost or re-run: "total" is what the planned leave cost at that boundary
  (handoff and re-form), "detect" the time from the drain accepted to the driver seeing it.

Each row reads the phases from the step record (detect from the lost member's last heartbeat or the driver's last
answer, re-form or new driver, re-run) and checks the ledger (the trained documents are the stream's, none lost or
repeated). The node rows use a node of one CPU slot (its one worker); a new node replaces it after each.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import threading
import time
from pathlib import Path

import ray

from flexorch.config import ElasticSettings, ShardingSettings, TrainConfig
from flexorch.control.driver import TrainingDriver
from flexorch.records.writer import read_records

MODES = {"replicate": {}, "fsdp": {"mode": "fsdp"}, "hsdp": {"mode": "hsdp", "shard_size": 2}}


def _node_pids(node) -> list[int]:
    """Every live process of a ``ray.cluster_utils`` node: its raylet, agents and the workers its raylet started."""
    pids = {p.process.pid for infos in node.all_processes.values() for p in infos if p.process is not None}
    raylets = {p.process.pid for p in node.all_processes.get("raylet", ())}
    for d in Path("/proc").iterdir():  # worker processes are the raylet's children
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if ppid in raylets:
                pids.add(int(d.name))
    return sorted(pids)


class ClusterNodes:
    """The one-slot node the node faults hit, replaced by a fresh one after each trial."""

    def __init__(self, cluster, node):
        self.cluster, self.node, self.stopped = cluster, node, []

    def worker_on_node(self, driver: TrainingDriver) -> dict:
        infos = [i for i in driver.workers.call("info") if i["node_id"] == self.node.node_id]
        if len(infos) != 1:
            raise RuntimeError(f"expected one worker on the small node, found {len(infos)}")
        return infos[0]

    def kill(self, worker_pid: int) -> None:
        os.kill(worker_pid, signal.SIGKILL)
        for pid in _node_pids(self.node):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def freeze(self, worker_pid: int) -> None:
        self.stopped = sorted({worker_pid, *_node_pids(self.node)})
        for pid in self.stopped:
            try:
                os.kill(pid, signal.SIGSTOP)
            except ProcessLookupError:
                pass

    def replace(self) -> None:
        """End the hit node for good (a frozen one too) and add a fresh one-slot node."""
        for pid in self.stopped:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.stopped = []
        gone = self.node.node_id
        self.cluster.remove_node(self.node, allow_graceful=False)
        wait_node_dead(gone)  # else the next run's workers may be placed on the dead node's slot
        self.node = self.cluster.add_node(num_cpus=1)
        self.cluster.wait_for_nodes()


def step_in_thread(driver: TrainingDriver, *, until_record: bool = False) -> tuple[threading.Thread, dict]:
    """Start ``driver.step()`` in a thread: (the thread, a dict that gets the step's ``"record"`` or its ``"error"``).
    ``until_record``: step again while a step returns no record (fsdp: the lost shard had no copy, the run went back
    to the checkpoint; train the step again)."""
    out: dict = {}

    def run():
        try:
            t = driver.step()
            while until_record and t.record is None:
                t = driver.step()
            out["record"] = t.record
        except BaseException as e:  # noqa: BLE001 - reported to the caller
            out["error"] = e

    th = threading.Thread(target=run)
    th.start()
    return th, out


def trial_fault(cfg: TrainConfig, corpus, hit, warm: int, step_s: float) -> dict:
    """In place, with the run's own detection: ``hit(driver)`` strikes half-way through step ``warm + 1``. Wall time
    from the hit to the next completed step, and the record's phases."""
    driver = TrainingDriver(cfg, corpus=corpus)
    driver.setup()
    try:
        records = [driver.step().record for _ in range(warm)]
        arm = hit(driver)  # whatever the hit needs to know (a pid), found before the step starts
        th, out = step_in_thread(driver, until_record=True)
        time.sleep(step_s / 2)
        hit_at = time.perf_counter()
        arm()
        th.join()
        done_at = time.perf_counter()
        if "error" in out:
            raise out["error"]
        rec = out["record"]
        records.append(rec)
        lost = [r for r in rec["recoveries"] if r.get("lost")]
        phases = next((r for r in lost if "total_ms" in r), lost[0] if lost else {})
        return {
            "recovery_s": done_at - hit_at,
            "detected_by": phases.get("detected_by", "-"),
            "detect_s": phases.get("detect_ms", float("nan")) / 1e3,
            "reform_s": phases.get("recovery_ms", float("nan")) / 1e3,
            "rerun_s": phases.get("rerun_ms", float("nan")) / 1e3,
            "rolled_back": any(r.get("rollback") for r in rec["recoveries"]),
            "records": records,
        }
    finally:
        driver.shutdown()


class _Lines:
    """A file-like ``out`` for ``run_train`` that keeps each line with the time it was printed."""

    def __init__(self):
        self.lines: list[tuple[float, str]] = []
        self._buf = ""
        self.changed = threading.Condition()

    def write(self, s: str) -> int:
        self._buf += s
        while "\n" in self._buf:
            line, self._buf = self._buf.split("\n", 1)
            with self.changed:
                self.lines.append((time.perf_counter(), line))
                self.changed.notify_all()
        return len(s)

    def flush(self) -> None:
        pass

    def wait_for(self, pattern: str, start: int = 0, timeout_s: float = 300) -> tuple[int, float, re.Match]:
        deadline = time.monotonic() + timeout_s
        with self.changed:
            while True:
                for i in range(start, len(self.lines)):
                    m = re.search(pattern, self.lines[i][1])
                    if m:
                        return i, self.lines[i][0], m
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no line matching {pattern!r} within {timeout_s:g} s")
                self.changed.wait(left)


def trial_lost_driver(cfg: TrainConfig, warm: int, step_s: float) -> dict:
    """``flexorch train`` (``run_train`` in a thread): SIGKILL of the driver actor's process half-way through step
    ``warm + 1``; time from the kill to the step past the lost one, whose record has the restart's phases."""
    from flexorch.cli.train import run_train

    cfg = dataclasses.replace(cfg, steps=warm + 3)
    out, result = _Lines(), {}

    def run():
        try:
            result["summary"] = run_train(cfg, out=out)
        except BaseException as e:  # noqa: BLE001 - reported to the caller
            result["error"] = e

    th = threading.Thread(target=run)
    th.start()
    _, _, m = out.wait_for(r"driver and planner on .*\(pid (\d+)")
    pid = int(m[1])
    i, _, _ = out.wait_for(rf"^step +{warm}/")
    time.sleep(step_s / 2)
    killed_at = time.perf_counter()
    os.kill(pid, signal.SIGKILL)
    _, done_at, _ = out.wait_for(r"\[driver restarted", start=i)
    th.join()
    if "error" in result:
        raise result["error"]
    records = read_records(Path(cfg.run_dir) / "steps.jsonl")
    rec = next(x for r in records for x in r["recoveries"] if x.get("driver_restart"))
    return {
        "recovery_s": done_at - killed_at,
        "detected_by": "ray",
        "detect_s": rec["detect_ms"] / 1e3,
        "reform_s": rec["recovery_ms"] / 1e3,
        "rerun_s": rec["rerun_ms"] / 1e3,
        "rolled_back": True,  # a new driver always goes back to the last checkpoint
        "redone_steps": rec["redone_steps"],
        "records": records,
    }


def run_faults(args, base: TrainConfig, corpus, profile: str, step_s: float, cluster, small_node, check_ledger) -> list:
    """Every fault x sharding mode once, with the default detection settings; rows (fault, mode, result)."""
    nodes = ClusterNodes(cluster, small_node)

    def worker_signal(sig):
        def hit(driver):
            pid = driver.workers.call("info")[1]["pid"]
            return lambda: os.kill(pid, sig)

        return hit

    def node_fault(action):
        def hit(driver):
            pid = nodes.worker_on_node(driver)["pid"]
            return lambda: action(pid)

        return hit

    faults = {
        "killed process": (worker_signal(signal.SIGKILL), False),
        "killed node": (node_fault(nodes.kill), True),
        "frozen worker": (worker_signal(signal.SIGSTOP), False),
        "frozen node": (node_fault(nodes.freeze), True),
    }
    only = set(args.fault) if args.fault else None
    rows = []
    for fault, (hit, on_node) in faults.items():
        if only and fault not in only:
            continue
        for mode, sharding in MODES.items():
            cfg = _trial_config(base, args.out / f"{fault.replace(' ', '-')}-{mode}", profile, sharding)
            try:
                res = trial_fault(cfg, corpus, hit, args.warm, step_s)
            finally:
                if on_node:
                    nodes.replace()
            check_ledger(res.pop("records"), corpus.num_docs, cfg)
            rows.append((fault, mode, res))
            _say(fault, mode, res)
    if not only or "drained node" in only:
        rows += run_drains(args, base, corpus, profile, step_s, nodes, check_ledger)
    if not only or "lost driver" in only:
        for mode, sharding in MODES.items():
            cfg = _trial_config(base, args.out / f"lost-driver-{mode}", profile, sharding)
            res = trial_lost_driver(cfg, args.warm, step_s)
            check_ledger(res.pop("records"), corpus.num_docs, cfg)
            rows.append(("lost driver", mode, res))
            _say("lost driver", mode, res)
    return rows


def run_frozen_node_lowered(args, base, corpus, profile, step_s, cluster, small_node, check_ledger) -> list:
    """The frozen node again, on a cluster whose health check is lowered: Ray's notice comes first."""
    nodes = ClusterNodes(cluster, small_node)

    def hit(driver):
        pid = nodes.worker_on_node(driver)["pid"]
        return lambda: nodes.freeze(pid)

    rows = []
    name = "frozen node, Ray hc"
    for mode, sharding in MODES.items():
        cfg = _trial_config(base, args.out / f"frozen-node-lowered-{mode}", profile, sharding)
        try:
            res = trial_fault(cfg, corpus, hit, args.warm, step_s)
        finally:
            nodes.replace()
        check_ledger(res.pop("records"), corpus.num_docs, cfg)
        rows.append((name, mode, res))
        _say(name, mode, res)
    return rows


def trial_drain(cfg: TrainConfig, corpus, nodes: ClusterNodes, warm: int, step_s: float, deadline_s: int = 60) -> dict:
    """``ray drain-node`` (preemption, ``deadline_s``) of the small node half-way through step ``warm + 1``; the
    next step's boundary takes its worker out. The drain record's phases and the steps' times around it."""
    driver = TrainingDriver(cfg, corpus=corpus)
    driver.setup()
    try:
        records = [driver.step().record for _ in range(warm)]
        th, out = step_in_thread(driver)
        time.sleep(step_s / 2)
        # the GCS call `ray drain-node` makes (its CLI takes a second to start): "detect" counts from its answer
        from ray.core.generated import autoscaler_pb2

        gcs = ray._raylet.GcsClient(address=nodes.cluster.address)
        reason = autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION")
        deadline_ms = int(time.time() * 1e3) + deadline_s * 1000
        accepted, why = gcs.drain_node(nodes.node.node_id, reason, "benchmark", deadline_ms)
        if not accepted:
            raise RuntimeError(f"the drain was not accepted: {why}")
        accepted = time.time()
        th.join()
        if "error" in out:
            raise out["error"]
        records.append(out["record"])
        t0 = time.perf_counter()
        t = driver.step()  # its boundary: the drained node's worker leaves
        wall = time.perf_counter() - t0
        records.append(t.record)
        records.append(driver.step().record)  # a step of the smaller world, for comparison
        drain = next(r for r in t.record["recoveries"] if r.get("what") == "drain")
        return {
            "recovery_s": drain["recovery_ms"] / 1e3,
            "detected_by": "drain",
            "detect_s": max(0.0, drain["seen_at"] - accepted),
            "reform_s": drain["reform_ms"] / 1e3,
            "rerun_s": 0.0,
            "rolled_back": any(r.get("rollback") for r in t.record["recoveries"]),
            "handoff_s": drain["handoff_ms"] / 1e3,
            "handoff_mb": drain["handoff_bytes"] / 1e6,
            "step_after_s": wall,
            "next_step_s": records[-1]["measured_ms"] / 1e3 + records[-1].get("boundary_ms", 0.0) / 1e3,
            "after_parts_s": [t.record[k] / 1e3 for k in ("boundary_ms", "plan_wait_ms", "measured_ms")],
            "fallback": drain["fallback"],
            "records": records,
        }
    finally:
        driver.shutdown()


def run_drains(args, base: TrainConfig, corpus, profile: str, step_s: float, nodes: ClusterNodes, check_ledger) -> list:
    """The drained node under each sharding mode (a fresh small node after each)."""
    rows = []
    for mode, sharding in MODES.items():
        cfg = _trial_config(base, args.out / f"drained-node-{mode}", profile, sharding)
        try:
            res = trial_drain(cfg, corpus, nodes, args.warm, step_s)
        finally:
            nodes.replace()
        check_ledger(res.pop("records"), corpus.num_docs, cfg)
        rows.append(("drained node", mode, res))
        _say("drained node", mode, res)
        print(
            f"    handoff {res['handoff_s']:.2f} s ({res['handoff_mb']:.1f} MB), re-form {res['reform_s']:.2f} s; the "
            f"step after the drain {res['step_after_s']:.2f} s (boundary {res['after_parts_s'][0]:.2f} s, plan wait "
            f"{res['after_parts_s'][1]:.2f} s, measured {res['after_parts_s'][2]:.2f} s), the next "
            f"{res['next_step_s']:.2f} s; fallback: {res['fallback']}",
            flush=True,
        )
    return rows


def _trial_config(base: TrainConfig, run_dir: Path, profile: str, sharding: dict) -> TrainConfig:
    return dataclasses.replace(
        base,
        run_dir=str(run_dir),
        plan=dataclasses.replace(base.plan, profile=profile),
        sharding=ShardingSettings(**sharding) if sharding else ShardingSettings(),
        elastic=ElasticSettings(),  # the defaults: collective_timeout_s 120, heartbeat_timeout_s 10
    )


def _say(fault: str, mode: str, res: dict) -> None:
    what = "planned leave at the next step boundary" if fault == "drained node" else "fault -> next completed step"
    print(f"  {fault:<19s} {mode:<9s} {what} {res['recovery_s']:6.2f} s", flush=True)


def print_table(rows: list, step_s: float, health_ms: tuple[int, int] | None, out_dir: Path) -> None:
    print()
    print(
        f"{'fault':<19s} {'state':<9s} {'total s':>8s} {'detect s':>9s} {'by':>9s} {'re-form s':>10s} "
        f"{'re-run s':>9s} {'roll-back':>9s}"
    )
    for fault, mode, r in rows:
        detect, rerun = (f"{r[k]:.2f}" if r[k] == r[k] else "-" for k in ("detect_s", "rerun_s"))  # nan: none
        print(
            f"{fault:<19s} {mode:<9s} {r['recovery_s']:8.2f} {detect:>9s} {r['detected_by']:>9s} "
            f"{r['reform_s']:10.2f} {rerun:>9s} {'yes' if r['rolled_back'] else 'no':>9s}"
        )
    lowered = ""
    if health_ms is not None:
        period, threshold = health_ms
        lowered = (
            f"; 'Ray hc': Ray's node health check lowered to every {period} ms, dead after {threshold} misses (Ray's "
            "defaults: 3000 ms, 5)"
        )
    print(
        f"a normal step takes {step_s:.2f} s; flexorch's defaults (collective_timeout_s 120, heartbeat_timeout_s 10) "
        f"throughout{lowered}; a lost driver's re-form is the new driver's start (workers, checkpoint)"
    )
    print("ledger: every trial trained exactly the stream's documents (none lost, none repeated)")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "faults.json").write_text(json.dumps([{"fault": f, "mode": m, **r} for f, m, r in rows], indent=1))


def wait_node_dead(node_id: str, timeout_s: float = 120) -> None:
    """Wait until Ray's view has the node dead (so the next trial's workers do not try to start there)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not any(n["NodeID"] == node_id and n["Alive"] for n in ray.nodes()):
            return
        time.sleep(0.5)
