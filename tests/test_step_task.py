"""Pure per-rank dispatch: every rank's task, built in one process from real plans."""

from __future__ import annotations

import pytest

from flexorch.solver.baselines import static_plan
from flexorch.solver.planner import plan_step
from flexorch.tasks.step import DocRef, step_tasks
from tests.solver_helpers import TINY


def _docs(lengths):
    return [DocRef(doc_id=100 + i, block=i % 3, offset=7 * i, length=s) for i, s in enumerate(lengths)]


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_every_document_reaches_exactly_its_groups_ranks(n):
    lengths = [min(s, 100 * n) for s in [3, 50, 7, 120, 9, 9, 31, 64, 2, 200][: 3 + n]]
    plan = plan_step(lengths, n, TINY.with_overrides(hidden=64, num_heads=8, num_kv_heads=8)).plan
    docs = _docs(lengths)
    tasks = step_tasks(plan, docs, step=5)
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
    tasks = step_tasks(plan, _docs(lengths), step=0)
    assert all(w.degree == 2 and w.kind == "ring" for t in tasks for w in t.work)
    with pytest.raises(ValueError, match="3 documents"):
        step_tasks(plan, _docs(lengths)[:3], step=0)
    bad = _docs(lengths)
    bad[1] = DocRef(1, 0, 0, 21)
    with pytest.raises(ValueError, match="plan says 20 tokens"):
        step_tasks(plan, bad, step=0)


def test_pipeline_tasks_create_each_stage_group_and_each_gradient_channel():
    """Every rank creates the SP groups of the stages and one group per neighbour pair for the gradients (NCCL
    would deadlock with activations and gradients of one pair on one communicator)."""
    from flexorch.tasks.pipeline import PipelineTask, gradient_channels

    assert gradient_channels([(0, 1), (2, 3), (4, 5)]) == [(0, 2), (1, 3), (2, 4), (3, 5)]
    assert gradient_channels([(0,), (1,), (2,)]) == [(0, 1), (1, 2)]
    assert gradient_channels([(0, 1, 2, 3)]) == []
    task = PipelineTask(0, 0, 6, 0, ((0, 1), (2, 3), (4, 5)), (1, 1, 1), (), (), 0)
    assert task.rank_sets == ((0, 1), (2, 3), (4, 5), (0, 2), (1, 3), (2, 4), (3, 5))
    assert PipelineTask(0, 3, 4, None, ((0,), (1,), (2,)), (2, 1, 1), (), (), 0).rank_sets == ((0, 1), (1, 2))
