"""The step record schema, ``flexorch.step/4``: one JSON object per planned or trained step.

`flexorch plan --run-dir DIR` and `flexorch train` both write ``DIR/steps.jsonl`` in this schema (`flexorch plan
--json` prints the same objects), and `flexorch dashboard DIR` reads it. :func:`validate_record` checks one record
and says exactly what is wrong with it: the key's path (``plan.micro_batches[0][1].ranks``) and what was found.

Each key's type and meaning is a pydantic model in :mod:`flexorch.records.step_keys` (:class:`PlanRecord` for
``source == "plan"``, :class:`TrainRecord` for ``"train"``; :func:`record_json_schema` is their JSON Schema).
Keys a model does not name are allowed. This module adds what types cannot say: how the keys relate (a plan places
every sequence of the batch once, on ``world_size`` ranks; the timeline has one entry per group; a pipeline's units
cover every token; each rank measured one time per micro-batch or one op per unit of its stage; ...).

``status`` says how the plan was found: ``milp`` (a MILP solve chose at least one micro-batch), ``static`` (the
planner's best candidate was a static draft), ``fallback`` (no MILP plan in time: the planner's deadline, or the
planner client's heuristic plan), ``batchada`` (the BatchAda floor beat the planner), ``static-<kind>-<degree>``
(a static layout mode), ``pipeline`` or ``pipeline-<baseline>`` (a pipelined step; the baseline schedule when it
was faster), ``spindle`` or ``in_turn`` (a multi-task step's method), ``spindle-in_turn`` (the tasks in turn beat
Spindle's plan) and ``infeasible`` (no plan fits: the step was skipped).
"""

from __future__ import annotations

from pydantic import ValidationError

from flexorch.records.step_keys import (
    FALLBACK_REASONS,
    RECOMPUTE_MODES,
    Keys,
    PlanRecord,
    TrainRecord,
    record_json_schema,
)

__all__ = ["FALLBACK_REASONS", "SCHEMA", "SOURCES", "RecordError", "record_json_schema", "validate_record"]

SCHEMA = "flexorch.step/4"
SOURCES = ("plan", "train")


class RecordError(ValueError):
    """A step record that does not follow the schema; the message names the key and what was expected."""


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
    try:
        (TrainRecord if rec["source"] == "train" else PlanRecord).model_validate(rec)
    except ValidationError as e:
        raise RecordError(f"{where}: {_what_is_wrong(e)}") from None
    _check_relations(rec, where)
    return rec


def _path(loc: tuple) -> str:
    """``('plan', 'micro_batches', 0, 1, 'ranks')`` -> ``plan.micro_batches[0][1].ranks``."""
    return "".join(f"[{k}]" if isinstance(k, int) else f".{k}" if i else str(k) for i, k in enumerate(loc))


def _model_named(name: str) -> type[Keys] | None:
    todo = [Keys]
    while todo:
        cls = todo.pop()
        if cls.__name__ == name:
            return cls
        todo += cls.__subclasses__()
    return None


_EXPECTED = {
    "int_type": "integer",
    "float_type": "number",
    "string_type": "string",
    "bool_type": "bool",
    "list_type": "list",
    "dict_type": "an object",
}


def _what_is_wrong(e: ValidationError) -> str:
    """pydantic's first error as the schema's messages put it: the key's path and what was wrong; every key missing
    from the same object at once."""
    errors = e.errors(include_url=False)
    err, kind = errors[0], errors[0]["type"]
    loc, value, ctx = err["loc"], err.get("input"), err.get("ctx") or {}
    at = _path(loc)
    if kind == "missing":
        if len(loc) == 1:
            return f"key {at!r} is missing"
        keys = [str(x["loc"][-1]) for x in errors if x["type"] == "missing" and x["loc"][:-1] == loc[:-1]]
        return f"{_path(loc[:-1])} lacks {', '.join(keys)}"
    if kind in ("record", "value_error"):  # the schema's own words: prefixed with where the object sits
        msg = str(ctx["error"]) if kind == "value_error" else err["msg"]
        where = _path(loc if kind == "value_error" else loc[:-1])
        return f"{where}: {msg}" if where else msg
    if kind == "model_type":
        model = _model_named(ctx.get("class_name", ""))
        keys = [f.alias or k for k, f in model.model_fields.items() if f.is_required()] if model else []
        expected = f"an object with keys {', '.join(keys)}" if keys else "an object"
    elif kind in _EXPECTED:
        expected = _EXPECTED[kind]
    elif kind == "finite_number":
        return f"{at!r} is {value}, expected a finite number"
    elif kind == "literal_error":
        return f"{at!r} is {value!r:.60}, expected {ctx['expected']}"
    elif kind == "too_short":
        return f"{at!r} must hold at least {ctx['min_length']}, got {ctx['actual_length']}"
    elif kind in ("greater_than_equal", "greater_than"):
        op, bound = (">=", ctx["ge"]) if kind == "greater_than_equal" else (">", ctx["gt"])
        return f"{at!r} must be {op} {bound:g}, got {value!r}"
    else:
        return f"{at!r}: {err['msg']}"
    if value is None:
        return f"{at!r} is null, expected {expected}"
    return f"{at!r} is {type(value).__name__} {value!r:.60}, expected {expected}"


def _check_relations(rec: dict, where: str) -> None:
    """What the types cannot say: how a (type-checked) record's keys relate."""
    n = rec["world_size"]
    if rec["source"] == "train":
        t = rec.get("targets")
        if t is not None and not 0 <= t <= rec["tokens"]:
            raise RecordError(f"{where}: 'targets' must be an integer in 0..tokens ({rec['tokens']}), got {t!r}")
        if len(rec["doc_ids"]) != len(rec["seq_lengths"]):
            raise RecordError(f"{where}: doc_ids and seq_lengths differ in length")
        if len(rec["worker_ids"]) != n:
            raise RecordError(f"{where}: worker_ids has {len(rec['worker_ids'])} ids for world_size {n}")
        if len(rec.get("nodes", rec["worker_ids"])) != n:
            raise RecordError(f"{where}: 'nodes' must name each rank's node (a string or null), one per rank")
    if rec["skipped"]:
        if rec["plan"] is not None:
            raise RecordError(f"{where}: a skipped step has no plan, but 'plan' is set")
        return
    if rec["predicted_ms"] is None or (rec["plan"] is None) == (rec["pipeline"] is None):
        raise RecordError(f"{where}: a step that was not skipped needs 'predicted_ms' and one of 'plan' or 'pipeline'")
    if rec["pipeline"] is not None:
        _check_pipeline(rec, where)
        if rec["source"] == "train":
            _check_pipeline_ranks(rec, where)
        return
    _check_plan(rec, where)
    if rec["source"] == "train":
        ranks = rec["ranks"]
        if ranks is None or len(ranks) != n:
            raise RecordError(f"{where}: 'ranks' must hold one entry per rank ({n})")
        n_mb = len(rec["plan"]["micro_batches"])
        for r, entry in enumerate(ranks):  # None: a rank lost after the update had been applied
            if entry is not None and len(entry.get("micro_batch_ms") or []) != n_mb:
                raise RecordError(f"{where}: ranks[{r}].micro_batch_ms must hold one time per micro-batch ({n_mb})")
            if entry is not None and "wait_ms" in entry and len(entry["wait_ms"] or []) != n_mb:
                raise RecordError(f"{where}: ranks[{r}].wait_ms must hold one time per micro-batch ({n_mb})")


def _check_plan(rec: dict, where: str) -> None:
    plan, n, lengths = rec["plan"], rec["world_size"], rec["seq_lengths"]
    if plan["num_devices"] != n:
        raise RecordError(f"{where}: plan.num_devices {plan['num_devices']!r} differs from world_size {n}")
    mbs = plan["micro_batches"]
    if not mbs:
        raise RecordError(f"{where}: plan.micro_batches must be a non-empty list of micro-batches")
    seen: list[int] = []
    for mi, mb in enumerate(mbs):
        used: set[int] = set()
        for gi, g in enumerate(mb):
            at = f"{where}: plan.micro_batches[{mi}][{gi}]"
            ranks = g["ranks"]
            if len(ranks) != g["degree"] or not all(0 <= r < n for r in ranks):
                raise RecordError(f"{at}: ranks {ranks} must be {g['degree']} (its degree) ranks in [0, {n})")
            if not used.isdisjoint(ranks):
                raise RecordError(f"{at}: ranks {sorted(used & set(ranks))} are in two groups of one micro-batch")
            used.update(ranks)
            if not all(0 <= i < len(lengths) for i in g["seq_ids"]):
                raise RecordError(f"{at}: seq_ids {g['seq_ids']} must index seq_lengths (0..{len(lengths) - 1})")
            seen += g["seq_ids"]
    if sorted(seen) != list(range(len(lengths))):
        raise RecordError(f"{where}: the plan must place every sequence of the batch exactly once")
    timeline = rec["timeline"]
    if timeline is None:
        raise RecordError(f"{where}: 'timeline' is null but the record has a plan")
    want = {(mi, gi) for mi, mb in enumerate(mbs) for gi in range(len(mb))}
    if {(t["micro_batch"], t["group"]) for t in timeline} != want:
        raise RecordError(f"{where}: the timeline must have one entry per group of the plan")
    modes, shape = rec.get("recompute"), [len(mb) for mb in mbs]
    if modes is not None and (
        [len(row) for row in modes] != shape or any(m not in RECOMPUTE_MODES for row in modes for m in row)
    ):
        raise RecordError(
            f"{where}: 'recompute' must be null or one mode ({', '.join(RECOMPUTE_MODES)}) per group of the plan, "
            f"{shape} groups per micro-batch; got {modes!r}"
        )


def _check_pipeline(rec: dict, where: str) -> None:
    pipe, n, lengths = rec["pipeline"], rec["world_size"], rec["seq_lengths"]
    p, d = pipe["stages"], pipe["degree"]
    if p < 1 or d < 1 or p * d > n:
        raise RecordError(f"{where}: pipeline.stages x degree ({p!r} x {d!r}) must be positive and fit world_size {n}")
    ranks = pipe["stage_ranks"]
    if len(ranks) != p or any(len(rs) != d for rs in ranks) or len({r for rs in ranks for r in rs}) != p * d:
        raise RecordError(f"{where}: pipeline.stage_ranks must list {p} stages of {d} distinct ranks each")
    if len(pipe["layers"]) != p or len(pipe["checkpointed"]) != p:
        raise RecordError(f"{where}: pipeline.layers and pipeline.checkpointed need one entry per stage ({p})")
    units = pipe["units"]
    if any(len(c) != len(units) for c in pipe["checkpointed"]):
        raise RecordError(f"{where}: pipeline.checkpointed[stage] needs one entry per unit ({len(units)})")
    covered: dict[int, list[tuple[int, int]]] = {}
    for ui, u in enumerate(units):
        for piece in u.get("pieces") or []:
            if not 0 <= piece[0] < len(lengths):
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
    if {(o["stage"], o["kind"], o["unit"]) for o in pipe["ops"]} != want or len(pipe["ops"]) != len(want):
        raise RecordError(f"{where}: pipeline.ops must hold one F and one B per unit and stage")


def _check_pipeline_ranks(rec: dict, where: str) -> None:
    ranks, pipe = rec["ranks"], rec["pipeline"]
    if ranks is None or len(ranks) != rec["world_size"]:
        raise RecordError(f"{where}: 'ranks' must hold one entry per rank ({rec['world_size']})")
    in_stage = {r for rs in pipe["stage_ranks"] for r in rs}
    n_units = len(pipe["units"])
    for r, entry in enumerate(ranks):
        if entry is None:
            continue
        ops = entry.get("ops")
        if ops is None or len(ops) != (2 * n_units if r in in_stage else 0):
            raise RecordError(
                f"{where}: ranks[{r}].ops must hold its stage's {2 * n_units} measured ops"
                if r in in_stage
                else f"{where}: ranks[{r}] is in no stage, its ops must be empty"
            )
        seen = set()
        for o in ops:
            if not 0 <= o["unit"] < n_units or (o["kind"], o["unit"]) in seen or o["start_ms"] > o["end_ms"]:
                raise RecordError(
                    f"{where}: ranks[{r}].ops entry {o!r:.80} must be {{kind: F|B, unit, start_ms <= end_ms, "
                    "wait_ms >= 0 if given}, each (kind, unit) once"
                )
            seen.add((o["kind"], o["unit"]))
