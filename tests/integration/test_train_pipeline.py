"""`pipeline_stages` in training: real Ray worker actors, one stage per group of actors, p2p over gloo.

The invariant with pipelines: 2 and 4 stages (and 'auto'), with and without Seq1F1B segments and activation
checkpointing (what the planner chose is read back from the records, so each case is known to exercise it), give
the single-process reference's per-step losses and parameters, replicas identical. A worker killed in the middle
of a pipelined step: the run shrinks, the survivors are re-mapped onto stages and the step re-runs, the ledger
and the math intact.
"""

from __future__ import annotations

import pytest

from flexorch.config import ModelConfig, PipelineSettings
from flexorch.config.sharding import ShardingSettings
from flexorch.control.driver import TrainingDriver
from flexorch.data.stream import DocumentStream
from flexorch.records.writer import read_records
from tests.train_helpers import (
    assert_params_close,
    check_against_reference,
    reference_losses_and_params,
    run_driver,
    train_config,
    training_env,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    yield from training_env(tmp_path_factory, "pipeline")


def _cfg(env, name, stages, tokens_per_worker, **kw):
    root, corpus_dir, profile, _ = env
    return train_config(
        corpus_dir,
        root / name,
        profile,
        pipeline={"stages": stages, **kw.pop("pipeline", {})},
        plan={"tokens_per_worker": tokens_per_worker},
        **{"model": ModelConfig(num_layers=4), **kw},
    )


def _check(cfg, corpus, records, replicas):
    stage_local = cfg.pipeline.params == "stage"
    check_against_reference(cfg, corpus, records, replicas, whole=not stage_local)
    on_disk = read_records(cfg.run_dir + "/steps.jsonl", validate=True)  # the documented schema, flexorch.step/4
    assert [r["step"] for r in on_disk] == list(range(cfg.steps))
    if stage_local:
        _assert_stage_local(cfg, records[-1], replicas)


def _assert_stage_local(cfg, rec, replicas):
    """After the last step each rank holds exactly its stage's parts, and the bytes it reported for parameters,
    gradients and AdamW's two moments and step count are those parts' and no more."""
    from flexorch.work.placement import part_of, placement
    from flexorch.workers.model import init_model

    pipe = rec["pipeline"]
    shapes = {n: p.numel() for n, p in init_model(cfg.model, 0).named_parameters()}
    want = placement(pipe["stage_ranks"], pipe["layers"], rec["world_size"], cfg.model.tie_embeddings)
    for rank, params in enumerate(replicas):
        assert {part_of(n) for n, _ in params} == want[rank], f"rank {rank}"
        held = [n for n in shapes if part_of(n) in want[rank]]
        assert rec["ranks"][rank]["param_bytes"] == sum(16 * shapes[n] + 4 for n in held)  # float32 p, g, m, v
    assert pipe["params"]["placement"] == "stage"
    whole = sum(16 * v + 4 for v in shapes.values())
    in_stage = [r for rs in pipe["stage_ranks"] for r in rs]
    assert max(rec["ranks"][r]["param_bytes"] for r in in_stage) < whole


def _segments(rec) -> int:
    return sum(1 for u in rec["pipeline"]["units"] for piece in u["pieces"] if piece[1] > 0)


def _checkpointed(rec) -> int:
    return sum(sum(c) for c in rec["pipeline"]["checkpointed"])


def _per_stage(rec):
    """(checkpointed layers, the stage's layers) for each unit on each stage."""
    pipe = rec["pipeline"]
    return [(c, pipe["layers"][r]) for r, row in enumerate(pipe["checkpointed"]) for c in row]


@pytest.mark.parametrize(
    "stages,tokens_per_worker,degree,segments,checkpointing,recompute",
    [
        # roomy memory: whole documents packed, nothing recomputed; 2 workers per stage
        (2, 256, 2, False, False, None),
        # the same told to recompute every layer ([sharding] activation_checkpointing = 'full')
        (2, 256, 2, False, "every layer", "full"),
        # tight memory: long documents in segments with their K/V cache, checkpointing, at times back-to-back
        # pipelines (the last stage keeps a whole document's logits until its backward)
        (4, 64, 1, True, True, None),
        ("auto", 48, None, True, True, None),  # the split can change from step to step (2x2 or 4x1)
    ],
)
def test_pipelined_training_equals_the_reference(
    env, stages, tokens_per_worker, degree, segments, checkpointing, recompute
):
    # stage-local parameters (the default): each worker holds its stage's layers only; 'auto' moves them between
    # workers whenever the split changes
    sharding = {} if recompute is None else {"sharding": ShardingSettings(activation_checkpointing=recompute)}
    cfg = _cfg(env, f"pp-{stages}-{tokens_per_worker}-{recompute}", stages, tokens_per_worker, **sharding)
    assert cfg.recompute == (recompute or "auto")  # unset with stages: their checkpointing ILP
    records, replicas = run_driver(cfg, env[3])
    for r in records:
        pipe = r["pipeline"]
        assert r["plan"] is None and pipe is not None and r["status"].startswith("pipeline")
        assert pipe["stages"] * pipe["degree"] <= 4 and sum(pipe["layers"]) == 4
        if stages != "auto":
            assert (pipe["stages"], pipe["degree"]) == (stages, degree)
        in_stage = {x for rs in pipe["stage_ranks"] for x in rs}
        for rank, entry in enumerate(r["ranks"]):  # every stage rank ran one F and one B per unit, in plan order
            want = 2 * len(pipe["units"]) if rank in in_stage else 0
            assert len(entry["ops"]) == want
        assert set(r["baselines_ms"]) == {"1f1b", "seq1f1b-4"}  # null where a baseline cannot fit the memory
        fitting = [v for v in r["baselines_ms"].values() if v is not None]
        assert r["predicted_ms"] <= min(fitting, default=float("inf")) + 1e-9
    assert any(_segments(r) for r in records) == segments
    if checkpointing == "every layer":
        assert all(c == pipe_layers for r in records for c, pipe_layers in _per_stage(r)), "every layer recomputed"
    else:
        assert any(_checkpointed(r) for r in records) == checkpointing
    moved = [r["pipeline"]["params"]["moved_parts"] for r in records]
    assert moved == _expected_moves(records)  # exactly the parts a changed stage map left without a copy
    _check(cfg, env[3], records, replicas)


def _expected_moves(records) -> list[int]:
    from flexorch.work.placement import ALL, model_parts, placement, transfers

    held, out = dict.fromkeys(range(4), ALL), []  # every worker starts with the whole model
    for r in records:
        pipe = r["pipeline"]
        need = dict(enumerate(placement(pipe["stage_ranks"], pipe["layers"], r["world_size"], False)))
        out.append(sum(len(ps) for srcs in transfers(held, need, model_parts(4)).values() for ps in srcs.values()))
        held = need
    return out


def test_worker_killed_mid_pipeline_is_remapped_and_the_step_reruns(env):
    # 4 workers as 2 stages x 2; worker 3 (stage 1) dies after its first forward of step 1: the 3 survivors form
    # 2 stages x 1 with one rank sitting out, the same batch re-runs, nothing lost or trained twice
    cfg = _cfg(env, "pp-kill", 2, 128, steps=3)
    records, replicas = run_driver(cfg, env[3], faults=[(3, "micro_batch", 1, 1, "exit")])
    assert [r["world_size"] for r in records] == [4, 3, 3]
    rec = records[1]["recoveries"][0]
    assert rec["lost"] == [3] and not rec["step_completed"] and rec["recovery_ms"] < 30_000
    assert records[0]["pipeline"]["stage_ranks"] == [[0, 1], [2, 3]]
    assert records[1]["pipeline"]["stage_ranks"] == [[0], [1]]
    assert records[1]["ranks"][2]["ops"] == []  # the rank left over sat the step out
    # stage-local parameters: worker 1 (now stage 1 alone) got stage 1's layers and head from worker 2, the last
    # survivor that held them; worker 2, left over, dropped them
    assert [r["pipeline"]["params"]["moved_parts"] for r in records] == [0, 3, 0]
    from flexorch.work.placement import part_of
    from flexorch.workers.model import init_model

    stage1 = [p for n, p in init_model(cfg.model, 0).named_parameters() if part_of(n) in ("layer:2", "layer:3", "head")]
    # each parameter with its two AdamW moments (float32) and step count
    assert records[1]["pipeline"]["params"]["moved_bytes"] == sum(12 * p.numel() + 4 for p in stage1)
    assert records[1]["ranks"][2]["param_bytes"] == 0
    _check(cfg, env[3], records, replicas)


def test_checkpoint_of_a_pipelined_run_resumes_on_other_stages(env):
    # each worker holds its stage's parts only, but the checkpoint is the whole model assembled from the stages'
    # holders, so it does not depend on the stage layout: 2 steps on 2 stages, checkpoint, "crash", resume on 4
    # stages for 2 more; together they equal the reference on the same batches
    import dataclasses

    from flexorch.control.checkpoint import latest_checkpoint, load_checkpoint
    from flexorch.workers.model import init_model

    first_cfg = _cfg(env, "pp-resume", 2, 128, steps=4)
    driver = TrainingDriver(first_cfg, corpus=env[3])
    try:
        driver.setup()
        first = [driver.step().record for _ in range(2)]
        driver.checkpoint()
    finally:
        driver.shutdown()
    state, _ = load_checkpoint(latest_checkpoint(first_cfg.run_dir))
    names = [n for n, _ in init_model(first_cfg.model, 0).named_parameters()]
    assert sorted(state["model"]) == sorted(names)
    assert len(state["optimizer"]["state"]) == len(names)  # every parameter's AdamW moments, from its stage
    resumed_cfg = dataclasses.replace(first_cfg, resume=True, pipeline=PipelineSettings(stages=4))
    rest, replicas = run_driver(resumed_cfg, env[3])
    assert [r["step"] for r in first + rest] == [0, 1, 2, 3]
    assert [r["pipeline"]["stages"] for r in first + rest] == [2, 2, 4, 4]
    full = dataclasses.replace(first_cfg, steps=4)
    stream = DocumentStream(env[3].num_docs, full.batch_size, full.seed)
    assert [r["doc_ids"] for r in first + rest] == [list(stream.next_batch().doc_ids) for _ in range(4)]
    ref_losses, ref_params = reference_losses_and_params(full, env[3], first + rest)
    assert [r["loss"] for r in first + rest] == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
    assert_params_close(replicas, ref_params, whole=False)
    _assert_stage_local(resumed_cfg, rest[-1], replicas)


@pytest.mark.parametrize("params,tied", [("stage", True), ("replicated", False)])
def test_tied_embeddings_and_whole_replicas(env, params, tied):
    # stage-local with a tied embedding: the first and the last stage both hold it and sum its gradient over the
    # four ranks; 'replicated': every worker keeps the whole model, nothing moves
    cfg = _cfg(
        env,
        f"pp-{params}-{tied}",
        2,
        128,
        pipeline={"params": params},
        model=ModelConfig(num_layers=4, tie_embeddings=tied),
    )
    records, replicas = run_driver(cfg, env[3])
    assert all(r["pipeline"]["stage_ranks"] == [[0, 1], [2, 3]] for r in records)
    if params == "replicated":
        assert all("params" not in r["pipeline"] for r in records)
        assert len({e["param_bytes"] for r in records[1:] for e in r["ranks"]}) == 1  # the whole model on every rank
    _check(cfg, env[3], records, replicas)


def test_a_stage_lost_with_its_only_holder_rolls_back_to_the_checkpoint(env):
    # 2 stages x 1 worker: each stage's layers live on one worker. Worker 1 dies in step 2: stage 1's layers are
    # gone. A replacement starts (min_workers = 2), the run loads the checkpoint of step 2 on both and trains step 2
    # again; the ledger, losses and parameters equal the uninterrupted reference
    cfg = _cfg(env, "pp-rollback", 2, 128, steps=4, workers=2, checkpoint_every=1)
    records, replicas = run_driver(cfg, env[3], faults=[(1, "micro_batch", 2, 1, "exit")])
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert [r["worker_ids"] for r in records] == [[0, 1], [0, 1], [0, 2], [0, 2]]
    back = records[2]["recoveries"]
    assert [b.get("rollback") for b in back] == [True]
    assert back[0]["lost"] == [1] and back[0]["from_step"] == back[0]["to_step"] == 2
    on_disk = read_records(cfg.run_dir + "/steps.jsonl", validate=True)
    assert [r["step"] for r in on_disk] == [0, 1, 2, 3]  # step 2 recorded once, as re-trained
    _check(cfg, env[3], records, replicas)


def test_a_lost_stage_without_a_checkpoint_is_a_clear_error(env):
    from flexorch.control.elastic import ElasticError

    cfg = _cfg(env, "pp-lost", 2, 128, steps=3, workers=2)
    with pytest.raises(
        ElasticError, match=r"layer:2.*held only by lost workers \[1\].*no checkpoint yet.*checkpoint_every"
    ):
        run_driver(cfg, env[3], faults=[(1, "micro_batch", 1, 1, "exit")])
