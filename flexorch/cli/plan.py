"""`flexorch plan`: the per-step plans flexorch would run on N workers, for real batches of a real corpus.

Draws global batches from a length source through the train driver's stream (``flexorch.data.stream.DocumentStream``:
seeded epochs, every sequence once per epoch), plans every step through the train driver's planner
(``flexorch.solver.step_planner.StepPlanner``: the same plan, never slower than BatchAda, for the same batch), and
prints per step the plan's shape, the solve time, the predicted step time, the gap to a proven lower bound and the
speedup against the static layouts in use today.

With ``speeds`` (``--speeds 1,1,0.5,1``, ``3=0.5`` or ``node1=0.7``; :mod:`flexorch.cli.plan_speeds`) the workers run at
those relative speeds: each step is planned and priced with them, and printed beside the speed-blind plan of the same
batch (planned as if every worker ran at 1.0, priced with the speeds), with each rank's share of the tokens.

With ``pipeline_stages`` (``--pipeline-stages P|auto``) every step is planned as a pipeline instead (P stages of
``workers // P`` workers, SP inside a stage, or the best split per step for ``auto``), never slower than plain 1F1B
and Seq1F1B on the same stages, and compared against them.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from flexorch.cli.plan_speeds import SpeedComparison, parse_speeds
from flexorch.data.errors import DataError
from flexorch.data.lengths import bundled_lengths_path, read_lengths
from flexorch.data.stream import Batch, DocumentStream
from flexorch.records.writer import StepRecords, plan_record
from flexorch.solver.errors import InfeasibleBatchError
from flexorch.solver.pipeline.stage_count import check_stage_count
from flexorch.solver.planner import PlannerConfig
from flexorch.solver.profiles import Profile
from flexorch.solver.simulator import step_time_ms
from flexorch.solver.step_planner import StepPlanner
from flexorch.solver.topology import Topology
from flexorch.solver.validation import largest_degree

__all__ = ["PlanRunConfig", "run_plan", "parse_nodes", "parse_pipeline_stages", "parse_speeds"]


def parse_nodes(nodes, gpus_per_node, workers) -> tuple[int, ...] | None:
    """``--nodes 8,8,7`` (live workers per node in rank order; a list from a config file) or ``--gpus-per-node G``
    (``workers`` cut into nodes of G, the last holding what is left: 23 workers, 8 per node -> 8, 8, 7); None when
    neither is given. A ValueError naming the flag otherwise."""
    if nodes is not None and gpus_per_node is not None:
        raise ValueError("give --nodes or --gpus-per-node, not both")
    if nodes is not None:
        try:
            out = tuple(int(x) for x in (nodes.split(",") if isinstance(nodes, str) else nodes))
        except (TypeError, ValueError):
            raise ValueError(f"--nodes must be worker counts separated by commas, e.g. 8,8,7; got {nodes!r}") from None
        if not out or min(out) < 1:
            raise ValueError(f"--nodes needs every node to hold >= 1 worker, got {nodes!r}")
        if workers is not None and int(workers) != sum(out):
            raise ValueError(f"--nodes {nodes} holds {sum(out)} workers, --workers is {workers}")
        return out
    if gpus_per_node is None:
        return None
    g, n = int(gpus_per_node), int(64 if workers is None else workers)
    if g < 1:
        raise ValueError(f"--gpus-per-node must be >= 1, got {gpus_per_node!r}")
    return (g,) * (n // g) + ((n % g,) if n % g else ())


def parse_pipeline_stages(value) -> int | str | None:
    """``--pipeline-stages`` as given (a string from the command line, an int or a string from a file): a positive
    int, ``"auto"``, or None (not given, or 1: SP planning, as ``pipeline_stages = 1`` means in `flexorch train`).
    Anything else is a ValueError naming the flag."""
    if value == 1 or value == "1":
        return None
    if value is None or value == "auto" or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    if isinstance(value, str):
        text = value.strip()
        if text.lower() == "auto":
            return "auto"
        try:
            return int(text)
        except ValueError:
            pass
    raise ValueError(f"--pipeline-stages must be a positive integer or 'auto', got {value!r}")


@dataclass(frozen=True, kw_only=True)
class PlanRunConfig:
    """What `flexorch plan` does."""

    lengths: Path | None = None
    """Lengths file, JSONL file or directory; None: the bundled Wikipedia lengths."""
    text_field: str = "text"
    """JSONL field holding the document text."""
    workers: int = 64
    """N: workers to plan for, one per device slot (a GPU); the solver calls them ``num_devices``."""
    max_context: int | None = None
    """Longest sequence allowed, tokens; default: what the largest group of N workers holds."""
    over_long: str = "drop"
    """'drop' sequences over max_context (counted and reported) or 'reject' the data with an error."""
    batch: int = 512
    """Sequences per global batch."""
    steps: int = 10
    """Steps to plan."""
    seed: int = 0
    """Seed of the shuffle that forms batches."""
    json: bool = False
    """Print one JSON object per step instead of the table."""
    svg: Path | None = None
    """Write a picture of every planned step (workers x time) here."""
    run_dir: Path | None = None
    """Write every step's record (``flexorch.step/4``) to ``run_dir/steps.jsonl``, for `flexorch dashboard`."""
    planner: PlannerConfig = PlannerConfig()
    """Solver knobs."""
    nodes: tuple[int, ...] | None = None
    """Live workers per node in rank order (``--nodes`` / ``--gpus-per-node``); None: one node."""
    topology: str = "aware"
    """With ``nodes``: 'aware' plans on them (``flexorch.solver.topology``), 'blind' as one node (its plan still
    priced, drawn and recorded on the nodes, for comparison)."""
    pipeline_stages: int | str | None = None
    """None: plan SP groups. P >= 1 or 'auto': plan every step as a pipeline of P stages (``workers // P`` workers
    each, SP inside a stage; the ``workers - P * (workers // P)`` left over sit out) or the best split per step."""
    speeds: tuple[float, ...] | None = None
    """Each worker's relative speed in rank order (``--speeds``, :func:`flexorch.cli.plan_speeds.parse_speeds`);
    None: all 1.0. Plans are made and priced with them, beside the speed-blind plan of each batch."""

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"--workers must be >= 1, got {self.workers}")
        if self.batch < 1 or self.steps < 1:
            raise ValueError(f"--batch and --steps must be >= 1, got {self.batch} and {self.steps}")
        if self.over_long not in ("drop", "reject"):
            raise ValueError(f"--over-long must be 'drop' or 'reject', got {self.over_long!r}")
        p = self.pipeline_stages
        if p is not None and p != "auto" and (not isinstance(p, int) or isinstance(p, bool) or p < 1):
            raise ValueError(f"--pipeline-stages must be a positive integer (>= 1) or 'auto', got {p!r}")
        if self.topology not in ("aware", "blind"):
            raise ValueError(f"--topology must be 'aware' or 'blind', got {self.topology!r}")
        if self.nodes is not None and sum(self.nodes) != self.workers:
            raise ValueError(f"--nodes {list(self.nodes)} holds {sum(self.nodes)} workers, --workers is {self.workers}")
        if self.speeds is not None:
            if len(self.speeds) != self.workers or not all(s > 0 for s in self.speeds):
                raise ValueError(f"--speeds needs one speed > 0 per worker ({self.workers}), got {list(self.speeds)}")
            if p is not None:
                raise ValueError("--speeds prices SP groups; a pipelined plan (--pipeline-stages) does not take them")


def _filter(lengths: np.ndarray, max_context: int, policy: str) -> tuple[np.ndarray, dict]:
    empty = int((lengths == 0).sum())
    over = lengths > max_context
    if over.any() and policy == "reject":
        i = int(np.flatnonzero(over)[0])
        raise DataError(
            f"{int(over.sum())} sequence(s) exceed --max-context {max_context} tokens (the first is #{i} with "
            f"{int(lengths[i])}); use --over-long drop to skip them, or raise --max-context/--workers"
        )
    keep = (lengths > 0) & ~over
    report = {
        "total": int(lengths.size),
        "empty_dropped": empty,
        "over_long_dropped": int(over.sum()),
        "kept": int(keep.sum()),
    }
    return lengths[keep], report


def run_plan(cfg: PlanRunConfig, profile: Profile, out=None) -> list[dict]:
    """Plan `cfg.steps` steps; print a table (or JSON lines) to `out` (stdout); return the per-step records."""
    out = out or sys.stdout
    lengths = _kept_lengths(cfg, profile, out)
    pipelined = cfg.pipeline_stages is not None
    speeds = SpeedComparison(cfg.speeds) if cfg.speeds is not None and not cfg.json else None
    records, pictures, writer = _plan_steps(cfg, profile, lengths, out, speeds)
    if not cfg.json:
        (_pipeline_summary if pipelined else _summary)(records, out)
    if speeds is not None:
        speeds.summary(out)

    def picture() -> str:
        if pipelined:
            from flexorch.dashboards.pipeline_svg import render_pipelines_svg

            return render_pipelines_svg(pictures)
        from flexorch.dashboards.plan_svg import render_steps_svg

        return render_steps_svg(pictures, profile)

    what = "picture of every step (stages x time)" if pipelined else "picture of every step"
    _close(cfg, out, writer, picture, what)
    return records


def _kept_lengths(cfg: PlanRunConfig, profile: Profile, out):
    """The source's document lengths the plan keeps (checked against the workers, batch and stages), after printing
    what was dropped and (without ``--json``) the table's head."""
    source = cfg.lengths or bundled_lengths_path()
    raw = read_lengths(source, text_field=cfg.text_field)
    limit = largest_degree(cfg.workers) * profile.tokens_per_device
    max_context = cfg.max_context or limit
    if max_context > limit:
        raise DataError(
            f"--max-context {max_context} tokens is more than {cfg.workers} workers hold in one SP group "
            f"({largest_degree(cfg.workers)} x {profile.tokens_per_device} = {limit} tokens with profile "
            f"{profile.name}); lower --max-context or raise --workers"
        )
    lengths, report = _filter(raw, max_context, cfg.over_long)
    if cfg.batch > lengths.size:
        raise DataError(f"a batch of {cfg.batch} sequences needs at least that many, the data has {lengths.size}")
    pipelined = cfg.pipeline_stages is not None
    if pipelined:
        check_stage_count(
            cfg.pipeline_stages, cfg.workers, profile.num_layers, profile.num_heads, key="--pipeline-stages",
            model=f"profile {profile.name}", have=f"--workers is {cfg.workers}",
        )  # fmt: skip
    if report["empty_dropped"]:  # with --json on stderr: stdout stays one JSON object per line
        print(
            f"flexorch plan: dropped {report['empty_dropped']} zero-length document(s) of {source} "
            "(length 0: nothing to train on)",
            file=sys.stderr if cfg.json else out,
        )
    if not cfg.json:
        print(
            f"flexorch plan: {source} ({report['total']} sequences; kept {report['kept']}, dropped "
            f"{report['empty_dropped']} empty and {report['over_long_dropped']} over {max_context} tokens)\n"
            f"  profile {profile.name}, N={cfg.workers} workers, batch {cfg.batch}, {cfg.steps} steps, "
            f"seed {cfg.seed}"
            + (f", pipeline stages {cfg.pipeline_stages} (SP inside a stage)" if pipelined else "")
            + (f", {Topology(cfg.nodes).describe()} ({cfg.topology})" if cfg.nodes and not pipelined else "")
            + (f", speeds {_speeds_text(cfg.speeds)}" if cfg.speeds is not None else ""),
            file=out,
        )
        print(_pipeline_head() if pipelined else _head(), file=out)
    return lengths


def _speeds_text(speeds) -> str:
    """'rank 3 0.50x' for each rank off 1.0 (the first 8), or 'all 1.0'."""
    off = [f"rank {r} {s:.2f}x" for r, s in enumerate(speeds) if s != 1.0]
    return ", ".join(off[:8]) + (f" (+{len(off) - 8} more)" if len(off) > 8 else "") if off else "all 1.0"


def _topologies(cfg: PlanRunConfig) -> tuple[Topology | None, Topology | None, Topology | None, Topology | None]:
    """(the nodes, what the planner is given without the speeds, with them, what its plan runs on): with --topology
    blind the planner sees one node (None); with --speeds the planner's topology and the nodes carry the speeds
    (one node without --nodes)."""
    nodes = Topology(cfg.nodes) if cfg.nodes is not None and cfg.pipeline_stages is None else None
    blind = nodes if cfg.topology == "aware" else None
    if cfg.speeds is None:
        return nodes, blind, blind, nodes
    single = Topology.single(cfg.workers)
    return nodes, blind, (blind or single).with_speeds(cfg.speeds), (nodes or single).with_speeds(cfg.speeds)


def _plan_steps(cfg: PlanRunConfig, profile: Profile, lengths, out, speeds: SpeedComparison | None = None):
    """Plan each step's batch (the train driver's stream over ``lengths``), emitting its record as it is planned
    (with ``speeds``, and the speed-blind plan beside it); returns the records, each step's picture and the run
    directory's writer (None without one)."""
    pipelined = cfg.pipeline_stages is not None
    stream = DocumentStream(lengths.size, cfg.batch, cfg.seed)  # the train driver's stream, over the kept lengths
    records, pictures = [], []
    writer = StepRecords(cfg.run_dir) if cfg.run_dir is not None else None
    t_start = time.perf_counter()
    nodes, blind, planning, priced = _topologies(cfg)
    with StepPlanner(profile, cfg.planner, pipeline_stages=cfg.pipeline_stages or 1) as planner:
        for step in range(cfg.steps):
            batch = stream.next_batch()
            seqs = lengths[list(batch.doc_ids)]
            planned = planner.plan(seqs, cfg.workers, topology=planning)
            if nodes is not None and cfg.topology == "blind" and planned.plan is not None:
                planned = on_nodes(planned, priced, profile)
            if planned.plan is None:  # an error (exit 2); the steps before it stay written
                where = f" (--pipeline-stages {cfg.pipeline_stages})" if pipelined else ""
                raise InfeasibleBatchError(f"step {step}{where}: {planned.error}")
            rec = plan_record(_step_fields(step, batch, cfg, seqs), planned, profile)
            drawn = planned.plan.plan if planned.pipelined else planned.plan
            pictures.append((f"step {step}: {rec['shape']}  {planned.predicted_ms / 1000:.2f} s", drawn))
            eta = (time.perf_counter() - t_start) / (step + 1) * (cfg.steps - step - 1)
            row = None if cfg.json else (_pipeline_row(rec, eta) if pipelined else _row(rec, eta))
            _emit(cfg, out, writer, records, rec, row)
            if speeds is not None:  # the same batch planned without the speeds, on the same nodes
                print(speeds.compare(planner, seqs, cfg.workers, blind, priced, planned, profile), file=out)
    return records, pictures, writer


def on_nodes(planned, topo: Topology, profile: Profile):
    """A blind plan (planned as one node) as it runs on ``topo``: the same groups on the same ranks, priced where
    they lie (a group across a node boundary at the inter-node figures). Its baselines stay as planned (one node)."""
    plan = dataclasses.replace(planned.plan, topology=topo)
    ms = step_time_ms(plan, profile)
    return dataclasses.replace(planned, plan=plan, predicted_ms=ms, bound_ms=min(planned.bound_ms, ms))


def _step_fields(step: int, batch: Batch, cfg: PlanRunConfig, seqs) -> dict:
    """The record keys of a planned step that say which batch it was (SP and pipelined paths alike)."""
    return {
        "step": step,
        "epoch": batch.epoch,
        "world_size": cfg.workers,
        "seq_lengths": [int(x) for x in seqs],
        "mode": "adaptive",
    }


def _emit(cfg: PlanRunConfig, out, writer, records: list, rec: dict, row: str | None) -> None:
    """Record one step: to ``steps.jsonl`` (with --run-dir), to ``records``, and printed (JSON, or the table row)."""
    if writer is not None:
        writer.append(rec)
    records.append(rec)
    print(json.dumps(rec) if cfg.json else row, file=out, flush=True)


def _close(cfg: PlanRunConfig, out, writer, picture, what: str) -> None:
    """After the summary: say where the records went, and write the picture (``picture()``) with --svg."""
    if writer is not None and not cfg.json:
        print(f"step records: {writer.path} (view them with: flexorch dashboard {cfg.run_dir})", file=out)
    if cfg.svg is not None:
        cfg.svg.parent.mkdir(parents=True, exist_ok=True)
        cfg.svg.write_text(picture())
        if not cfg.json:
            print(f"{what}: {cfg.svg}", file=out)


_PIPELINE_BASELINES = ("1f1b", "seq1f1b-4")
"""The keys of a pipelined step's ``baselines_ms`` (``pipeline_baselines``, its default k = 4), in column order."""


def _pipeline_head() -> str:
    cols = " ".join(f"{'x ' + name:>11}" for name in _PIPELINE_BASELINES)
    return f"{'step':>4} {'solve_s':>7} {'step_ms':>9} {'bubble':>6} {'gran':>4} {cols}  {'eta':>6}  plan"


def _pipeline_row(rec: dict, eta: float) -> str:
    mine, pipe, base = rec["predicted_ms"], rec["pipeline"], rec["baselines_ms"]
    cols = " ".join(f"{_x(base.get(name), mine):>11}" for name in _PIPELINE_BASELINES)
    return (
        f"{rec['step']:>4} {rec['solve_s']:>7.3f} {mine:>9.0f} {pipe['bubble_share'] * 100:>5.1f}% "
        f"{pipe['granularity']:>4} {cols}  {eta:>5.0f}s  {rec['shape']}"
    )


def _pipeline_summary(records: list[dict], out) -> None:
    solve = np.array([r["solve_s"] for r in records])
    bubble = np.array([r["pipeline"]["bubble_share"] for r in records])
    speedups = []
    for name in _PIPELINE_BASELINES:
        vals = [r["baselines_ms"][name] / r["predicted_ms"] for r in records if r["baselines_ms"].get(name) is not None]
        text = f"vs {name} {np.median(vals):.2f}x" if vals else f"vs {name} n/a (it holds no step's batch)"
        if vals and len(vals) < len(records):
            text += f" (over the {len(vals)} steps it fits)"
        speedups.append(text)
    b2b = sum(1 for r in records if len({u["pipeline"] for u in r["pipeline"]["units"]}) > 1)
    print(
        f"summary over {len(records)} steps: solve median {np.median(solve):.3f} s (p95 "
        f"{np.percentile(solve, 95):.3f} s), simulated bubble median {np.median(bubble) * 100:.1f} % (max "
        f"{bubble.max() * 100:.1f} %)" + (f", {b2b} step(s) as back-to-back pipelines" if b2b else ""),
        file=out,
    )
    print(f"  median speedup {', '.join(speedups)} (same stages, same batch)", file=out)


def _best(base: dict, prefix: str) -> tuple[str | None, float | None]:
    cands = {k: v for k, v in base.items() if k.startswith(prefix) and v is not None}
    if not cands:
        return None, None
    k = min(cands, key=cands.get)
    return k, cands[k]


def _ulysses_max(base: dict) -> tuple[str | None, float | None]:
    names = [k for k in base if k.startswith("static-ulysses-")]
    k = max(names, key=lambda s: int(s.rsplit("-", 1)[1]))
    return k, base[k]


def _x(ref, mine) -> str:
    return "n/a" if ref is None else f"{ref / mine:.2f}x"


def _head() -> str:
    return (
        f"{'step':>4} {'solve_s':>7} {'step_ms':>9} {'bound_ms':>9} {'gap':>6} {'x batchada':>10} "
        f"{'x best-ulysses':>16} {'x best-ring':>14} {'x ulysses-max':>15}  {'eta':>6}  plan"
    )


def _row(rec: dict, eta: float) -> str:
    mine, base = rec["predicted_ms"], rec["baselines_ms"]
    bu_name, bu = _best(base, "static-ulysses-")
    br_name, br = _best(base, "static-ring-")
    um_name, um = _ulysses_max(base)
    bu_s = f"{_x(bu, mine)} ({bu_name.rsplit('-', 1)[1] if bu_name else '-'})"
    br_s = f"{_x(br, mine)} ({br_name.rsplit('-', 1)[1] if br_name else '-'})"
    um_s = f"{_x(um, mine)} ({um_name.rsplit('-', 1)[1]})"
    return (
        f"{rec['step']:>4} {rec['solve_s']:>7.3f} {rec['predicted_ms']:>9.0f} {rec['bound_ms']:>9.0f} "
        f"{_gap(rec) * 100:>5.1f}% {_x(base['batchada'], mine):>10} {bu_s:>16} {br_s:>14} {um_s:>15}  "
        f"{eta:>5.0f}s  {rec['shape']}"
    )


def _gap(rec: dict) -> float:
    return rec["predicted_ms"] / rec["bound_ms"] - 1.0 if rec["bound_ms"] > 0 else 0.0


def _summary(records: list[dict], out) -> None:
    solve = np.array([r["solve_s"] for r in records])
    gap = np.array([_gap(r) for r in records])
    ratios = {}
    for name in records[0]["baselines_ms"]:
        vals = [r["baselines_ms"][name] / r["predicted_ms"] for r in records if r["baselines_ms"][name] is not None]
        if len(vals) == len(records):
            ratios[name] = float(np.median(vals))
    print(
        f"summary over {len(records)} steps: solve median {np.median(solve):.3f} s (p95 "
        f"{np.percentile(solve, 95):.3f} s), gap to bound median {np.median(gap) * 100:.1f} % (max "
        f"{gap.max() * 100:.1f} %)",
        file=out,
    )
    best = sorted(ratios.items(), key=lambda kv: kv[1])[:3]
    print(
        "  median speedup vs batchada {:.2f}x; closest static layouts: {}".format(
            ratios.get("batchada", float("nan")), ", ".join(f"{k} {v:.2f}x" for k, v in best)
        ),
        file=out,
    )
