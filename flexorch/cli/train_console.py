"""What `flexorch train` prints of a run: the setup line, one line per step, membership changes, checkpoints, and a
line when a worker's speed drops below 0.8x the others or recovers (``control.speed_watch``).

`print_event` turns each driver event into its console line; `format_step` (plan shape, solve time, loss,
tokens/s, predicted vs measured step time, ETA and what the step recovered from) and `format_membership` (workers
lost, joined, drained or waited for) are also what the plan viewer and the tests read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from flexorch.solver.recompute import describe as describe_recompute

if TYPE_CHECKING:
    from flexorch.config import TrainConfig

__all__ = ["format_membership", "format_step", "print_event"]


def _fmt_eta(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def _active(ev: dict) -> str:
    """An MoE model: the parameters a token computes with (its routed experts), beside all it holds."""
    active = ev.get("model_active_params")
    return f" ({active / 1e6:.2f}M active per token)" if active and active != ev["model_params"] else ""


def format_step(ev: dict, total: int) -> str:
    head = f"step {ev['step'] + 1:>4}/{total}"
    if ev.get("skipped"):
        return f"{head}  SKIPPED (no plan fits: {ev['reason']})  ETA {_fmt_eta(ev['eta_s'])}"
    fb = ev.get("fallback")
    plan = f"{ev['shape']} [fallback: {fb['reason']}]" if fb else ev["shape"]
    budget = f"/{ev['plan_budget_s']:.2f}" if ev.get("plan_budget_s") else ""  # of the budget the plan had
    gap = f" gap {ev['gap'] * 100:4.1f}%" if ev.get("gap") is not None else ""
    targets = ev.get("targets")  # loss masks: the loss is over these tokens only
    of = f" on {targets:,} of {ev['tokens']:,} tokens" if targets is not None and targets != ev["tokens"] else ""
    line = (
        f"{head}  plan {plan:<18s} solve {ev['solve_s']:5.2f}{budget}s{gap}  loss {ev['loss']:7.4f}{of}  "
        f"tok/s {ev['tokens_per_s']:>8,.0f}  pred {ev['predicted_ms']:7.1f} ms  meas {ev['measured_ms']:7.1f} ms "
        f"(compute {ev['compute_ms']:7.1f} ms)  ETA {_fmt_eta(ev['eta_s'])}"
    )
    if ev.get("router_aux_loss") is not None:  # an MoE model's router load-balancing loss (unweighted)
        line += f"  router loss {ev['router_aux_loss']:.4f}"
    if ev.get("task_losses"):  # [[tasks]]: each task's own loss (the step's is their weighted mean)
        line += "  [" + ", ".join(f"{n} {x:.4f}" for n, x in ev["task_losses"].items()) + "]"
    if ev.get("recompute"):  # 'auto' recompute: how many groups ran without, and the packing the planner chose
        packing = (ev.get("recompute_packing") or {}).get("packing")
        packed = {"none": " (packed for no recompute)", "selective": " (packed for selective recompute)"}
        packed = packed.get(packing, "")
        line += f"  [{describe_recompute(ev['recompute'])}{packed}]"
    pipe = ev.get("pipeline")
    if pipe and any(map(any, pipe["checkpointed"])):  # stages: the layer runs their checkpointing recomputes
        runs = sum(n * len(row) for n, row in zip(pipe["layers"], pipe["checkpointed"], strict=True))
        line += f"  [recompute: {sum(map(sum, pipe['checkpointed']))} of {runs} layer runs]"
    compiled = max((r.get("compile_s") or 0.0 for r in ev.get("ranks") or () if r), default=0.0)
    if compiled >= 0.05:  # the first steps of a compiled model (and a recompile): torch.compile's own time
        line += f"  [compiling the layers: {compiled:.1f} s of it]"
    for rec in ev.get("recoveries") or ():
        if rec.get("driver_restart"):  # the driver was lost and a new one took over from the last checkpoint
            corpus = f" (corpus {rec['corpus_ms'] / 1e3:.1f} s)" if "corpus_ms" in rec else ""  # the new driver's
            line += (
                f"  [driver restarted, recovered in {rec['total_ms'] / 1e3:.1f} s: detect {rec['detect_ms'] / 1e3:.1f}"
                f" s, new driver {rec['recovery_ms'] / 1e3:.1f} s{corpus}, re-run {rec['rerun_ms'] / 1e3:.1f} s "
                f"({rec['redone_steps']} step{'' if rec['redone_steps'] == 1 else 's'} trained again)]"
            )
        elif "total_ms" in rec:  # a failure during this step: the time it cost, as lived
            line += (
                f"  [recovered in {rec['total_ms'] / 1e3:.1f} s: detect {rec.get('detect_ms', 0.0) / 1e3:.1f} s, "
                f"re-form {rec['recovery_ms'] / 1e3:.1f} s, re-run {rec['rerun_ms'] / 1e3:.1f} s]"
            )
    return line


def format_membership(ev: dict) -> str:
    """One line per membership change: workers lost (and what was done), joined, starting, waited for."""
    kind = ev["event"]
    if kind == "starting":
        return f"membership: starting workers {ev['worker_ids']} on free slots (world of {ev['size']} now)"
    if kind == "waiting":
        return (
            f"membership: {len(ev['alive'])} workers alive, below min_workers={ev['min_workers']}: waiting up to "
            f"{ev['timeout_s']:g} s for {ev['need']} more"
        )
    if kind == "drain_seen":
        return f"membership: {_drain_head(ev, ev['left_s'])}: workers {ev['workers']} leave at the next step boundary"
    before, after = len(ev["world_before"]), len(ev["world_after"])
    layout = f"; {ev['layout']}" if ev.get("layout") else ""
    if ev["what"] == "drain":
        head = f"membership: {_drain_head(ev, ev['deadline_left_s'])}: workers {ev['workers']}"
        if ev.get("fallback"):
            return f"{head} stay: {ev['fallback']}"
        when = f"after step {ev['after_step']}" if ev["after_step"] >= 0 else "before the first step"
        return (
            f"{head} left {when} in {ev['recovery_ms'] / 1e3:.1f} s, nothing re-run (handoff "
            f"{ev['handoff_ms'] / 1e3:.1f} s of {ev['handoff_bytes'] / 1e6:.1f} MB, re-form {ev['reform_ms'] / 1e3:.1f}"
            f" s), world {before} -> {after}{layout}"
        )
    if ev.get("drain"):  # lost with a node that was being drained
        layout += f"; node {ev['drain']['node_ip'] or ev['drain']['node'][:12]} was draining: {ev['drain']['fallback']}"
    if ev["what"] == "grow":
        line = f"membership: workers {ev['joined']} joined, world {before} -> {after} ({ev['recovery_ms']:.0f} ms)"
        return line + layout
    if ev.get("rollback"):
        return (
            f"membership: {ev['what']}: {ev['reason']}; back to the checkpoint of step {ev['to_step']} (from step "
            f"{ev['from_step']}), world of {after} in {ev['recovery_ms']:.0f} ms{layout}"
        )
    redo = "the step's update had finished, kept" if ev["step_completed"] else "re-running the step"
    seen = ""
    if ev.get("detect_ms") is not None:
        by = "its heartbeat stopped" if ev.get("detected_by") == "heartbeat" else "Ray reported it"
        seen = f" (seen {ev['detect_ms'] / 1e3:.1f} s after its last heartbeat: {by})"
    return (
        f"membership: {ev['what']}: {ev['reason']}{seen}; {'/'.join(ev['decisions'])}, world {before} -> {after} "
        f"workers {ev['world_after']} in {ev['recovery_ms']:.0f} ms; {redo}{layout}"
    )


def _drain_head(ev: dict, left_s: float | None) -> str:
    """``node 10.0.0.7 draining (preemption, 45 s)``: the node, the drain's reason and the time to its deadline;
    ``SIGTERM on node 10.0.0.7 (28 s of grace left)`` for a worker's own notice."""
    name = ev.get("node_ip") or ev["node"][:12]
    deadline = "no deadline" if left_s is None else f"{max(left_s, 0.0):.0f} s"
    if ev["reason"] == "sigterm":
        return f"SIGTERM on node {name} ({deadline} of grace left)"
    return f"node {name} draining ({ev['reason']}, {deadline})"


def _describe_setup(ev: dict) -> str:
    st = ev["corpus"]
    parts = [f"{ev['num_docs']:,} documents", f"{st.get('tokens', 0):,} tokens"]
    if st.get("records_kind") not in (None, "text"):  # loss masks: say what the loss is taken over
        parts[0] = f"{ev['num_docs']:,} {st['records_kind'].replace('_', '/')} documents"
        parts.append(f"{st.get('targets', 0):,} of them loss targets{_chat_targets(st.get('chat_targets'))}")
    if st.get("tasks"):  # [[tasks]]: each task's documents and kind
        each = [
            f"{name} {t.get('documents', 0):,} {(t.get('records_kind') or 'text').replace('_', '/')} docs"
            for name, t in st["tasks"].items()
        ]
        parts[0] = f"{len(st['tasks'])} tasks ({'; '.join(each)}): {ev['num_docs']:,} documents"
        rule = next((t["chat_targets"] for t in st["tasks"].values() if t.get("chat_targets")), None)  # one tokenizer
        parts.append(f"{st.get('targets', 0):,} of them loss targets{_chat_targets(rule)}")
    for key, label in (
        ("split_docs", "split"),
        ("dropped_over_long", "over-long dropped"),
        ("skipped_binary", "binary skipped"),
        ("skipped_empty", "empty skipped"),
        ("bad_records", "bad records skipped"),
    ):
        if st.get(key):
            parts.append(f"{st[key]:,} {label}")
    resumed = f", resumed after step {ev['resumed_from']}" if ev.get("resumed_from") is not None else ""
    kernels = ev.get("kernels") or {}
    compiled = f"; {kernels['compiled_layers']} layers compiled" if kernels.get("compiled_layers") else ""
    attention = f"; {kernels['attention']}" if kernels.get("attention") else ""
    return (
        f"flexorch train: {ev['workers']} worker{'s' * (ev['workers'] != 1)} "
        f"(elastic {ev['min_workers']}..{ev['max_workers']}), "
        f"model {ev['model_params'] / 1e6:.2f}M params{_active(ev)}{_sharding(ev)}, corpus "
        f"{', '.join(parts)}; {ev['batches_per_epoch']} batches per epoch; profile {ev['profile']} "
        f"({_budget(ev)}){resumed}{attention}{compiled}"
    )


def _chat_targets(rule: str | None) -> str:
    """Which rule chose a chat corpus's loss targets (``stats["chat_targets"]``, ``flexorch.data.chat.target_rule``;
    nothing for a store prepared before it was recorded)."""
    from flexorch.data.chat import TARGET_RULES

    return f" (set by {TARGET_RULES[rule]})" if rule in TARGET_RULES else ""


def _budget(ev: dict) -> str:
    """The activation budget in tokens: a worker alone holds ``tokens_per_worker``; a worker of the costliest SP group
    (Ulysses's all-to-all copies) holds ``plan.tokens_per_worker``, fewer on a small model."""
    alone, group = ev["tokens_per_worker"], ev.get("group_tokens_per_worker")
    if group is None or group >= alone:
        return f"{alone:,} tokens per worker"
    return f"activations for {alone:,} tokens per worker alone, {group:,} in the costliest SP group"


def _sharding(ev: dict) -> str:
    sh = ev.get("sharding")
    if not sh:
        return ""
    ac = f", recompute {sh['activation_checkpointing']}" if sh["activation_checkpointing"] != "none" else ""
    over = f" over {sh['shards']}" if sh["mode"] != "replicate" else ""
    mib = sh["plan_resident_bytes"] / 2**20
    return f" ({sh['mode']}{over}, {sh['precision']}{ac}, {mib:.2f} MiB model state per worker)"


def print_event(ev: dict, cfg: TrainConfig, out) -> None:
    """Print the line (if any) a driver event makes on the console."""
    kind = ev["event"]
    if kind == "setup":
        print(_describe_setup(ev), file=out, flush=True)
    elif kind in ("calibrated", "planner", "progress", "speed"):  # speed: a worker dropped below 0.8x, or recovered
        print(ev["message"], file=out, flush=True)
    elif kind == "checkpoint_skipped":
        print(f"--resume: {ev['message']}", file=out, flush=True)
    elif kind == "step":
        print(format_step(ev, cfg.steps), file=out, flush=True)
    elif kind in ("membership", "waiting", "starting", "drain_seen"):
        print(format_membership(ev), file=out, flush=True)
    elif kind == "capacity":
        print(f"membership: {ev['message']}", file=out, flush=True)
    elif kind == "checkpoint":
        print(f"checkpoint after step {ev['step']}: {ev['path']}", file=out, flush=True)
    elif kind == "checkpoint_wait":  # a stop or the run's end waits for the save in flight
        print(ev["message"], file=out, flush=True)
    elif kind == "checkpoint_failed":
        newest = f"the newest checkpoint is still {ev['newest']}" if ev["newest"] else "no checkpoint is complete yet"
        print(f"checkpoint after step {ev['step']} failed ({ev['error']}); what it wrote is deleted and {newest}; "
              "the run goes on", file=out, flush=True)  # fmt: skip
