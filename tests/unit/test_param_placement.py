"""Stage-local parameters, the pure part: which rank holds which model part, what moves when the stage map changes,
and the gradient buckets every rank derives in the same order (looping over every rank in one process)."""

from __future__ import annotations

import pytest

from flexorch.work.pipeline import PipelineWork
from flexorch.work.placement import (
    ALL,
    PartsLostError,
    holder_sets,
    missing_parts,
    model_parts,
    part_of,
    placement,
    stage_parts,
    transfers,
)

PARTS = model_parts(4)


def test_parts_of_the_decoder_parameters():
    from flexorch.config import ModelConfig
    from flexorch.workers.model import init_model

    model = init_model(ModelConfig(num_layers=3), seed=0)
    parts = {part_of(n) for n, _ in model.named_parameters()}
    assert parts == set(model_parts(3))
    assert part_of("layers.2.attention.wq.weight") == "layer:2"
    with pytest.raises(ValueError, match="no model part"):
        part_of("rotary.inv_freq")


@pytest.mark.parametrize("tied", [False, True])
def test_every_part_is_held_by_exactly_its_stage(tied):
    stage_ranks, layers = [[0, 1], [2, 3]], [2, 2]
    held = placement(stage_ranks, layers, 5, tied)  # rank 4 sits the step out
    assert held[0] == held[1] == {"embed", "layer:0", "layer:1"}
    assert held[2] == held[3] == {"layer:2", "layer:3", "head"} | ({"embed"} if tied else set())
    assert held[4] == frozenset()
    assert set().union(*held) == set(PARTS)
    # each layer lives on one stage only: a worker holds its stage's share of the model
    for r in range(2):
        assert len(stage_parts(layers, r, tied) - {"embed", "head"}) == layers[r]


def test_holder_sets_give_one_bucket_per_set_of_holders():
    held = placement([[0, 1], [2, 3]], [2, 2], 4, tied=True)
    sets = holder_sets(held)
    assert sets == [
        ((0, 1), ("layer:0", "layer:1")),
        ((0, 1, 2, 3), ("embed",)),  # the tied embedding: summed over both stages
        ((2, 3), ("head", "layer:2", "layer:3")),
    ]
    for rank in range(4):  # every part a rank holds is in exactly one of the buckets it takes part in
        mine = [p for ranks, parts in sets if rank in ranks for p in parts]
        assert sorted(mine) == sorted(held[rank])


def test_pipeline_task_creates_the_tied_embedding_group():
    task = PipelineWork(0, 0, 4, 0, ((0, 1), (2, 3)), (2, 2), (), (), 0, stage_params=True, tied=True)
    assert (0, 1, 2, 3) in task.rank_sets and (0, 1) in task.rank_sets and (2, 3) in task.rank_sets
    untied = PipelineWork(0, 0, 4, 0, ((0, 1), (2, 3)), (2, 2), (), (), 0, stage_params=True, tied=False)
    assert (0, 1, 2, 3) not in untied.rank_sets
    replicated = PipelineWork(0, 0, 4, 0, ((0, 1), (2, 3)), (2, 2), (), (), 0, stage_params=False, tied=True)
    assert (0, 1, 2, 3) not in replicated.rank_sets


def test_transfers_from_whole_replicas_move_nothing():
    held = dict.fromkeys(range(4), ALL)
    needed = dict(enumerate(placement([[0, 1], [2, 3]], [2, 2], 4, False)))
    assert transfers(held, needed, PARTS) == {}


def test_a_changed_stage_map_copies_exactly_what_is_missing_from_holders():
    before = dict(enumerate(placement([[0, 1], [2, 3]], [2, 2], 4, False)))  # 2 stages x 2
    after = dict(enumerate(placement([[0], [1], [2], [3]], [1, 1, 1, 1], 4, False)))  # 4 stages x 1
    moves = transfers(before, after, PARTS)
    assert moves == {}  # splitting a stage in two: every rank already held its new stage's parts
    back = transfers(after, before, PARTS)  # 4 x 1 -> 2 x 2: each rank gains its partner's layer
    got = {w: {p for ps in srcs.values() for p in ps} for w, srcs in back.items()}
    assert got == {0: {"layer:1"}, 1: {"embed", "layer:0"}, 2: {"layer:3", "head"}, 3: {"layer:2"}}
    for srcs in back.values():
        for src, parts in srcs.items():
            assert set(parts) <= after[src]  # copied from a worker that holds them


def test_copies_spread_over_the_holders():
    held = {0: frozenset(PARTS), 1: frozenset(PARTS), 2: frozenset(), 3: frozenset()}
    needed = {0: frozenset(PARTS), 1: frozenset(PARTS), 2: frozenset(PARTS), 3: frozenset(PARTS)}
    moves = transfers(held, needed, PARTS)
    load = {0: 0, 1: 0}
    for srcs in moves.values():
        for src, parts in srcs.items():
            load[src] += len(parts)
    assert load[0] + load[1] == 2 * len(PARTS) and abs(load[0] - load[1]) <= 1


def test_a_part_with_no_holder_left_is_lost():
    held = {0: frozenset({"embed", "layer:0", "layer:1"}), 2: frozenset({"layer:2", "layer:3", "head"})}
    assert missing_parts(held, PARTS) == []
    del held[2]
    assert missing_parts(held, PARTS) == ["layer:2", "layer:3", "head"]
    needed = {0: frozenset({"embed", "layer:0", "layer:1"}), 1: frozenset({"layer:2", "layer:3", "head"})}
    with pytest.raises(PartsLostError, match="layer:2, layer:3, head") as e:
        transfers(held, needed, PARTS)
    assert e.value.parts == ("layer:2", "layer:3", "head")
    assert missing_parts({0: ALL}, PARTS) == []
