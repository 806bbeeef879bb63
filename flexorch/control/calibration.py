"""Calibrate the cost model on the real workers (``flexorch profile``, and ``plan.profile = "auto"`` at start).

Every probe runs on all workers at once, exactly like a training micro-batch (same sharding, SP attention and
kernels, all workers busy, so a shared machine is as loaded as during training):

1. compute probes: every worker alone (SP degree 1) on single long documents and on many short ones packed;
   fitted to ``b1 + a1 * sum s^2 + a2 * sum s`` (FlexSP §4.1.2);
2. group probes for every degree d <= N and kind: one micro-batch per group; what the compute fit does not
   explain (``group ms - b1 - compute / d``) is the communication, fitted to ``latency + bytes / bandwidth``
   per (kind, d) (flexorch's latency extension, docs/design.md §7). On several nodes (the worker group's
   ``rank_nodes``, ``control.membership.world_topology``; not with ``[plan] topology = "blind"``) each degree a
   node holds is probed with groups inside the nodes, and each degree that can span with groups across node
   boundaries (``flexorch.workers.calibrate.group_starts``): the first fill the profile's intra-node tables, the
   second its ``inter_*`` ones;
3. activation bytes per token from the tensors autograd saves (``flexorch.workers.activation_memory``).

Which probes run and how (sized, placed on the nodes, cut to a time budget) is ``control.calibration_probes``; the
fit lives in ``solver.calibration`` (pure); the report says how well the fitted profile predicts every probe.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import numpy as np

from flexorch.control.calibration_probes import (
    ProbedGroup,
    calibration_probes,
    calibration_topology,
    cut_note,
    run_calibration_probes,
)
from flexorch.solver.calibration import (
    CommSample,
    ComputeSample,
    GroupSample,
    fit_group_comm,
    fit_profile,
    intra_from_inter,
    prediction_errors,
)
from flexorch.solver.cost_model import attention_square
from flexorch.solver.errors import ProfileError
from flexorch.solver.profiles import Profile, get_profile
from flexorch.solver.step_planner import planner_profile
from flexorch.solver.topology import Topology

__all__ = [
    "calibrate",
    "calibrate_on_workers",
    "fitted_profile",
    "model_state_fields",
    "model_state_plan",
    "resolve_profile",
    "run_profile",
]


# fit_profile needs an all-to-all table entry; where nothing was measured (the compute-only fit, one worker, ring
# only) these stand in and are never used for a Ulysses group of the run
_A2A_PLACEHOLDER = [CommSample(kind="ulysses", degree=2, tokens_per_rank=t, ms=1.0) for t in (1, 2)]


def model_state_plan(cfg, world_size: int):
    """The model-state bytes a worker holds in a world of ``world_size`` under the run's sharding
    (``flexorch.solver.model_state``): whole replicas, 1/world (fsdp) or 1/shard_size (hsdp) of the resident state,
    plus what FSDP gathers in flight."""
    from flexorch.config.sharding import effective_shard_size
    from flexorch.solver.model_state import model_state_bytes

    mode = cfg.sharding_mode
    shards = effective_shard_size(mode, world_size, cfg.sharding.shard_size)
    if cfg.pipelined and mode != "replicate":  # a stage's parts over its workers; the stage model takes its share
        shards = max(1, world_size // cfg.pipeline.stages)
    param_bytes = 2 if cfg.precision == "bf16" else 4
    frozen = None if cfg.model.base_trainable else (lambda name: ".lora." not in name)  # the tasks' adapters train
    return model_state_bytes(
        cfg.model.param_shapes(), shards, sharded=mode != "replicate", param_bytes=param_bytes,
        gather=cfg.sharding.gather, frozen=frozen,
    )  # fmt: skip


def model_state_fields(cfg, world_size: int) -> dict:
    """The ``model_state`` of a step record: the sharding in force and the plan's bytes per worker (each rank's
    measured ``state_bytes`` is beside it in ``ranks``)."""
    from flexorch.config.sharding import effective_shard_size

    plan = model_state_plan(cfg, world_size)
    return {
        "mode": cfg.sharding_mode,
        "shards": effective_shard_size(cfg.sharding_mode, world_size, cfg.sharding.shard_size),
        "precision": cfg.precision,
        "activation_checkpointing": cfg.recompute,
        "plan_resident_bytes": plan.resident,
        "plan_in_flight_bytes": plan.in_flight,
    }


def calibrate(group: ProbedGroup, cfg, *, repeats: int = 5, publish=None) -> tuple[Profile, dict]:
    """Run the probes on a formed worker group and fit a profile; returns (profile, report). ``publish`` gets a
    progress event as each phase starts (a ``RayWorkerGroup`` built with one also reports while its calls run)."""
    t0 = time.perf_counter()
    publish = publish or (lambda event: None)
    topology = calibration_topology(group, cfg)
    compute, groups = calibration_probes(
        cfg.tokens_per_worker, group.size, tuple(cfg.plan.kinds), repeats, cfg.data.max_context, topology
    )
    on = f" ({topology.describe()})" if topology is not None else ""
    msg = (
        f"calibrating the cost model on {group.size} worker{'s' * (group.size != 1)}{on}: {len(compute)} compute "
        f"and {len(groups)} group probes, {repeats} runs each"
    )
    publish({"event": "progress", "message": msg})
    ran, per_rank = run_calibration_probes(group, compute + groups, publish, t0)  # [rank][probe] median ms
    cut = cut_note(compute + groups, ran)
    compute, groups = ran[: len(compute)], ran[len(compute) :]
    msg = f"calibrating: probes done after {time.perf_counter() - t0:.0f} s; measuring activation memory"
    publish({"event": "progress", "message": msg})
    ms = np.max(np.array(per_rank), axis=0)  # a group is as slow as its slowest member
    comp_samples = [ComputeSample(seq_lengths=p.lengths, ms=float(m)) for p, m in zip(compute, ms, strict=False)]
    act = float(np.median(group.call("activation_bytes_per_token")))
    name = f"calibrated-{cfg.model.num_layers}x{cfg.model.dim}-{group.size}w"
    dims = _profile_dims(cfg, act)
    profile, fit, notes, group_samples = _fit_probes(name, dims, comp_samples, groups, ms[len(compute) :])
    profile, group_fit, inter_group_fit = _fit_group_times(profile, groups, group_samples)
    report = {
        "profile": name,
        "seconds": time.perf_counter() - t0,
        "fit": fit.to_dict(),
        "group_fit": group_fit,
        "probes": [s.to_dict() for s in comp_samples + group_samples],
        **_error_summary(profile, comp_samples + group_samples),
        "act_bytes_per_token": act,
    }
    if topology is not None:  # which groups were measured inside a node and which across, and how each predicts
        report["topology"] = topology.to_dict()
        report["inter_group_fit"] = inter_group_fit
        for where, spans in (("intra", False), ("inter", True)):
            report.update(_error_summary(profile, [s for s in group_samples if s.spans == spans], f"{where}_"))
    probes = len(comp_samples) + len(group_samples)
    report["message"] = _report_message(profile, report, group.size, probes, cut, notes)
    return profile, report


def _fit_probes(name: str, dims: dict, comp_samples, groups, group_ms):
    """(profile, fit report, its notes, group samples) of the probes: the compute fit alone first (it says how much
    of a group's time is not compute), then compute and communication together (``solver.calibration.fit_profile``).
    Where no Ulysses group was probed (one worker, ring only) a placeholder fills the a2a table, and the fit's notes
    on it are dropped: they are about groups this run cannot form."""
    base, _ = fit_profile("compute-only", **dims, compute_samples=comp_samples, comm_samples=_A2A_PLACEHOLDER)
    comm_samples, group_samples = _group_samples(base, groups, group_ms)
    placeholder = not any(c.kind == "ulysses" for c in comm_samples)
    if placeholder:
        comm_samples += _A2A_PLACEHOLDER
    profile, fit = fit_profile(name, **dims, compute_samples=comp_samples, comm_samples=comm_samples)
    notes = tuple(n for n in fit.notes if not n.startswith("ulysses-")) if placeholder else fit.notes
    return profile, fit, notes, group_samples


def _fit_group_times(profile: Profile, groups, group_samples) -> tuple[Profile, dict, dict]:
    """``profile`` with each probed (kind, degree, placement)'s latency and bandwidth refitted to whole group times,
    matching the cost model's own group formula (``solver.calibration.fit_group_comm``); with the fit errors of the
    groups inside a node and of those across nodes, by '<kind>-<degree>'."""
    group_fit, inter_group_fit = {}, {}
    placed = {(p.kind, p.degree, p.placement == "inter") for p in groups}
    for kind, d, spans in sorted(placed):
        profile, err = fit_group_comm(profile, group_samples, kind, d, spans=spans)
        (inter_group_fit if spans else group_fit)[f"{kind}-{d}"] = dataclasses.asdict(err)
        if spans and (kind, d, False) not in placed:  # no node holds the degree: the intra figure is this one
            profile = intra_from_inter(profile, kind, d)
    return profile, group_fit, inter_group_fit


def _profile_dims(cfg, act: float) -> dict:
    """The model's shape and memory terms of the fitted profile (``act``: activation bytes per token)."""
    model = cfg.model
    # what the executor holds per worker in the run's sharding mode, at the elastic floor (the largest share)
    state_bytes = model_state_plan(cfg, cfg.min_workers).total
    return dict(
        num_layers=model.num_layers,
        hidden=model.dim,
        num_heads=model.num_heads,
        num_kv_heads=model.num_kv_heads,
        head_size=model.head_size,
        attention_window=model.attention_window or 0,
        window_fraction=model.window_fraction,
        bytes_per_element=2 if cfg.precision == "bf16" else 4,  # what SP collectives move per element
        act_bytes_per_token=act,
        memory_budget_bytes=state_bytes + (cfg.tokens_per_worker + 0.5) * act,
        model_state_bytes=state_bytes,
    )


def _error_summary(profile: Profile, samples, prefix: str = "") -> dict:
    """The fitted profile's median and max relative error over ``samples`` (keys ``{prefix}median_rel_error`` and
    ``{prefix}max_rel_error``); nothing when there are none."""
    errors = np.abs(prediction_errors(profile, samples))
    if not errors.size:
        return {}
    return {f"{prefix}median_rel_error": float(np.median(errors)), f"{prefix}max_rel_error": float(np.max(errors))}


def _group_samples(base: Profile, groups, ms) -> tuple[list[CommSample], list[GroupSample]]:
    """Each group probe's time as a collective sample (its time less the compute ``base`` predicts) and as a group
    sample (its whole time); a probe across nodes gives samples that span nodes."""
    comm_samples, group_samples = [], []
    for p, m in zip(groups, ms, strict=True):
        s = np.asarray(p.lengths, dtype=np.float64)
        spans = p.placement == "inter"
        compute_ms = base.b1_ms + float((base.a1_ms * attention_square(s, base) + base.a2_ms * s).sum()) / p.degree
        tokens = int(s.sum()) // p.degree
        comm_samples.append(
            CommSample(kind=p.kind, degree=p.degree, tokens_per_rank=tokens, ms=max(0.01, m - compute_ms), spans=spans)
        )
        group_samples.append(GroupSample(seq_lengths=p.lengths, degree=p.degree, kind=p.kind, ms=float(m), spans=spans))
    return comm_samples, group_samples


def _report_message(profile: Profile, report: dict, workers: int, probes: int, cut: str, notes) -> str:
    """The calibration's console line: the fitted terms and the prediction error over the probes, how many probes
    were cut to fit the time (``cut``: ``calibration_probes.cut_note``), then the fit's notes, one line each."""
    msg = (
        f"calibrated on {workers} worker{'s' * (workers != 1)} in {report['seconds']:.1f} s: "
        f"a1={profile.a1_ms:.3g} ms/tok^2 "
        f"a2={profile.a2_ms:.3g} ms/tok b1={profile.b1_ms:.3g} ms, latency a2a {_fmt(profile.a2a_latency_ms)} "
        f"p2p {_fmt(profile.p2p_latency_ms)}; {report['act_bytes_per_token']:,.0f} activation bytes/token; "
        f"prediction error over {probes} probes: median {100 * report['median_rel_error']:.1f} %, max "
        f"{100 * report['max_rel_error']:.1f} %"
    )
    if "topology" in report:
        msg += (
            f"; across nodes ({Topology.from_dict(report['topology']).describe()}): latency a2a "
            f"{_fmt(profile.inter_a2a_latency_ms)} p2p {_fmt(profile.inter_p2p_latency_ms)}, bandwidth a2a "
            f"{_fmt(profile.inter_a2a_gbps, 'GB/s')} p2p {_fmt(profile.inter_p2p_gbps, 'GB/s')} (inside a node: "
            f"a2a {_fmt(profile.a2a_gbps, 'GB/s')} p2p {_fmt(profile.p2p_gbps, 'GB/s')}); prediction error inside "
            f"nodes {_pct(report, 'intra')}, across nodes {_pct(report, 'inter')}"
        )
    msg += cut
    # a bandwidth clamped because no byte cost showed is a fact about the probes, not a problem to act on
    return msg + "".join(f"\n{'note' if ' clamped to ' in n else 'warning'}: {n}" for n in notes)


def _fmt(table: dict, unit: str = "ms") -> str:
    """A degree table as '{2: 1.50 ms, 4: ...}' (latencies) or '{2: 10 GB/s, ...}' (bandwidths)."""
    cells = (f"{d}: {v:.2f} ms" if unit == "ms" else f"{d}: {v:.3g} {unit}" for d, v in sorted(table.items()))
    return "{" + ", ".join(cells) + "}"


def _pct(report: dict, where: str) -> str:
    """'median M %, max X %' of the group probes ``where`` ('intra'/'inter'), or 'not measured'."""
    if f"{where}_median_rel_error" not in report:
        return "not measured"
    median, top = report[f"{where}_median_rel_error"], report[f"{where}_max_rel_error"]
    return f"median {100 * median:.1f} %, max {100 * top:.1f} %"


def calibrate_on_workers(cfg) -> tuple[Profile, dict]:
    """Start the run's workers, calibrate, stop them (``flexorch profile``)."""
    from flexorch.control.worker_group import RayWorkerGroup

    group = RayWorkerGroup.from_config(cfg)
    try:
        group.form_world()
        return calibrate(group, cfg)
    finally:
        group.shutdown()


def resolve_profile(cfg, group, run_dir: Path, publish) -> Profile:
    """The run's base profile: calibrated now ('auto'; reused on resume), built-in, or from a JSON file."""
    spec = cfg.plan.profile
    path = Path(run_dir) / "profile.json"
    if spec != "auto":
        try:
            return get_profile(spec)
        except ProfileError as e:
            raise ProfileError(f"plan.profile: {e}") from None
    if cfg.resume and path.is_file():
        publish({"event": "calibrated", "message": f"profile: reusing {path} from the run being resumed"})
        return get_profile(str(path))
    profile, report = calibrate(group, cfg, publish=publish)
    path.write_text(profile.to_json())
    (Path(run_dir) / "calibration.json").write_text(json.dumps(report, indent=1))
    publish({"event": "calibrated", "message": f"profile: {report['message']} -> {path}"})
    return profile


def run_profile(cfg, group, run_dir: Path, publish, activation_budget_bytes: float | None = None) -> Profile:
    """The profile a run plans with: :func:`resolve_profile` fitted to the model's heads, layers and per-worker
    token budget, with the model-state bytes the executor holds in the run's sharding mode (SP runs); a pipelined
    run also measures what a stage holds on a worker's own model (a fraction of a second,
    ``flexorch.workers.calibrate.stage_activation_bytes``)."""
    base = resolve_profile(cfg, group, run_dir, publish)
    stage_bytes = tuple(group.call("stage_activation_bytes")[0]) if cfg.pipelined else None
    return fitted_profile(base, cfg, stage_bytes, activation_budget_bytes)


def fitted_profile(
    base: Profile,
    cfg,
    stage_bytes: tuple[float, float] | None = None,
    activation_budget_bytes: float | None = None,
) -> Profile:
    """``base`` fitted to the run (``flexorch.solver.step_planner.planner_profile``): the model's heads, layers and
    vocabulary, the per-worker token budget, and (SP runs) the model-state bytes the executor holds. No worker: the CLI
    also calls it before Ray starts, to refuse a fixed profile that does not fit the model."""
    return planner_profile(
        base,
        num_heads=cfg.model.num_heads,
        num_kv_heads=cfg.model.num_kv_heads,
        head_size=cfg.model.head_size,
        attention_window=cfg.model.attention_window or 0,
        window_fraction=cfg.model.window_fraction,
        tokens_per_worker=cfg.tokens_per_worker,
        num_layers=cfg.model.num_layers,
        vocab_size=cfg.model.vocab_size,
        stage_bytes=stage_bytes,
        model_state_bytes=None if cfg.pipelined else model_state_plan(cfg, cfg.min_workers).total,
        activation_budget_bytes=activation_budget_bytes,
    )
