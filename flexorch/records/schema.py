"""The step record schema, ``flexorch.step/4``: one JSON object per planned or trained step.

`flexorch plan --run-dir DIR` and `flexorch train` both write ``DIR/steps.jsonl`` in this schema (`flexorch plan
--json` prints the same objects), and `flexorch dashboard DIR` reads it. :func:`validate_record` checks one
record and says exactly what is wrong with it. Times are milliseconds unless a name ends in ``_s``.

Keys of every record (``source`` is ``"plan"`` or ``"train"``):

* ``schema`` (this version), ``source``, ``step`` (0-based), ``time`` (unix seconds when written), ``epoch``
  (pass over the data), ``world_size`` (devices or workers planned for), ``seq_lengths`` (tokens of each sequence
  of the batch, in batch order: a plan's ``seq_ids`` index this list), ``tokens`` (next-token predictions of the
  batch: the sum of ``length - 1``);
* ``status`` (the planner's: ``optimal``, ``feasible``, ``heuristic``, ``fallback``, ... or ``infeasible``),
  ``skipped`` (bool: no plan fits, nothing ran) and ``reason`` (why, or null), ``mode`` (planner mode);
* ``shape`` (e.g. ``"<4, 2x2> | <8>"``: SP degrees of each micro-batch, or null when skipped), ``plan`` (null
  when skipped, else ``{"num_devices", "micro_batches": [[{"degree", "kind", "ranks", "seq_ids",
  "seq_lengths"}, ...], ...]}``), ``timeline`` (the cost model's schedule of that plan: ``[{"micro_batch",
  "group", "start_ms", "time_ms"}, ...]``, one entry per group, or null), ``solve_s``, ``predicted_ms`` (the
  plan's predicted step time, null when skipped), ``bound_ms`` (proven lower bound, 0 when none),
  ``baselines_ms`` (predicted step time of each static layout and BatchAda for the same batch, null where a layout
  cannot hold it), ``pipeline`` (null unless the step ran on pipeline stages, see below);
* ``fallback`` (optional, null when the step got the planner's own plan): ``{"reason", "message"}`` saying why it
  did not: ``timeout`` (the planner gave nothing in time, or its budget ran out before any MILP plan), ``crash`` (the
  planner process died), ``error`` (the planner raised) or ``infeasible`` (no plan fits: the step was skipped);
  ``solver_crashes`` (optional): MILP solves that died natively while planning the step (each cost that solve);
  ``plan_budget_s`` (optional, null where no planner ran): the planning budget the step's plan was given (a share
  of the previous step's time in a run, ``[plan] budget``); ``gap`` (optional, null without a bound): the plan's
  ``predicted_ms / bound_ms - 1``, how far from the optimum it can be; ``profile_revision`` (optional): which version
  of the run's cost model priced the plan (0 as calibrated, +1 for each refit taken up or rolled back: the plan's
  ``predicted_ms`` and ``timeline`` come from that one); ``level`` (optional, trained steps): the run's step level
  (``flexorch.solver.step_level``) the plan's prices were multiplied by: ``predicted_ms``, ``bound_ms``,
  ``baselines_ms``, ``recompute_packing``'s times and the ``timeline`` are that profile's price times ``level`` (1
  without refits and for pipelined steps); ``targets`` (optional, trained steps):
  the tokens that carried loss, the loss's denominator (``tokens`` for plain text; fewer for chat, prompt/completion
  and tokenized data with loss masks, whose prompts are computed but not predicted).

A pipelined step (``[pipeline] stages`` set) has ``plan`` and ``timeline`` null and ``shape`` like ``"pp 2x2 ·
12 units"``; its ``pipeline`` holds ``stages``, ``degree`` (workers per stage, SP inside a stage), ``layers``
(decoder layers per stage), ``stage_ranks`` (the world ranks of each stage), ``granularity``, ``bubble_share``
(simulated), ``peak_bytes`` (predicted activation bytes per stage), ``units`` (``[{"chain", "pipeline",
"tokens", "pieces": [[seq_id, start, end], ...]}, ...]``, numbered across back-to-back pipelines; every token of
every sequence is in exactly one piece), ``checkpointed`` (``[stage][unit]`` layers run under activation
checkpointing) and ``ops`` (the simulated schedule: ``[{"stage", "kind": "F"|"B", "unit", "start_ms",
"end_ms"}, ...]``, one forward and one backward per unit and stage). A trained pipelined step with
``[pipeline] params = "stage"`` also has ``params`` (``placement``, ``moved_parts``, ``moved_bytes`` (parameters
and their optimizer state), ``move_ms``: the model parts copied between workers before the step because the stage
map changed) and each rank's entry
``param_bytes`` (parameters, gradients and optimizer state it held).

Keys of ``source == "train"`` records only (null where the step was skipped):

* ``batch_index`` (batch inside the epoch), ``doc_ids`` (corpus ids of the batch, the ledger), ``worker_ids``
  (stable id of each rank: rank i ran on worker ``worker_ids[i]``), ``recoveries`` (membership changes made for
  this step, each with ``what``, ``world_before``, ``world_after``, ``recovery_ms`` and either ``attempt``,
  ``decisions``, ``lost``, ``reason``, ``step_completed`` after a failure, ``joined`` when workers joined (and
  ``capacity_wait_s`` when they came on capacity the autoscaler was asked for: seconds from the request), or
  ``rollback: true``, ``from_step``, ``to_step``, ``lost``, ``reason`` when stage-local parameters died with
  every holder and the run went back to its last checkpoint; ``what: "drain"`` when a node holding workers was being
  drained (a preemption notice, ``ray drain-node``): ``node``, ``node_ip``, ``reason``, ``deadline`` (unix seconds,
  null: none), ``seen_at`` (unix seconds the driver first saw the drain), ``deadline_left_s``, ``workers`` (its
  workers), ``after_step``, ``needed_s`` (what a planned leave was expected to take) and either ``left`` (the
  workers that left at this step's boundary), ``handoff_ms``, ``handoff_bytes`` (what they handed the stayers),
  ``reform_ms`` (with ``reform_phases_ms``: the slowest member's ``leave``, ``rendezvous`` and ``state``, the last
  building the new world's model state; sharded state: ``build`` and ``exchange`` in place of ``state``),
  ``rerun: false`` and ``fallback: null``, or ``left: []`` and ``fallback`` (why they stayed for the lost-node path);
  a loss of workers whose node was being drained has ``drain`` (the drain's fields and ``fallback``: why they had not
  left));
* ``measured_ms`` (dispatch to the last outcome, as the driver saw it: what ``predicted_ms`` predicts, its
  micro-batches plus the profile's ``step_ms``), ``compute_ms`` (slowest rank, start to end of its micro-batches),
  ``sync_ms``, ``optim_ms``, ``dispatch_ms``,
  ``plan_wait_ms`` (time the driver waited for the plan: zero when the solve hid behind the previous step),
  ``nodes`` (optional, absent in older records): each rank's node by address (else Ray node id, else null);
  ``boundary_ms`` (optional: membership work between the previous step and this one: admitting workers that finished
  starting, starting new ones; a worker starting beside the steps costs nothing here), ``overhead_ms`` (driver
  bookkeeping after the outcomes);
* ``loss``, ``tokens_per_s``, ``lr``, ``grad_norm``, ``ranks`` (per rank, or null for a rank lost after the step's
  update was applied: ``micro_batch_ms`` and ``micro_batch_start_ms`` (the measured time and start, from the
  rank's step start, of its group in each micro-batch; null where it sat one out), ``compute_end_ms``,
  ``local_tokens``, ``peak_local_tokens``, ``peak_activation_bytes``; in a pipelined step ``micro_batch_ms`` and
  ``micro_batch_start_ms`` are empty and ``ops`` holds the rank's measured ``[{"kind", "unit", "start_ms",
  "end_ms", "wait_ms"}, ...]`` in the order it ran them, empty for a rank no stage uses: ``start_ms`` is when the
  op's input had arrived, ``wait_ms`` how long the rank waited for it (optional: records written before it was
  added have none, and their ``start_ms`` includes the wait); ``state_bytes`` (optional) the model state the rank
  held (parameters, gradients and optimizer state, its shards under FSDP); ``compile_s`` (optional) the seconds
  ``torch.compile`` ran during the step on that rank;
* ``model_state`` (optional, SP steps): the sharding in force (``mode``, ``shards``, ``precision``,
  ``activation_checkpointing``) and the plan's model-state bytes per worker (``plan_resident_bytes``, what the
  ranks' ``state_bytes`` measure, and ``plan_in_flight_bytes``, FSDP's gathered layers during the step);
* ``recompute`` (optional, with ``[sharding] activation_checkpointing = "auto"``): per micro-batch, each group's
  mode ('none', 'selective' or 'full') in the plan's order; ``recompute_packing`` (optional, adaptive SP plans with
  'auto') the planner's packings (``flexorch.solver.recompute``): ``packing``, the one that ran ('full':
  micro-batches packed for full recompute's bytes, each group in the fastest mode that fits; 'none' / 'selective':
  packed for that mode's bytes), ``full_ms`` and, for each other packing planned, ``none_ms`` / ``selective_ms``
  (null: planned, but no plan came of it; absent: not planned, no group of full's packing needed it); a recovery
  after a worker ran out of device memory has ``out_of_memory`` (``workers``, the activation budget per worker
  before and after the cut, in bytes and tokens, and ``errors``: each such worker's id and the first line of its
  error, what it tried to allocate and what was free).
* ``sources`` (optional, runs of ``[[data.sources]]``): per source its ``docs`` and ``tokens`` in this step's batch
  and its ``epoch`` (the source's own pass over its documents; ``epoch`` above is the heaviest source's).
* ``tasks``, ``task_losses`` and ``multitask`` (optional, runs of ``[[tasks]]``): per task its ``docs``, ``tokens``,
  ``targets``, mean ``loss`` and ``epoch`` (the task's own pass over its data; ``epoch`` above is the first task's)
  this step, the batch holding each task's documents in task order; ``task_losses`` the same losses by task name (what
  the trackers log as ``loss/<task>``); ``multitask`` how the plan placed the tasks (``multitask``: 'spindle' or
  'in_turn', ``parts`` ``[[task, first rank, devices, start_ms, time_ms], ...]``, Spindle's ``bound_ms`` and
  ``makespan_ms`` in its own cost model, ``gap``, the plan's ``simulated_ms`` and barrier-free ``dataflow_ms``,
  ``solve_s``). A step's ``loss`` is then ``sum_t weight_t * loss_t`` with the tasks' weights normalised to sum to 1.

History: version 2 (train only) added ``worker_ids`` and ``recoveries``; version 3 made one schema for `plan` and
`train`: ``source``, ``timeline``, and `plan`'s ``makespan_ms``/``baselines``/``micro_batches`` became
``predicted_ms``/``baselines_ms``/``plan``; version 4 added ``pipeline`` and the ranks' ``ops``.
"""

from __future__ import annotations

import math

from flexorch.records.step_keys import (
    COMMON_KEYS,
    DRAIN_KEYS,
    GROUP_KEYS,
    LEFT_KEYS,
    PIPELINE_KEYS,
    TRAIN_KEYS,
)

__all__ = ["FALLBACK_REASONS", "SCHEMA", "SOURCES", "RecordError", "validate_record"]

SCHEMA = "flexorch.step/4"
SOURCES = ("plan", "train")


class RecordError(ValueError):
    """A step record that does not follow the schema; the message names the key and what was expected."""


def _type_name(types: tuple) -> str:
    return " or ".join("number" if t is float else {int: "integer", str: "string"}.get(t, t.__name__) for t in types)


def _check_keys(rec: dict, spec: dict, where: str) -> None:
    for key, (types, nullable) in spec.items():
        if key not in rec:
            raise RecordError(f"{where}: key {key!r} is missing")
        v = rec[key]
        if v is None:
            if not nullable:
                raise RecordError(f"{where}: {key!r} is null, expected {_type_name(types)}")
            continue
        if isinstance(v, bool) and bool not in types or not isinstance(v, types):
            raise RecordError(f"{where}: {key!r} is {type(v).__name__} {v!r:.60}, expected {_type_name(types)}")
        if isinstance(v, float) and not math.isfinite(v) and key not in ("loss", "grad_norm"):
            raise RecordError(f"{where}: {key!r} is {v}, expected a finite number")


def _check_plan(rec: dict, where: str) -> None:
    plan, n, lengths = rec["plan"], rec["world_size"], rec["seq_lengths"]
    if plan.get("num_devices") != n:
        raise RecordError(f"{where}: plan.num_devices {plan.get('num_devices')!r} differs from world_size {n}")
    mbs = plan.get("micro_batches")
    if not isinstance(mbs, list) or not mbs:
        raise RecordError(f"{where}: plan.micro_batches must be a non-empty list of micro-batches")
    seen: list[int] = []
    for mi, mb in enumerate(mbs):
        if not isinstance(mb, list) or not mb:
            raise RecordError(f"{where}: plan.micro_batches[{mi}] must be a non-empty list of groups")
        used: set[int] = set()
        for gi, g in enumerate(mb):
            at = f"{where}: plan.micro_batches[{mi}][{gi}]"
            if not isinstance(g, dict) or any(k not in g for k in GROUP_KEYS):
                raise RecordError(f"{at} must be an object with keys {', '.join(GROUP_KEYS)}")
            ranks = g["ranks"]
            if len(ranks) != g["degree"] or any(not isinstance(r, int) or not 0 <= r < n for r in ranks):
                raise RecordError(f"{at}: ranks {ranks} must be {g['degree']} (its degree) ranks in [0, {n})")
            if used & set(ranks):
                raise RecordError(f"{at}: ranks {sorted(used & set(ranks))} are in two groups of one micro-batch")
            used |= set(ranks)
            if any(not isinstance(i, int) or not 0 <= i < len(lengths) for i in g["seq_ids"]):
                raise RecordError(f"{at}: seq_ids {g['seq_ids']} must index seq_lengths (0..{len(lengths) - 1})")
            seen += g["seq_ids"]
    if sorted(seen) != list(range(len(lengths))):
        raise RecordError(f"{where}: the plan must place every sequence of the batch exactly once")
    timeline = rec["timeline"]
    if timeline is None:
        raise RecordError(f"{where}: 'timeline' is null but the record has a plan")
    want = {(mi, gi) for mi, mb in enumerate(mbs) for gi in range(len(mb))}
    got = set()
    for t in timeline:
        if not isinstance(t, dict) or any(k not in t for k in ("micro_batch", "group", "start_ms", "time_ms")):
            raise RecordError(f"{where}: timeline entries need micro_batch, group, start_ms and time_ms")
        got.add((t["micro_batch"], t["group"]))
    if got != want:
        raise RecordError(f"{where}: the timeline must have one entry per group of the plan")
    modes = rec.get("recompute")
    shape = [len(mb) for mb in mbs]
    if modes is not None and (
        not isinstance(modes, list)
        or [len(row) if isinstance(row, list) else -1 for row in modes] != shape
        or any(m not in RECOMPUTE_MODES for row in modes for m in row)
    ):
        raise RecordError(
            f"{where}: 'recompute' must be null or one mode ({', '.join(RECOMPUTE_MODES)}) per group of the plan, "
            f"{shape} groups per micro-batch; got {modes!r}"
        )


RECOMPUTE_MODES = ("none", "selective", "full")


def _check_pipeline(rec: dict, where: str) -> None:
    pipe, n, lengths = rec["pipeline"], rec["world_size"], rec["seq_lengths"]
    missing = [k for k in PIPELINE_KEYS if k not in pipe]
    if missing:
        raise RecordError(f"{where}: pipeline lacks {', '.join(missing)}")
    p, d = pipe["stages"], pipe["degree"]
    if not isinstance(p, int) or not isinstance(d, int) or p < 1 or d < 1 or p * d > n:
        raise RecordError(f"{where}: pipeline.stages x degree ({p!r} x {d!r}) must be positive and fit world_size {n}")
    ranks = pipe["stage_ranks"]
    if len(ranks) != p or any(len(rs) != d for rs in ranks) or len({r for rs in ranks for r in rs}) != p * d:
        raise RecordError(f"{where}: pipeline.stage_ranks must list {p} stages of {d} distinct ranks each")
    if len(pipe["layers"]) != p or len(pipe["checkpointed"]) != p:
        raise RecordError(f"{where}: pipeline.layers and pipeline.checkpointed need one entry per stage ({p})")
    params = pipe.get("params")
    if params is not None and (
        not isinstance(params, dict)
        or params.get("placement") not in ("stage", "replicated")
        or any(
            not isinstance(params.get(k), int | float) or params[k] < 0
            for k in ("moved_parts", "moved_bytes", "move_ms")
        )
    ):
        raise RecordError(
            f"{where}: pipeline.params {params!r:.80} must be {{placement: stage|replicated, moved_parts, "
            "moved_bytes, move_ms >= 0}"
        )
    units = pipe["units"]
    if not isinstance(units, list) or any(len(c) != len(units) for c in pipe["checkpointed"]):
        raise RecordError(f"{where}: pipeline.checkpointed[stage] needs one entry per unit ({len(units)})")
    covered: dict[int, list[tuple[int, int]]] = {}
    for ui, u in enumerate(units):
        if not isinstance(u, dict) or any(not isinstance(u.get(k), int) for k in ("chain", "pipeline", "tokens")):
            raise RecordError(f"{where}: pipeline.units[{ui}] must be an object with integer chain, pipeline, tokens")
        for piece in u.get("pieces") or []:
            if not isinstance(piece, list) or len(piece) != 3 or not 0 <= piece[0] < len(lengths):
                raise RecordError(
                    f"{where}: pipeline.units[{ui}] has a piece {piece!r:.40}, expected [seq_id, start, end]"
                )
            covered.setdefault(piece[0], []).append((piece[1], piece[2]))
    for i, s in enumerate(lengths):
        at = 0
        for a, b in sorted(covered.get(i, [])):
            if a != at or b <= a:
                break
            at = b
        if at != s:
            raise RecordError(
                f"{where}: pipeline.units must cover every token of sequence {i} exactly once ({s} tokens)"
            )
    want = {(r, k, u) for r in range(p) for k in "FB" for u in range(len(units))}
    got = {(o.get("stage"), o.get("kind"), o.get("unit")) for o in pipe["ops"] if isinstance(o, dict)}
    if got != want or len(pipe["ops"]) != len(want):
        raise RecordError(f"{where}: pipeline.ops must hold one F and one B per unit and stage")


def _check_drains(recoveries: list, where: str) -> None:
    """A ``drain`` recovery has its drain's fields and either the leave's figures or a ``fallback``; a loss on a
    draining node has the drain's fields under ``drain``."""
    for i, r in enumerate(recoveries):
        here = f"{where}: recoveries[{i}]"
        if not isinstance(r, dict):
            raise RecordError(f"{here} must be an object, got {type(r).__name__}")
        drain = r if r.get("what") == "drain" else r.get("drain")
        if drain is None:
            continue
        missing = [k for k in DRAIN_KEYS if k not in drain]
        if missing:
            raise RecordError(f"{here}: a drain lacks {', '.join(missing)}")
        for k in ("deadline", "seen_at"):
            if drain[k] is not None and not isinstance(drain[k], int | float):
                raise RecordError(f"{here}: drain {k!r} must be null or unix seconds, got {drain[k]!r}")
        if r.get("what") != "drain":
            continue
        if not isinstance(r.get("left"), list) or not isinstance(r.get("workers"), list):
            raise RecordError(f"{here}: a drain needs 'workers' and 'left' (lists of worker ids)")
        if r["fallback"] is None:
            bad = [k for k in LEFT_KEYS if not isinstance(r.get(k), int | float) or r[k] < 0]
            if bad or not r["left"]:
                raise RecordError(f"{here}: a drain its workers left needs 'left' and {', '.join(LEFT_KEYS)} >= 0")
        elif not isinstance(r["fallback"], str) or r["left"]:
            raise RecordError(f"{here}: a drain's 'fallback' says why its workers stayed ('left' empty)")


def validate_record(rec, where: str = "record") -> dict:
    """Check ``rec`` against ``flexorch.step/4``; return it, or raise :class:`RecordError` saying what is wrong."""
    if not isinstance(rec, dict):
        raise RecordError(f"{where}: expected a JSON object, got {type(rec).__name__}")
    schema = rec.get("schema")
    if schema != SCHEMA:
        hint = (
            " (written by an older flexorch: re-run it to get this version)"
            if str(schema).startswith("flexorch.step/")
            else ""
        )
        raise RecordError(f"{where}: schema is {schema!r}, this flexorch reads {SCHEMA!r}{hint}")
    if rec.get("source") not in SOURCES:
        raise RecordError(f"{where}: source is {rec.get('source')!r}, expected one of {', '.join(SOURCES)}")
    _check_keys(rec, COMMON_KEYS, where)
    _check_fallback(rec, where)
    if rec["source"] == "train":
        _check_keys(rec, TRAIN_KEYS, where)
        t = rec.get("targets")
        if t is not None and (isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= rec["tokens"]):
            raise RecordError(f"{where}: 'targets' must be an integer in 0..tokens ({rec['tokens']}), got {t!r}")
        if len(rec["doc_ids"]) != len(rec["seq_lengths"]):
            raise RecordError(f"{where}: doc_ids and seq_lengths differ in length")
        n = rec["world_size"]
        if len(rec["worker_ids"]) != n:
            raise RecordError(f"{where}: worker_ids has {len(rec['worker_ids'])} ids for world_size {n}")
        nodes = rec.get("nodes", [None] * n)
        if not isinstance(nodes, list) or len(nodes) != n or any(x and not isinstance(x, str) for x in nodes):
            raise RecordError(f"{where}: 'nodes' must name each rank's node (a string or null), one per rank")
        _check_drains(rec["recoveries"], where)
    if rec["skipped"]:
        if rec["plan"] is not None:
            raise RecordError(f"{where}: a skipped step has no plan, but 'plan' is set")
        return rec
    if rec["predicted_ms"] is None or (rec["plan"] is None) == (rec["pipeline"] is None):
        raise RecordError(f"{where}: a step that was not skipped needs 'predicted_ms' and one of 'plan' or 'pipeline'")
    if rec["pipeline"] is not None:
        _check_pipeline(rec, where)
        if rec["source"] == "train":
            _check_pipeline_ranks(rec, where)
        return rec
    _check_plan(rec, where)
    if rec["source"] == "train":
        ranks = rec["ranks"]
        if ranks is None or len(ranks) != rec["world_size"]:
            raise RecordError(f"{where}: 'ranks' must hold one entry per rank ({rec['world_size']})")
        n_mb = len(rec["plan"]["micro_batches"])
        for r, entry in enumerate(ranks):
            if entry is None:  # a rank lost after the update had been applied
                continue
            if not isinstance(entry, dict) or len(entry.get("micro_batch_ms") or []) != n_mb:
                raise RecordError(f"{where}: ranks[{r}].micro_batch_ms must hold one time per micro-batch ({n_mb})")
    return rec


FALLBACK_REASONS = ("timeout", "crash", "error", "infeasible")


def _check_fallback(rec: dict, where: str) -> None:
    """The optional ``fallback`` and ``solver_crashes`` keys (absent in records written before they existed)."""
    fb = rec.get("fallback")
    if fb is not None:
        ok = isinstance(fb, dict) and fb.get("reason") in FALLBACK_REASONS and isinstance(fb.get("message"), str)
        if not ok:
            raise RecordError(
                f"{where}: 'fallback' must be null or {{'reason': one of {list(FALLBACK_REASONS)}, 'message': str}}, "
                f"got {fb!r}"
            )
    for key in ("plan_budget_s", "gap"):
        v = rec.get(key)
        if v is not None and not (isinstance(v, int | float) and not isinstance(v, bool) and v >= 0):
            raise RecordError(f"{where}: {key!r} must be null or a number >= 0, got {v!r}")
    level = rec.get("level")
    if level is not None and not (isinstance(level, int | float) and not isinstance(level, bool) and level > 0):
        raise RecordError(f"{where}: 'level' must be null or a number > 0, got {level!r}")
    crashes = rec.get("solver_crashes", 0)
    if isinstance(crashes, bool) or not isinstance(crashes, int) or crashes < 0:
        raise RecordError(f"{where}: 'solver_crashes' must be an integer >= 0, got {crashes!r}")


def _check_pipeline_ranks(rec: dict, where: str) -> None:
    ranks, pipe = rec["ranks"], rec["pipeline"]
    if ranks is None or len(ranks) != rec["world_size"]:
        raise RecordError(f"{where}: 'ranks' must hold one entry per rank ({rec['world_size']})")
    in_stage = {r for rs in pipe["stage_ranks"] for r in rs}
    n_ops = 2 * len(pipe["units"])
    for r, entry in enumerate(ranks):
        if entry is None:
            continue
        ops = entry.get("ops") if isinstance(entry, dict) else None
        if not isinstance(ops, list) or len(ops) != (n_ops if r in in_stage else 0):
            raise RecordError(
                f"{where}: ranks[{r}].ops must hold its stage's {n_ops} measured ops"
                if r in in_stage
                else f"{where}: ranks[{r}] is in no stage, its ops must be empty"
            )
        seen = set()
        for o in ops:
            ok = isinstance(o, dict) and o.get("kind") in ("F", "B") and isinstance(o.get("unit"), int)
            ok = ok and 0 <= o["unit"] < len(pipe["units"]) and (o["kind"], o["unit"]) not in seen
            ok = ok and all(isinstance(o.get(k), int | float) for k in ("start_ms", "end_ms"))
            ok = ok and (o.get("wait_ms") is None or (isinstance(o["wait_ms"], int | float) and o["wait_ms"] >= 0))
            if not ok or o["start_ms"] > o["end_ms"]:
                raise RecordError(
                    f"{where}: ranks[{r}].ops entry {o!r:.80} must be {{kind: F|B, unit, start_ms <= end_ms, "
                    "wait_ms >= 0 if given}, each (kind, unit) once"
                )
            seen.add((o["kind"], o["unit"]))
