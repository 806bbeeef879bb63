"""The elastic policy and membership bookkeeping: pure values, no Ray (docs/design.md §4)."""

from __future__ import annotations

import pytest

from flexorch.control.failures import Failure
from flexorch.control.membership import (
    ElasticPolicy,
    Fail,
    Grow,
    Membership,
    Retry,
    Shrink,
    WaitForCapacity,
)


def test_worker_ids_are_stable_and_ranks_follow_them():
    m = Membership(range(4))
    assert m.worker_ids == (0, 1, 2, 3) and m.rank_of(2) == 2
    m.remove([1])
    assert m.worker_ids == (0, 2, 3) and m.rank_of(2) == 1, "ranks are re-assigned, ids are not"
    new = m.new_ids(2)
    assert new == [4, 5], "ids are never reused"
    m.add(new)
    assert m.worker_ids == (0, 2, 3, 4, 5) and m.size == 5
    assert m.next_epoch() == 1 and m.next_epoch() == 2
    with pytest.raises(KeyError, match="not members"):
        m.remove([1])


def test_lost_worker_with_enough_survivors_shrinks():
    p = ElasticPolicy(min_workers=2, max_workers=4)
    d = p.on_failure([0, 1, 2, 3], Failure(lost=frozenset({2}), peer_errors=frozenset({0, 1, 3})), attempt=0)
    assert d == Shrink(lost=(2,), survivors=(0, 1, 3))
    d = p.on_failure([0, 1, 2, 3], Failure(lost=frozenset({1, 3})), attempt=1)
    assert d == Shrink(lost=(1, 3), survivors=(0, 2))


def test_below_min_waits_for_capacity_all_lost_fails():
    p = ElasticPolicy(min_workers=3, max_workers=4, wait_s=7.0)
    d = p.on_failure([0, 1, 2, 3], Failure(lost=frozenset({0, 1})), attempt=0)
    assert d == WaitForCapacity(lost=(0, 1), survivors=(2, 3), need=1, timeout_s=7.0)
    d = p.on_failure([0, 1, 2, 3], Failure(lost=frozenset({0, 1, 2, 3})), attempt=0)
    assert isinstance(d, Fail) and "all 4 workers were lost" in d.reason


def test_deterministic_error_fails_at_once_and_attempts_are_bounded():
    p = ElasticPolicy(min_workers=1, max_workers=4, max_attempts=3)
    d = p.on_failure([0, 1], Failure(lost=frozenset(), errors=((1, "ValueError: token 300 out of range"),)), 0)
    assert isinstance(d, Fail) and "worker 1" in d.reason and "token 300" in d.reason
    assert isinstance(p.on_failure([0, 1], Failure(lost=frozenset(), peer_errors=frozenset({0, 1})), 0), Retry)
    d = p.on_failure([0, 1, 2], Failure(lost=frozenset({2})), attempt=2)
    assert isinstance(d, Fail) and "3 failed attempts" in d.reason


def test_growth_fills_free_slots_up_to_max_counting_joiners():
    p = ElasticPolicy(min_workers=1, max_workers=6)
    assert p.at_boundary(size=4, joining=0, free_slots=8) == Grow(2)
    assert p.at_boundary(size=4, joining=1, free_slots=8) == Grow(1)
    assert p.at_boundary(size=4, joining=0, free_slots=1) == Grow(1)
    assert p.at_boundary(size=6, joining=0, free_slots=8) is None
    assert p.at_boundary(size=4, joining=0, free_slots=0) is None
    with pytest.raises(ValueError, match="min_workers <= max_workers"):
        ElasticPolicy(min_workers=5, max_workers=4)


def test_config_resolves_and_checks_elastic_bounds():
    import dataclasses

    from flexorch.config import ConfigError, CorpusConfig, ElasticSettings, PlanSettings, TrainConfig

    data = CorpusConfig(max_context=256)
    plan = PlanSettings(tokens_per_worker=128)
    cfg = TrainConfig(workers=4, data=data, plan=PlanSettings(tokens_per_worker=64))
    assert (cfg.min_workers, cfg.max_workers) == (4, 4), "256 tokens need a 4-worker group of 64 each"
    cfg = TrainConfig(workers=4, data=data, plan=plan, elastic=ElasticSettings(max_workers=8))
    assert (cfg.min_workers, cfg.max_workers) == (2, 8)
    assert cfg.to_dict()["elastic"]["min_workers"] is None, "the file's value; the bound in force is derived"
    # derived again for each config: halving the budget doubles the floor
    assert dataclasses.replace(cfg, plan=PlanSettings(tokens_per_worker=64)).min_workers == 4
    with pytest.raises(ConfigError, match="elastic.min_workers=1 is too few.*set elastic.min_workers >= 2"):
        TrainConfig(workers=4, data=data, plan=plan, elastic=ElasticSettings(min_workers=1))
    with pytest.raises(ConfigError, match="elastic.min_workers <= workers <= elastic.max_workers, got 2 <= 4 <= 3"):
        TrainConfig(workers=4, data=data, plan=plan, elastic=ElasticSettings(max_workers=3))
    with pytest.raises(ConfigError, match="needs 4"):
        TrainConfig(
            workers=4, data=data, plan=PlanSettings(tokens_per_worker=128, mode="static-ring-4"),
            elastic=ElasticSettings(min_workers=2),
        )  # fmt: skip


def test_ranks_are_contiguous_per_node_after_every_change():
    nodes = {0: "a", 1: "b", 2: "a", 3: "b", 4: "c"}
    m = Membership(range(5), nodes)
    assert m.worker_ids == (0, 2, 1, 3, 4)  # node a (0, 2), node b (1, 3), node c (4)
    assert m.node_sizes() == [("a", 2), ("b", 2), ("c", 1)]
    m.remove([0])  # node a's smallest id is gone: a now sorts by 2, after b's 1
    assert m.worker_ids == (1, 3, 2, 4)
    assert m.node_sizes() == [("b", 2), ("a", 1), ("c", 1)]
    new = m.new_ids(2)
    assert new == [5, 6]
    m.add(new, {5: "a", 6: "c"})  # joiners go beside their node's workers, not at the end
    assert m.worker_ids == (1, 3, 2, 5, 4, 6)
    assert [m.node_of(w) for w in m.worker_ids] == ["b", "b", "a", "a", "c", "c"]
    with pytest.raises(KeyError):
        m.remove([0])


def test_blind_ranks_are_ascending_ids_and_unknown_nodes_are_one_node():
    nodes = {0: "a", 1: "b", 2: "a", 3: "b"}
    blind = Membership(range(4), nodes, by_node=False)
    assert blind.worker_ids == (0, 1, 2, 3)
    assert blind.node_sizes() == [("a", 1), ("b", 1), ("a", 1), ("b", 1)]
    assert Membership(range(3)).node_sizes() == [(None, 3)]
