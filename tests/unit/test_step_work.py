"""Pure per-rank dispatch: every rank's task, built in one process from real plans."""

from __future__ import annotations

import pytest

from flexorch.solver.baselines import static_plan
from flexorch.solver.planner import plan_step
from flexorch.work.step import DocRef, GroupWork, StepWork, step_work
from tests.solver_helpers import TINY


def _docs(lengths):
    return [DocRef(doc_id=100 + i, block=i % 3, offset=7 * i, length=s) for i, s in enumerate(lengths)]


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_every_document_reaches_exactly_its_groups_ranks(n):
    lengths = [min(s, 100 * n) for s in [3, 50, 7, 120, 9, 9, 31, 64, 2, 200][: 3 + n]]
    plan = plan_step(lengths, n, TINY.with_overrides(hidden=64, num_heads=8, num_kv_heads=8)).plan
    docs = _docs(lengths)
    tasks = step_work(plan, docs, step=5)
    assert [t.rank for t in tasks] == list(range(n))
    assert {t.num_predicted for t in tasks} == {sum(s - 1 for s in lengths)}
    assert {t.rank_sets for t in tasks} == {
        tuple(
            sorted(
                {tuple(g.ranks) for mb in plan.micro_batches for g in mb.groups if g.degree > 1},
                key=lambda r: (len(r), r),
            )
        )
    }
    seen = []
    for mi, mb in enumerate(plan.micro_batches):
        for g in mb.groups:
            for r in g.ranks:
                work = [w for w in tasks[r].work if w.micro_batch == mi]
                assert len(work) == 1, "a rank is in exactly one group per micro-batch"
                assert work[0].ranks == g.ranks and work[0].kind == g.kind
                assert [d.doc_id for d in work[0].docs] == [100 + i for i in g.seq_ids]
            seen.extend(g.seq_ids)
    assert sorted(seen) == list(range(len(lengths)))
    for t in tasks:  # work is in micro-batch order and names only this rank's groups
        assert [w.micro_batch for w in t.work] == sorted(w.micro_batch for w in t.work)
        assert all(t.rank in w.ranks for w in t.work)


def test_static_plan_tasks_and_mismatch_errors():
    lengths = [10, 20, 30, 40]
    plan = static_plan(lengths, 4, TINY.with_overrides(hidden=64, num_heads=8, num_kv_heads=8), 2, "ring")
    tasks = step_work(plan, _docs(lengths), step=0)
    assert all(w.degree == 2 and w.kind == "ring" for t in tasks for w in t.work)
    with pytest.raises(ValueError, match="3 documents"):
        step_work(plan, _docs(lengths)[:3], step=0)
    bad = _docs(lengths)
    bad[1] = DocRef(1, 0, 0, 21)
    with pytest.raises(ValueError, match="plan says 20 tokens"):
        step_work(plan, bad, step=0)


def test_pipeline_tasks_create_each_stage_group_and_each_gradient_channel():
    """Every rank creates the SP groups of the stages and one group per neighbour pair for the gradients (NCCL
    would deadlock with activations and gradients of one pair on one communicator)."""
    from flexorch.work.pipeline import PipelineWork, gradient_channels

    assert gradient_channels([(0, 1), (2, 3), (4, 5)]) == [(0, 2), (1, 3), (2, 4), (3, 5)]
    assert gradient_channels([(0,), (1,), (2,)]) == [(0, 1), (1, 2)]
    assert gradient_channels([(0, 1, 2, 3)]) == []
    task = PipelineWork(0, 0, 6, 0, ((0, 1), (2, 3), (4, 5)), (1, 1, 1), (), (), 0)
    assert task.rank_sets == ((0, 1), (2, 3), (4, 5), (0, 2), (1, 3), (2, 4), (3, 5))
    assert PipelineWork(0, 3, 4, None, ((0,), (1,), (2,)), (2, 1, 1), (), (), 0).rank_sets == ((0, 1), (1, 2))


# ---- the values that cross the actor boundary check themselves, naming the numbers


def _unit(seq: int = 0, tokens: int = 4):
    from flexorch.solver.pipeline.chunking import Piece, Unit

    return Unit(pieces=(Piece(seq, 0, tokens),), chain=seq, position=0, work=1.0)


@pytest.mark.parametrize(
    "args, msg",
    [
        ((3, 0, -1, 5), "DocRef.offset (document 3) must be an integer >= 0, got -1"),
        ((3, 0, 0, 0), "DocRef.length (document 3) must be an integer >= 1, got 0"),
        ((-2, 0, 0, 4), "DocRef.doc_id (document -2) must be an integer >= 0, got -2"),
        ((3, -7, 0, 4), "DocRef.block (document 3) must be an integer >= 0, got -7"),
        ((3, 1.5, 0, 4), "DocRef.block (document 3) must be an integer >= 0, got 1.5"),
        ((3, 0, 0, True), "DocRef.length (document 3) must be an integer >= 1, got True"),
    ],
)
def test_doc_ref_refuses_an_impossible_location(args, msg):
    with pytest.raises(ValueError) as e:
        DocRef(*args)
    assert msg in str(e.value)


@pytest.mark.parametrize(
    "args, msg",
    [
        ((-1, (0,), "ulysses", ()), "GroupWork.micro_batch must be an integer >= 0, got -1"),
        ((2, (0, 1, 2), "ulysses", ()), "GroupWork (micro-batch 2) ranks (0, 1, 2): degree 3 is not a power of two"),
        ((2, (1, 1), "ring", ()), "GroupWork (micro-batch 2) ranks (1, 1) names a rank twice"),
        ((2, (), "ring", ()), "GroupWork (micro-batch 2) ranks must be a non-empty tuple of ranks, got ()"),
        ((2, (0, -4), "ring", ()), "GroupWork (micro-batch 2) ranks: rank must be an integer >= 0, got -4"),
        (
            (2, (0, 1), "flash", ()),
            "GroupWork (micro-batch 2) kind must be one of ('ulysses', 'ring', 'hybrid'), got 'flash'",
        ),
        ((2, (0, 1), "ring", ((1, 0, 0, 4),)), "GroupWork (micro-batch 2) docs must be a tuple of DocRef"),
    ],
)
def test_group_work_refuses_a_malformed_group(args, msg):
    with pytest.raises(ValueError) as e:
        GroupWork(*args)
    assert msg in str(e.value)


def _group(mb: int, ranks: tuple, *lengths: int) -> GroupWork:
    return GroupWork(mb, ranks, "ulysses", tuple(DocRef(10 * mb + i, 0, 0, s) for i, s in enumerate(lengths)))


@pytest.mark.parametrize(
    "args, msg",
    [
        ((-3, 0, 4, (), (), 0), "StepWork.step must be an integer >= 0, got -3"),
        ((1, 0, 0, (), (), 0), "StepWork (step 1) world_size must be an integer >= 1, got 0"),
        ((1, 4, 4, (), (), 0), "StepWork (step 1): rank 4 is outside the world of 4"),
        ((1, 0, 4, (), (), -5), "StepWork (step 1) num_predicted must be an integer >= 0, got -5"),
        ((1, 0, 4, ((4, 5),), (), 0), "StepWork (step 1, rank 0): rank set (4, 5): rank 4 is outside the world of 4"),
        (
            (1, 0, 4, ((2, 3),), (_group(0, (2, 3), 5),), 9),
            "StepWork (step 1, rank 0): micro-batch 0 group (2, 3) does not include rank 0",
        ),
        (
            (1, 0, 4, ((2, 3),), (_group(0, (0, 1), 5),), 9),
            "StepWork (step 1, rank 0): micro-batch 0 group (0, 1) is not in rank_sets",
        ),
        (
            (1, 0, 4, (), (_group(1, (0,), 5), _group(0, (0,), 5)), 9),
            "micro-batch 0 follows 1",
        ),
        (
            (1, 0, 4, (), (_group(0, (0,), 5, 6),), 4),
            "StepWork (step 1, rank 0): micro-batch 0 alone predicts 9 tokens, more than the batch's num_predicted 4",
        ),
    ],
)
def test_step_work_refuses_work_the_rank_cannot_run(args, msg):
    with pytest.raises(ValueError) as e:
        StepWork(*args)
    assert msg in str(e.value)


def test_a_step_task_that_holds_together_is_accepted():
    task = StepWork(1, 1, 4, ((0, 1),), (_group(0, (0, 1), 5), _group(2, (1,), 3)), 6)
    assert task.blocks() == {0} and [w.degree for w in task.work] == [2, 1]


@pytest.mark.parametrize(
    "args, msg",
    [
        (((_unit(),), (("F", 0), ("B", 0)), (0, 0)), "StagePipeline: 2 checkpointing entries for 1 units"),
        (
            ((_unit(),), (("F", 0), ("B", 0)), (-1,)),
            "StagePipeline: checkpointed layers of a unit must be an integer >= 0, got -1",
        ),
        (((_unit(),), (("F", 0), ("B", 3)), (0,)), "StagePipeline: op ('B', 3) is not ('F' | 'B', a unit in 0..0)"),
        (((_unit(),), (("B", 0), ("F", 0)), (0,)), "StagePipeline: the backward of unit 0 comes before its forward"),
        (((_unit(),), (("F", 0), ("F", 0)), (0,)), "StagePipeline: op ('F', 0) appears twice"),
        (
            ((_unit(), _unit(1)), (("F", 0), ("F", 1), ("B", 0)), (0, 0)),
            "2 units need 4 ops, got 3 (missing [('B', 1)])",
        ),
    ],
)
def test_stage_pipeline_refuses_an_op_list_that_cannot_run(args, msg):
    from flexorch.work.pipeline import StagePipeline

    with pytest.raises(ValueError) as e:
        StagePipeline(*args)
    assert msg in str(e.value)


STAGES = ((0, 1), (2, 3), (4, 5))


@pytest.mark.parametrize(
    "change, msg",
    [
        ({"rank": 6}, "PipelineWork (step 0, rank 6): rank 6 is outside the world of 6"),
        ({"world_size": 0}, "PipelineWork (step 0) world_size must be an integer >= 1, got 0"),
        ({"stage_ranks": ()}, "stage_ranks names no stage"),
        ({"stage_ranks": ((0, 1), (2, 3), (4, 6))}, "stage 2 ranks (4, 6): rank 6 is outside the world of 6"),
        ({"stage_ranks": ((0, 1), (2, 3), (4,))}, "stages of [1, 2] ranks; every stage needs the same number of ranks"),
        ({"stage_ranks": ((0, 1), (1, 2), (4, 5))}, "stage_ranks ((0, 1), (1, 2), (4, 5)) put a rank on two stages"),
        ({"layers": (1, 1)}, "PipelineWork (step 0, rank 0): 2 layer counts for 3 stages"),
        ({"layers": (1, 0, 1)}, "layers of stage 1 must be an integer >= 1, got 0"),
        ({"stage": 1}, "PipelineWork (step 0, rank 0): rank 0 is not on stage 1 (2, 3)"),
        ({"stage": 3}, "PipelineWork (step 0, rank 0): stage 3 of 3 stages"),
        ({"stage": None}, "PipelineWork (step 0, rank 0): rank 0 is on a stage, but stage is None"),
        ({"num_predicted": 5}, "num_predicted is 5, the 1 documents predict 3 tokens"),
        ({"layers": (1, 2, 1)}, None),  # the base task, with a checkpointing that fits
        (
            {"layers": (1, 2, 1), "ckpt": 2},
            "PipelineWork (step 0, rank 0): 2 checkpointed layers on stage 0 of 1 layers",
        ),
    ],
)
def test_pipeline_task_refuses_a_stage_map_the_ranks_cannot_run(change, msg):
    from flexorch.work.pipeline import PipelineWork, StagePipeline

    change = dict(change)
    pipe = StagePipeline((_unit(0, 4),), (("F", 0), ("B", 0)), (change.pop("ckpt", 1),))
    base = dict(
        step=0, rank=0, world_size=6, stage=0, stage_ranks=STAGES, layers=(1, 1, 1), pipelines=(pipe,),
        docs=(DocRef(0, 0, 0, 4),), num_predicted=3,
    )  # fmt: skip
    if msg is None:
        assert PipelineWork(**{**base, **change}).blocks() == {0}
        return
    with pytest.raises(ValueError) as e:
        PipelineWork(**{**base, **change})
    assert msg in str(e.value)


def test_a_rank_on_no_stage_runs_no_pipeline():
    from flexorch.work.pipeline import PipelineWork, StagePipeline

    pipe = StagePipeline((_unit(),), (("F", 0), ("B", 0)), (0,))
    with pytest.raises(ValueError, match=r"rank 6\): a rank on no stage runs no pipeline, got 1"):
        PipelineWork(0, 6, 7, None, STAGES, (1, 1, 1), (pipe,), (), 0)
