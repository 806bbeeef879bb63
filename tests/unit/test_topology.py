"""The planner on a cluster's nodes: the topology value, inter-node prices, hybrid groups, placement, planning."""

from __future__ import annotations

import dataclasses
import itertools
import json

import numpy as np
import pytest

from flexorch.solver.cost_model import group_overhead_ms, group_time_ms, seq_time_ms
from flexorch.solver.packing import GroupType, group_types
from flexorch.solver.placement import capacity_rows, counts_fit, place
from flexorch.solver.planner import Planner, PlannerConfig
from flexorch.solver.profiles import Profile, get_profile, load_profile
from flexorch.solver.simulator import step_time_ms
from flexorch.solver.step_planner import StepPlanner
from flexorch.solver.topology import Topology, TopologyError

# hand-checkable prices: 1 layer, 8 heads of dim 1: Ulysses moves 2*1*(2*8 + 2*8)*2 = 128 bytes per token,
# a ring step 3*2*8*2 = 96 bytes per token
HAND = Profile(
    name="hand",
    a1_ms=1e-6,
    a2_ms=1e-3,
    b1_ms=5.0,
    act_bytes_per_token=1.0,
    memory_budget_bytes=1e9,
    num_layers=1,
    hidden=8,
    num_heads=8,
    num_kv_heads=8,
    a2a_gbps={2: 4e-6, 4: 4e-6, 8: 4e-6},  # 4,000 B/s inside a node
    inter_a2a_gbps={16: 1e-6},  # 1,000 B/s across nodes
    inter_p2p_gbps={2: 2e-6},  # 2,000 B/s for a ring across nodes
    a2a_latency_ms={8: 1.0},
    inter_a2a_latency_ms={16: 7.0},
    inter_p2p_latency_ms={2: 3.0},
)


# ---- the value


def test_topology_value():
    t = Topology((8, 8, 7), ("a", "b", "c"))
    assert t.num_devices == 23 and t.num_nodes == 3 and t.max_node_size == 8 and t.nominal_node_size == 8
    assert [t.node_of(r) for r in (0, 7, 8, 15, 16, 22)] == [0, 0, 1, 1, 2, 2]
    assert not t.spans(range(8, 16)) and t.spans(range(12, 20)) and not t.spans([]) and not t.spans([16])
    assert Topology.single(5) == Topology((5,)) and Topology.uniform(3, 4).node_sizes == (4, 4, 4)
    assert Topology.from_dict(json.loads(json.dumps(t.to_dict()))) == t
    assert Topology.from_dict({"node_sizes": [2, 2]}) == Topology((2, 2))
    assert t.intra_capacity(8) == 16 and t.intra_capacity(4) == 20 and t.intra_capacity(1) == 23
    assert t.describe() == "3 nodes: 8x2, 7"
    assert hash(t) == hash(Topology((8, 8, 7), ("a", "b", "c")))  # a dict key (the driver's solves ahead)


@pytest.mark.parametrize(
    "bad, match",
    [
        (lambda: Topology(()), "non-empty"),
        (lambda: Topology((8, 0)), "node 1 has 0"),
        (lambda: Topology((8, 8), ("a",)), "1 node_names for 2 nodes"),
        (lambda: Topology((8, 8), ("a", "a")), "distinct"),
        (lambda: Topology((8,)).node_of(8), "outside"),
        (lambda: Topology.from_dict({"sizes": [8]}), "node_sizes"),
        (lambda: Topology.uniform(0, 8), "num_nodes"),
    ],
)
def test_topology_refuses_what_cannot_be(bad, match):
    with pytest.raises(TopologyError, match=match):
        bad()


# ---- profiles and prices


def test_a_profile_without_inter_tables_prices_spanning_groups_alike():
    p = get_profile("gpt-7b-a100").with_overrides(inter_a2a_gbps={})
    for kind, d in itertools.product(("ulysses", "ring"), (2, 8, 16, 64)):
        assert seq_time_ms(100_000, d, kind, p, spans=True) == seq_time_ms(100_000, d, kind, p)
        assert group_overhead_ms(d, kind, p, spans=True) == group_overhead_ms(d, kind, p)


def test_builtin_a100_inter_figures_are_flexsps_cross_node_rows():
    p = get_profile("gpt-7b-a100")
    assert p.bandwidth_gbps(8) == 96.5 and p.bandwidth_gbps(16) == 10.33  # without a topology: FlexSP's table
    assert p.bandwidth_gbps(4, inter=True) == 10.33  # 4 ranks across a node boundary: the 16-row
    assert p.bandwidth_gbps(32, ring=True, inter=True) == 5.94
    assert (
        p.has_inter_tables
        and not HAND.with_overrides(
            inter_a2a_gbps={}, inter_p2p_gbps={}, inter_a2a_latency_ms={}, inter_p2p_latency_ms={}
        ).has_inter_tables
    )


def test_profile_json_round_trips_the_inter_tables(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(HAND.to_json())
    back = load_profile(path)
    assert back == HAND and back.inter_p2p_gbps == {2: 2e-6}


def test_the_example_profile_with_nodes_loads():
    p = load_profile("examples/profiles/my-cluster-nodes.json")
    assert p.inter_a2a_gbps and p.bandwidth_gbps(8, inter=True) < p.bandwidth_gbps(8)


def test_spanning_and_hybrid_prices_by_hand():
    s = 1000  # a1*s^2 = 1 ms of attention, a2*s = 1 ms of the rest
    # Ulysses 8 inside a node: 2/8 + 128*1000/(8*4000) s
    assert seq_time_ms(s, 8, "ulysses", HAND) == pytest.approx(0.25 + 4000.0)
    # the same group across nodes: 1,000 B/s (the 16-row, nearest larger)
    assert seq_time_ms(s, 8, "ulysses", HAND, spans=True) == pytest.approx(0.25 + 16000.0)
    # ring 16 across nodes: c = 1/256, m = 96*(1000/16)/2000 s = 3000 ms, 15 steps exposed
    assert seq_time_ms(s, 16, "ring", HAND, spans=True) == pytest.approx(1 / 256 + 15 * 3000.0 + 1 / 16)
    # hybrid 8 x 2: a2a 128*1000/(16*4000) s = 2000 ms inside the node; one ring step, c = 1/32, m = 3000 ms
    hybrid = seq_time_ms(s, 16, "hybrid", HAND, spans=True, ulysses_degree=8)
    assert hybrid == pytest.approx(1 / 32 + 3000.0 + 1 / 16 + 2000.0)
    # overheads: b1 + a2a latency(8) inside + ring latency(2) across; b1 + inter a2a latency(16); b1 + ring(16)
    assert group_overhead_ms(16, "hybrid", HAND, spans=True, ulysses_degree=8) == 5.0 + 1.0 + 3.0
    assert group_overhead_ms(16, "ulysses", HAND, spans=True) == 5.0 + 7.0
    assert group_overhead_ms(16, "ring", HAND, spans=True) == 5.0 + 3.0
    assert group_overhead_ms(8, "ring", HAND) == 5.0 + 1.0  # no ring tables: the all-to-all ones
    assert group_time_ms([s, s], 16, "hybrid", HAND, spans=True, ulysses_degree=8) == pytest.approx(9.0 + 2 * hybrid)


def test_hybrid_compute_matches_the_one_dimensional_groups_when_communication_is_free():
    p = HAND.with_overrides(a2a_gbps={2: 1e9}, inter_a2a_gbps={2: 1e9}, inter_p2p_gbps={2: 1e9})
    s = 50_000
    one_d = seq_time_ms(s, 16, "ulysses", p)
    assert seq_time_ms(s, 16, "hybrid", p, spans=True, ulysses_degree=8) == pytest.approx(one_d, rel=1e-6)


# ---- placement


def _multisets(topo: Topology, limit: int = 400):
    """Multisets of power-of-two degrees <= the largest node that the capacity rows accept."""
    degrees = [d for d in (1, 2, 4, 8) if d <= topo.max_node_size]
    rows = capacity_rows(degrees, [False] * len(degrees), topo)
    out = []
    for counts in itertools.product(*(range(topo.num_devices // d + 1) for d in degrees)):
        if sum(c * d for c, d in zip(counts, degrees, strict=True)) <= topo.num_devices and counts_fit(counts, rows):
            out.append([d for c, d in zip(counts, degrees, strict=True) for _ in range(c)])
    return out[:: max(1, len(out) // limit)]


@pytest.mark.parametrize("sizes", [(8, 8, 7), (6, 6), (4, 4, 4, 4), (8, 7, 8), (2, 2), (3, 5)])
def test_placement_keeps_groups_inside_nodes(sizes):
    topo = Topology(sizes)
    cases = _multisets(topo)
    assert cases
    for degrees in cases:
        starts = place(degrees, [False] * len(degrees), topo)
        used = set()
        for s, d in zip(starts, degrees, strict=True):
            ranks = range(s, s + d)
            assert not topo.spans(ranks), (sizes, degrees, s, d)
            assert not used.intersection(ranks) and max(ranks) < topo.num_devices
            used.update(ranks)


def test_a_node_of_seven_holds_four_two_one_and_spanning_groups_take_whole_nodes():
    topo = Topology((8, 8, 8, 7, 8, 8, 8, 8))
    degrees = [32, 16, 8, 4, 2, 1]
    starts = place(degrees, [True, True, False, False, False, False], topo)
    assert starts[0] == 31  # nodes 4-7: 32 ranks exactly
    assert starts[1] in (0, 8)  # two whole nodes of 8
    assert {topo.node_of(s) for s in starts[3:]} == {3}  # the node of 7 holds 4 + 2 + 1


def test_two_nodes_of_two_never_share_a_small_group():
    topo = Topology((2, 2))
    for degrees in ([2, 2], [2, 1, 1], [1, 1, 1, 1], [2, 1], [1, 2]):
        starts = place(degrees, [False] * len(degrees), topo)
        assert not any(topo.spans(range(s, s + d)) for s, d in zip(starts, degrees, strict=True))


def test_group_types_gain_spanning_and_hybrid_types_on_nodes():
    p = get_profile("gpt-7b-a100")
    flat = group_types(64, p)
    assert group_types(64, p, topology=Topology.single(64)) == flat  # one node: the types without one
    on_nodes = group_types(64, p, topology=Topology.uniform(8, 8))
    assert GroupType(16, "hybrid", True, 8) in on_nodes and GroupType(8, "ulysses") in on_nodes
    assert all(t.spans == (t.degree > 8) for t in on_nodes)
    assert not any(t.kind == "hybrid" for t in group_types(64, p, topology=Topology.uniform(8, 8), hybrid=False))
    # u must divide the heads: 52 heads, nodes of 8 -> no hybrid
    p30 = get_profile("gpt-30b-a100")
    assert not any(t.kind == "hybrid" for t in group_types(64, p30, topology=Topology.uniform(8, 8)))


# ---- planning


def _lengths(n, seed=0, high=150_000):
    rng = np.random.default_rng(seed)
    return np.concatenate([rng.integers(100, 4000, n - 4), rng.integers(20_000, high, 4)])


@pytest.mark.parametrize("sizes", [(8, 8, 7), (8, 7, 8), (6, 6), (4, 4, 4, 4)])
def test_a_plan_on_nodes_validates_covers_every_sequence_and_keeps_small_groups_in_nodes(sizes):
    topo = Topology(sizes)
    profile = get_profile("gpt-7b-a100")
    lengths = _lengths(96, seed=sum(sizes), high=min(150_000, 4 * profile.tokens_per_device))
    with Planner(profile, PlannerConfig(time_limit_s=0.6, isolate=False)) as planner:
        res = planner.plan(lengths, topo.num_devices, topology=topo)
    plan = res.plan
    assert plan.topology == topo and plan.to_dict()["topology"] == {"node_sizes": list(sizes)}
    ids = sorted(i for mb in plan.micro_batches for g in mb.groups for i in g.seq_ids)
    assert ids == list(range(len(lengths)))
    for mb in plan.micro_batches:
        for g in mb.groups:
            if topo.intra_capacity(g.degree) == topo.num_devices:  # the nodes hold any set of such groups
                assert not topo.spans(g.ranks), (sizes, g)
    assert res.predicted_ms == pytest.approx(step_time_ms(plan, profile))
    assert res.bound_ms <= res.predicted_ms * (1 + 1e-9)


def test_without_a_topology_the_planner_is_unchanged():
    profile = get_profile("gpt-7b-a100")
    lengths = _lengths(48, seed=3, high=90_000)
    cfg = PlannerConfig(time_limit_s=0.5, isolate=False, stop_at_bound=True)
    with Planner(profile, cfg) as planner:
        a = planner.plan(lengths, 16)
    assert a.plan.topology is None and "topology" not in a.plan.to_dict()
    assert all(g.kind in ("ulysses", "ring") for mb in a.plan.micro_batches for g in mb.groups)


def _one_long(profile, d):
    """A batch of one sequence that needs a group of d devices."""
    return [int(profile.tokens_per_device * (d // 2 + 1))]


def test_the_planner_picks_hybrid_across_slow_nodes():
    profile = get_profile("gpt-7b-a100")
    topo = Topology.uniform(2, 8)
    with StepPlanner(profile, PlannerConfig(time_limit_s=1.0, isolate=False)) as sp:
        got = sp.plan(_one_long(profile, 16), 16, topology=topo)
        no_hybrid = StepPlanner(profile, PlannerConfig(time_limit_s=1.0, isolate=False, hybrid=False))
        with no_hybrid:
            flat = no_hybrid.plan(_one_long(profile, 16), 16, topology=topo)
    (g,) = [g for mb in got.plan.micro_batches for g in mb.groups]
    assert g.kind == "hybrid" and g.ulysses_degree == 8 and g.degree == 16
    assert [g.kind for mb in flat.plan.micro_batches for g in mb.groups] != ["hybrid"]
    assert got.predicted_ms < 0.8 * flat.predicted_ms  # ring steps overlapped, all-to-alls on NVLink


def test_the_planner_leaves_hybrid_where_it_loses():
    # a slow ring across nodes (latency) and a fast all-to-all: Ulysses over 16 beats hybrid 8 x 2
    profile = get_profile("gpt-7b-a100").with_overrides(inter_a2a_gbps={16: 500.0}, inter_p2p_latency_ms={2: 5_000.0})
    topo = Topology.uniform(2, 8)
    with StepPlanner(profile, PlannerConfig(time_limit_s=1.0, isolate=False)) as sp:
        got = sp.plan(_one_long(profile, 16), 16, topology=topo)
    assert [g.kind for mb in got.plan.micro_batches for g in mb.groups] == ["ulysses"]


def test_blind_plans_after_a_lost_worker_straddle_nodes_and_pay_for_it():
    profile = get_profile("gpt-7b-a100")
    topo = Topology((8, 7, 8, 8))
    lengths = _lengths(64, seed=5, high=40_000)
    cfg = PlannerConfig(time_limit_s=0.6, isolate=False)
    with StepPlanner(profile, cfg) as sp:
        aware = sp.plan(lengths, 31, topology=topo)
        blind = sp.plan(lengths, 31)
    blind_on_nodes = step_time_ms(dataclasses.replace(blind.plan, topology=topo), profile)
    assert aware.predicted_ms == pytest.approx(step_time_ms(aware.plan, profile))
    assert aware.predicted_ms <= blind_on_nodes * 1.001
    for name, ms in aware.baselines_ms.items():  # the baselines are priced on the nodes too
        assert ms is None or ms >= aware.predicted_ms * 0.999, name
