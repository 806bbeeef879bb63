"""Calibration on several nodes: probe groups inside a node and across node boundaries
(``flexorch.workers.calibrate.group_starts``), laid out by the driver from the worker group's nodes
(``flexorch.control.calibration_probes``), fitted by ``flexorch.control.calibration`` into the profile's intra and
``inter_*`` tables. One node: the probes and the profile are those of before."""

from __future__ import annotations

import re

import pytest
import torch

from flexorch.control.calibration import _profile_dims, calibrate
from flexorch.control.calibration_probes import calibration_probes, calibration_topology
from flexorch.data.corpus import CorpusConfig
from flexorch.solver.cost_model import group_time_ms
from flexorch.solver.profiles import Profile
from flexorch.solver.topology import Topology
from flexorch.workers.calibrate import Probe, group_starts, probe_groups, run_probes
from tests.train_helpers import train_config

TOPOLOGIES = [(2, 2), (4, 4), (3, 5), (8, 8, 7)]


def _pow2_upto(n: int) -> list[int]:
    return [1 << k for k in range(1, n.bit_length()) if 1 << k <= n]


# ---- the layout: which ranks form which groups


@pytest.mark.parametrize(
    "sizes, degree, intra, inter",
    [
        ((2, 2), 2, (0, 2), (1,)),  # the block {1, 2} spans the boundary
        ((2, 2), 4, (), (0,)),
        ((4, 4), 2, (0, 2, 4, 6), (3,)),
        ((4, 4), 4, (0, 4), (2,)),  # half on either side: {2, 3 | 4, 5}
        ((4, 4), 8, (), (0,)),
        ((3, 5), 2, (0, 3, 5), (2,)),  # rank 2 and rank 7 idle in the intra probe
        ((3, 5), 4, (3,), (1,)),  # only the node of 5 holds a group of 4
        ((3, 5), 8, (), (0,)),
        ((8, 8, 7), 2, tuple(range(0, 22, 2)), (7, 15)),
        ((8, 8, 7), 4, (0, 4, 8, 12, 16), (6, 14)),
        ((8, 8, 7), 8, (0, 8), (4, 12)),  # {12..19}: 4 ranks of node 1, 4 of node 2 (of its 7)
        ((8, 8, 7), 16, (), (0,)),  # nodes 1 and 2 cannot take a second group of 16 beside {0..15}
    ],
)
def test_group_starts(sizes, degree, intra, inter):
    assert group_starts(degree, sizes, "intra") == intra
    assert group_starts(degree, sizes, "inter") == inter


@pytest.mark.parametrize("sizes", TOPOLOGIES)
def test_every_intra_group_lies_in_one_node_and_every_inter_group_spans_exactly_two(sizes):
    topo = Topology(sizes)
    n = topo.num_devices
    for d in _pow2_upto(n):
        for placement in ("intra", "inter"):
            groups = probe_groups(Probe(d, "ulysses", (8,), starts=group_starts(d, sizes, placement) or None), n)
            if not group_starts(d, sizes, placement):
                continue
            seen = [r for g in groups for r in g]
            assert len(seen) == len(set(seen)) and all(0 <= r < n for r in seen)  # disjoint, inside the world
            assert all(g == tuple(range(g[0], g[0] + d)) for g in groups)  # blocks of consecutive ranks
            nodes = [{topo.node_of(r) for r in g} for g in groups]
            if placement == "intra":
                assert all(len(s) == 1 for s in nodes), (d, groups)
                assert len(groups) == sum(s // d for s in sizes)  # packed: as many as the nodes hold
            else:
                assert all(len(s) == 2 and max(s) - min(s) == 1 for s in nodes), (d, groups)  # two adjacent nodes
        # a degree that fits a node is probed inside nodes; a degree that two adjacent nodes hold, across them
        assert bool(group_starts(d, sizes, "intra")) == (d <= max(sizes))
        assert bool(group_starts(d, sizes, "inter")) == any(a + b >= d for a, b in zip(sizes, sizes[1:], strict=False))


def test_a_degree_no_two_nodes_hold_spans_several():
    # nodes of 2: a group of 8 cannot lie on two nodes; its probe still measures groups across nodes
    assert group_starts(8, (2, 2, 2, 2), "inter") == (0,)
    assert group_starts(4, (2, 2, 2, 2), "inter") == (0, 4)  # {0..3} and {4..7}, each over exactly two nodes
    assert group_starts(2, (1, 1, 1), "intra") == () and group_starts(2, (1, 1, 1), "inter") == (0,)
    assert group_starts(4, (4,), "inter") == ()  # one node: nothing spans


def test_bad_probe_starts_are_refused():
    with pytest.raises(ValueError, match="ascending by at least the degree"):
        Probe(4, "ring", (8,), starts=(0, 2))
    with pytest.raises(ValueError, match="placement must be one of"):
        Probe(2, "ring", (8,), placement="across")
    with pytest.raises(ValueError, match="do not fit a world of 4 ranks"):
        probe_groups(Probe(4, "ring", (8,), starts=(2,)), 4)


def test_a_rank_in_no_probe_group_idles():
    # rank 0 of three: the only group is {1, 2}; it runs nothing and reports 0 (never touching the model)
    probe = Probe(2, "ulysses", (8,), repeats=1, starts=(1,), placement="inter")
    assert run_probes(torch.nn.Linear(1, 1), [probe], 0, 3, None, None, 10) == [0.0]
    # without starts: aligned blocks, the last rank of an odd world idles as before
    assert probe_groups(Probe(2, "ulysses", (8,)), 3) == [(0, 1)]


@pytest.mark.parametrize("sizes", TOPOLOGIES)
def test_calibration_probes_on_nodes(sizes):
    topo = Topology(sizes)
    n = topo.num_devices
    compute, groups = calibration_probes(256, n, ("ulysses", "ring"), topology=topo)
    flat_compute, flat = calibration_probes(256, n, ("ulysses", "ring"))
    assert compute == flat_compute  # every worker alone, as on one node
    placed = {(p.degree, p.kind, p.placement) for p in groups}
    for d in _pow2_upto(n):
        for kind in ("ulysses", "ring"):
            assert ((d, kind, "intra") in placed) == (d <= max(sizes))
            assert ((d, kind, "inter") in placed) == bool(group_starts(d, sizes, "inter"))
    for p in groups:  # the same documents as the one-node probe of its degree and kind, laid out by placement
        assert p.starts == group_starts(p.degree, sizes, p.placement)
        twin = [q.lengths for q in flat if (q.degree, q.kind) == (p.degree, p.kind)]
        assert p.lengths in twin
    with pytest.raises(ValueError, match="a topology of 4 workers for 5 workers"):
        calibration_probes(256, 5, ("ulysses",), topology=Topology((2, 2)))


def test_one_node_gives_the_probes_of_before():
    for n in (1, 2, 4, 6):
        before = calibration_probes(256, n, ("ulysses", "ring"), max_context=128)
        assert calibration_probes(256, n, ("ulysses", "ring"), max_context=128, topology=Topology.single(n)) == before
        assert all(p.starts is None and p.placement == "" for p in before[0] + before[1])


# ---- the driver side: a fake worker group timed by a known cost model


def _cfg(tmp_path, max_context: int = 1024, **plan):
    plan = {"profile": "auto", "tokens_per_worker": 1024, **plan}
    data = CorpusConfig(max_context=max_context)
    return train_config(tmp_path, tmp_path / "run", tmp_path / "unused.json", plan=plan, data=data)


def _truth(cfg) -> Profile:
    """A CPU-like model inside a node (10 GB/s, ~1 ms), a slow link across nodes (0.025 GB/s, tens of ms)."""
    return Profile(
        name="nodes-truth",
        a1_ms=1e-5,
        a2_ms=1e-3,
        b1_ms=0.5,
        **_profile_dims(cfg, 1000.0),
        a2a_gbps={2: 10.0, 4: 10.0},
        p2p_gbps={2: 12.0, 4: 12.0},
        a2a_latency_ms={2: 1.0, 4: 2.0},
        p2p_latency_ms={2: 0.5, 4: 1.5},
        inter_a2a_gbps={2: 0.025, 4: 0.025, 8: 0.02},
        inter_p2p_gbps={2: 0.03, 4: 0.03, 8: 0.025},
        inter_a2a_latency_ms={2: 20.0, 4: 30.0, 8: 40.0},
        inter_p2p_latency_ms={2: 10.0, 4: 20.0, 8: 30.0},
    )


class _NodesGroup:
    """Workers on nodes of ``sizes`` answering probes with ``truth``'s time of the group each rank is in (0: idle);
    a group is priced across nodes when its ranks span them, whatever the probe says."""

    def __init__(self, truth: Profile, sizes, names=None) -> None:
        self.truth, self.topology = truth, Topology(tuple(sizes))
        self.size = self.topology.num_devices
        self.names = names or [f"10.0.0.{i + 1}" for i in range(len(sizes))]
        self.spanned: list[tuple[str, bool]] = []
        self.probes: list[Probe] = []

    def rank_nodes(self) -> list[str]:
        return [self.names[i] for i in self.topology.node_ranks()]

    def call(self, method: str, *args) -> list:
        if method == "activation_bytes_per_token":
            return [1000.0] * self.size
        (p,) = args[0]
        self.probes.append(p)
        out = [[0.0] for _ in range(self.size)]
        for g in probe_groups(p, self.size):
            spans = self.topology.spans(g)
            self.spanned.append((p.placement, spans))
            for r in g:
                out[r] = [group_time_ms(p.lengths, p.degree, p.kind, self.truth, spans=spans)]
        return out


def test_calibrate_on_two_nodes_fits_the_intra_and_inter_tables(tmp_path):
    cfg = _cfg(tmp_path, kinds=("ulysses", "ring"))
    truth = _truth(cfg)
    group = _NodesGroup(truth, (2, 2))
    assert calibration_topology(group, cfg) == Topology((2, 2), ("10.0.0.1", "10.0.0.2"))
    profile, report = calibrate(group, cfg, repeats=1)
    # every probe across nodes had groups that span, every probe inside nodes groups that do not
    assert {(placement, spans) for placement, spans in group.spanned if placement} == {
        ("intra", False),
        ("inter", True),
    }
    for ring in (False, True):  # degree 2 measured both ways, degree 4 (no node holds it) only across
        assert profile.bandwidth_gbps(2, ring=ring, inter=True) == pytest.approx(
            truth.bandwidth_gbps(2, ring=ring, inter=True), rel=0.1
        )
        assert profile.bandwidth_gbps(4, ring=ring, inter=True) == pytest.approx(
            truth.bandwidth_gbps(4, ring=ring, inter=True), rel=0.1
        )
        assert profile.bandwidth_gbps(2, ring=ring) > 50 * profile.bandwidth_gbps(2, ring=ring, inter=True)
        # a group of 4 always spans here: its intra figure is its inter one
        assert profile.bandwidth_gbps(4, ring=ring) == profile.bandwidth_gbps(4, ring=ring, inter=True)
    assert profile.latency_ms(2, inter=True) == pytest.approx(20.0, rel=0.1)
    # whole groups, compute + collectives, as the planner prices them
    for lengths in ((1024,), (256,) * 8, (64,) * 4):
        for d, spans in ((2, False), (2, True), (4, True)):
            for kind in ("ulysses", "ring"):
                want = group_time_ms(lengths, d, kind, truth, spans=spans)
                assert group_time_ms(lengths, d, kind, profile, spans=spans) == pytest.approx(want, rel=0.03)
    # the report says which groups were measured where, and how each predicts
    assert set(report["group_fit"]) == {"ulysses-2", "ring-2"}
    assert set(report["inter_group_fit"]) == {"ulysses-2", "ring-2", "ulysses-4", "ring-4"}
    assert set(report["fit"]["inter_comm"]) == {"ulysses-2", "ring-2", "ulysses-4", "ring-4"}
    assert report["topology"] == {"node_sizes": [2, 2], "node_names": ["10.0.0.1", "10.0.0.2"]}
    assert report["inter_max_rel_error"] < 0.03 and report["intra_max_rel_error"] < 0.03
    assert sum(bool(p.get("spans")) for p in report["probes"]) == 16  # 2 degrees x 2 kinds x 4 sizes
    assert "across nodes (2 nodes: 2x2): latency a2a {2: " in report["message"], report["message"]
    assert "prediction error inside nodes median " in report["message"]


def test_calibrate_on_uneven_nodes_probes_both_ways(tmp_path):
    cfg = _cfg(tmp_path, kinds=("ulysses",), tokens_per_worker=256)
    truth = _truth(cfg)
    profile, report = calibrate(_NodesGroup(truth, (3, 5)), cfg, repeats=1)
    assert set(report["group_fit"]) == {"ulysses-2", "ulysses-4"}  # the node of 5 holds a group of 4
    assert set(report["inter_group_fit"]) == {"ulysses-2", "ulysses-4", "ulysses-8"}
    assert profile.bandwidth_gbps(8, inter=True) == pytest.approx(0.02, rel=0.1)
    assert profile.bandwidth_gbps(4) > 50 * profile.bandwidth_gbps(4, inter=True)
    assert report["max_rel_error"] < 0.03


def test_one_node_calibrates_as_before(tmp_path):
    """A worker group on one node, one whose nodes are unknown, and ``topology = "blind"`` all calibrate exactly as a
    group that says nothing of its nodes: the same probes, the same profile, no inter tables."""
    cfg = _cfg(tmp_path)
    truth = _truth(cfg)

    class Silent(_NodesGroup):  # says nothing of its nodes
        def rank_nodes(self) -> list[None]:
            return [None] * self.size

    def fit(group, config=cfg):
        profile, report = calibrate(group, config, repeats=1)
        report.pop("seconds")
        report["message"] = re.sub(r" in [0-9.]+ s:", "", report["message"])
        return profile, report, group.probes

    silent = Silent(truth, (4,))
    before = fit(silent)
    assert not before[0].has_inter_tables and "topology" not in before[1]
    assert "inter_comm" not in before[1]["fit"] and "spans" not in str(before[1]["probes"])
    compute, groups = calibration_probes(1024, 4, cfg.plan.kinds, 1, 1024)
    assert before[2] == compute + groups  # aligned blocks, nothing cut
    assert fit(_NodesGroup(truth, (4,))) == before
    # nodes not known: probed and fitted as one node
    unknown = _NodesGroup(truth, (2, 2))
    unknown.rank_nodes = lambda: [None] * 4
    assert fit(unknown)[2] == before[2] and "topology" not in fit(unknown)[1]
    # topology = "blind": the probes of one node, whatever the nodes
    blind = fit(_NodesGroup(truth, (2, 2)), _cfg(tmp_path, topology="blind"))
    assert blind[2] == before[2] and "topology" not in blind[1] and not blind[0].has_inter_tables


def test_progress_names_where_the_groups_lie(tmp_path):
    cfg = _cfg(tmp_path, 256, kinds=("ulysses",), tokens_per_worker=64)
    events: list = []
    calibrate(_NodesGroup(_truth(cfg), (2, 2)), cfg, repeats=1, publish=events.append)
    said = [e["message"] for e in events]
    assert said[0].startswith("calibrating the cost model on 4 workers (2 nodes: 2x2): "), said
