"""Calibration (solver.calibration): synthetic timings from a known profile give that profile back, and bad
samples get a clear error."""

from __future__ import annotations

import json

import numpy as np
import pytest

from flexorch.solver import ProfileError
from flexorch.solver.calibration import (
    MAX_GBPS,
    CommSample,
    ComputeSample,
    FitReport,
    GroupSample,
    fit_profile,
    predict_ms,
    prediction_errors,
)
from flexorch.solver.cost_model import group_time_ms
from flexorch.solver.profiles import Profile

# a CPU-like profile (docs/design.md §7): float32 on the wire, gloo latencies of ~1-2 ms per collective
TRUTH = Profile(
    name="cpu-truth",
    a1_ms=2e-6,
    a2_ms=0.02,
    b1_ms=3.0,
    act_bytes_per_token=40_000.0,
    memory_budget_bytes=2e9,
    model_state_bytes=1e8,
    num_layers=4,
    hidden=256,
    num_heads=4,
    num_kv_heads=2,
    bytes_per_element=4,
    a2a_gbps={2: 1.0, 4: 0.7},
    p2p_gbps={2: 1.5, 4: 1.2},
    a2a_latency_ms={2: 28.8, 4: 60.8},
    p2p_latency_ms={2: 6.0, 4: 20.0},
)
DIMS = dict(num_layers=4, hidden=256, num_heads=4, num_kv_heads=2, bytes_per_element=4)
MEMORY = dict(act_bytes_per_token=40_000.0, memory_budget_bytes=2e9, model_state_bytes=1e8)


def _samples(noise: float, seed: int = 0):
    rng = np.random.default_rng(seed)

    def jitter(ms):
        return float(ms * (1 + noise * rng.uniform(-1, 1)))

    compute = []
    for s in (64, 256, 1024, 2048, 4096, 8192):  # one sequence each, short to long
        compute.append(ComputeSample([s], jitter(group_time_ms([s], 1, "ulysses", TRUTH))))
    for n, s in ((16, 64), (8, 256), (4, 512), (32, 128), (2, 3000)):  # packed micro-batches of short sequences
        lengths = [s] * n
        compute.append(ComputeSample(lengths, jitter(group_time_ms(lengths, 1, "ulysses", TRUTH))))
    comm = []
    for kind in ("ulysses", "ring"):
        for d in (2, 4):
            for t in (32, 256, 1024, 4096, 16384):
                exact = predict_ms(TRUTH, CommSample(kind, d, t, 1.0))
                comm.append(CommSample(kind, d, t, jitter(exact)))
    return compute, comm


def _fit(compute, comm):
    return fit_profile("cpu-fit", **DIMS, **MEMORY, compute_samples=compute, comm_samples=comm)


def test_exact_samples_recover_the_profile():
    profile, report = _fit(*_samples(noise=0.0))
    for f in ("a1_ms", "a2_ms", "b1_ms"):
        assert getattr(profile, f) == pytest.approx(getattr(TRUTH, f), rel=1e-6), f
    for f in ("a2a_gbps", "p2p_gbps", "a2a_latency_ms", "p2p_latency_ms"):
        got, want = getattr(profile, f), getattr(TRUTH, f)
        assert set(got) == set(want)
        for d in want:
            assert got[d] == pytest.approx(want[d], rel=1e-6), (f, d)
    assert profile.tokens_per_device == TRUTH.tokens_per_device
    assert report.max_rel_error < 1e-6
    assert set(report.comm) == {"ulysses-2", "ulysses-4", "ring-2", "ring-4"}
    assert report.compute.samples == 11 and report.comm["ring-4"].samples == 5
    assert report.notes == ()


def test_noisy_samples_recover_the_profile_within_a_few_percent():
    compute, comm = _samples(noise=0.03, seed=1)
    profile, report = _fit(compute, comm)
    assert profile.a1_ms == pytest.approx(TRUTH.a1_ms, rel=0.10)
    assert profile.a2_ms == pytest.approx(TRUTH.a2_ms, rel=0.05)
    assert profile.b1_ms == pytest.approx(TRUTH.b1_ms, rel=0.10)
    for f in ("a2a_gbps", "p2p_gbps", "a2a_latency_ms", "p2p_latency_ms"):
        for d, want in getattr(TRUTH, f).items():
            assert getattr(profile, f)[d] == pytest.approx(want, rel=0.06), (f, d)
    # residuals stay at the noise level, and the report says so per term
    assert report.max_rel_error <= 0.06
    assert report.compute.median_rel_error <= 0.03
    # predictions of whole SP groups (compute + collectives) match the true model within the 15 % target
    groups = [GroupSample([s] * n, d, k, group_time_ms([s] * n, d, k, TRUTH)) for s, n in ((100, 8), (4000, 1))
              for d in (1, 2, 4) for k in ("ulysses", "ring")]  # fmt: skip
    assert max(abs(e) for e in prediction_errors(profile, groups)) <= 0.15


def test_report_and_samples_are_json_friendly():
    compute, comm = _samples(noise=0.0)
    wire = json.loads(json.dumps({"compute": [c.to_dict() for c in compute], "comm": [c.to_dict() for c in comm]}))
    assert [ComputeSample.from_dict(c) for c in wire["compute"]] == compute
    assert [CommSample.from_dict(c) for c in wire["comm"]] == comm
    profile, report = _fit(wire["compute"], wire["comm"])  # plain dicts are accepted as samples too
    assert isinstance(report, FitReport)
    data = json.loads(json.dumps(report.to_dict()))
    assert set(data) == {"compute", "comm", "notes", "max_rel_error"}
    assert set(data["compute"]) == {"samples", "max_rel_error", "median_rel_error"}
    g = GroupSample([10, 20], 2, "ring", 5.0)
    assert GroupSample.from_dict(json.loads(json.dumps(g.to_dict()))) == g
    assert profile.to_json() and json.loads(profile.to_json())["a2a_latency_ms"]["2"] == pytest.approx(28.8)


def test_prediction_errors_are_signed_and_relative():
    c = ComputeSample([1000], group_time_ms([1000], 1, "ulysses", TRUTH) * 1.25)
    g = GroupSample([1000], 2, "ulysses", group_time_ms([1000], 2, "ulysses", TRUTH) / 2)
    errs = prediction_errors(TRUTH, [c, g])
    assert errs[0] == pytest.approx(1 / 1.25 - 1) and errs[1] == pytest.approx(1.0)


def test_latency_only_collectives_clamp_the_bandwidth():
    compute, _ = _samples(noise=0.0)
    comm = [CommSample("ulysses", 2, t, 2.0) for t in (16, 64, 256)]  # flat: no byte cost to measure
    profile, report = _fit(compute, comm)
    assert profile.a2a_gbps[2] == MAX_GBPS and profile.a2a_latency_ms[2] == pytest.approx(2.0)
    assert any("ulysses-2" in n and "clamped" in n for n in report.notes)


def test_flat_compute_timings_fit_with_a_warning():
    """Probes too small to show any per-token cost (a busy CPU, a tiny budget) fit b1 alone, and the report says
    the profile cannot tell long micro-batches from short ones."""
    _, comm = _samples(noise=0.0)
    flat = [ComputeSample([s] * n, 5.0) for s, n in ((16, 1), (32, 1), (64, 1), (16, 4), (32, 2))]
    profile, report = _fit(flat, comm)
    assert (profile.a1_ms, profile.a2_ms) == (0.0, 0.0) and profile.b1_ms == pytest.approx(5.0)
    assert any("did not grow with tokens" in n and "16-64 tokens" in n for n in report.notes)
    _, fine = _fit(*_samples(noise=0.0))
    assert not any("did not grow" in n for n in fine.notes)


@pytest.mark.parametrize(
    "compute, comm, msg",
    [
        (2, None, r"compute_samples: got 2, need at least 3"),
        ("same", None, r"do not separate the unknowns"),
        (None, [CommSample("ulysses", 2, 64, 3.0)], r"ulysses-2: got 1 sample\(s\).*need at least 2"),
        (None, [CommSample("ulysses", 2, 64, 3.0)] * 3, r"at 1 message size\(s\)"),
        (None, [CommSample("ring", 2, 64, 3.0), CommSample("ring", 2, 640, 5.0)], r"Ulysses samples"),
        (None, [{"kind": "ulysses", "degree": 2, "ms": 1.0}], r"comm_samples\[0\] is not a CommSample"),
        (None, [{"kind": "ulysses", "degree": 3, "tokens_per_rank": 8, "ms": 1.0}], r"\[0\]: .*power of two"),
    ],
)
def test_too_few_or_degenerate_samples(compute, comm, msg):
    good_compute, good_comm = _samples(noise=0.0)
    if compute == "same":
        compute = [good_compute[0]] * 5
    elif isinstance(compute, int):
        compute = good_compute[:compute]
    with pytest.raises(ProfileError, match=msg):
        _fit(compute or good_compute, comm or good_comm)


@pytest.mark.parametrize("ms", [float("nan"), float("inf"), -1.0, 0.0, "3"])
def test_bad_times_are_refused(ms):
    with pytest.raises(ProfileError, match="finite time > 0"):
        ComputeSample([10], ms)
    with pytest.raises(ProfileError, match="finite time > 0"):
        CommSample("ring", 2, 10, ms)
    with pytest.raises(ProfileError, match=r"compute_samples\[1\]: .*finite time > 0"):
        _fit([{"seq_lengths": [5], "ms": 1.0}, {"seq_lengths": [5], "ms": ms}], [])


def test_bad_sample_fields_are_refused():
    with pytest.raises(ProfileError, match="non-empty list of integers"):
        ComputeSample([], 1.0)
    with pytest.raises(ProfileError, match="non-empty list of integers"):
        ComputeSample([10, 0], 1.0)
    with pytest.raises(ProfileError, match="kind must be one of"):
        CommSample("star", 2, 10, 1.0)
    with pytest.raises(ProfileError, match="power of two >= 2"):
        CommSample("ring", 1, 10, 1.0)
    with pytest.raises(ProfileError, match="tokens_per_rank"):
        CommSample("ring", 2, 0, 1.0)
    with pytest.raises(ProfileError, match="power of two >= 1"):
        GroupSample([10], 6, "ring", 1.0)
    with pytest.raises(ProfileError, match="num_heads=5 must be a multiple"):
        fit_profile("x", **{**DIMS, "num_heads": 5}, **MEMORY, compute_samples=[], comm_samples=[])


@pytest.mark.parametrize("kind", ["ring", "ulysses"])
def test_group_refit_matches_the_cost_models_own_group_formula(kind):
    from flexorch.solver.calibration import GroupSample, fit_group_comm

    lengths = [(256,), (1024,), (2048,), (32,) * 16, (512, 512)]
    measured = [GroupSample(seq_lengths=s, degree=4, kind=kind, ms=group_time_ms(s, 4, kind, TRUTH)) for s in lengths]
    key = "p2p" if kind == "ring" else "a2a"
    start = TRUTH.with_overrides(**{f"{key}_latency_ms": {4: 0.0}, f"{key}_gbps": {4: 1e4}})  # a wrong guess
    fitted, err = fit_group_comm(start, measured, kind, 4)
    assert err.max_rel_error < 0.02
    for s in lengths:
        assert group_time_ms(s, 4, kind, fitted) == pytest.approx(group_time_ms(s, 4, kind, TRUTH), rel=0.02)
    with pytest.raises(ProfileError, match="need >= 2 group samples"):
        fit_group_comm(start, measured[:1], kind, 4)


# ---- groups inside a node and across nodes (the ``inter_*`` tables)

# intra-node figures of TRUTH, and a slow link across nodes (~200 Mbit/s, docs/design.md §8's emulated hosts)
NODES_TRUTH = TRUTH.with_overrides(
    name="cpu-nodes-truth",
    a2a_gbps={2: 10.0, 4: 8.0},
    p2p_gbps={2: 12.0, 4: 9.0},
    inter_a2a_gbps={2: 0.025, 4: 0.02, 8: 0.015},
    inter_p2p_gbps={2: 0.03, 4: 0.025, 8: 0.02},
    inter_a2a_latency_ms={2: 80.0, 4: 150.0, 8: 300.0},
    inter_p2p_latency_ms={2: 40.0, 4: 90.0, 8: 200.0},
)


def _placed_samples(truth, placements):
    """Exact collective samples of ``truth`` for every (kind, degree, spans) in ``placements``."""
    return [
        CommSample(kind, d, t, predict_ms(truth, CommSample(kind, d, t, 1.0, spans=spans)), spans=spans)
        for kind, d, spans in placements
        for t in (32, 256, 1024, 4096, 16384)
    ]


def test_samples_inside_and_across_nodes_fill_the_intra_and_inter_tables():
    compute, _ = _samples(noise=0.0)
    intra = [(k, d, False) for k in ("ulysses", "ring") for d in (2, 4)]
    inter = [(k, d, True) for k in ("ulysses", "ring") for d in (2, 4, 8)]  # 8: no node holds it
    profile, report = _fit(compute, _placed_samples(NODES_TRUTH, intra + inter))
    for f in ("a2a_gbps", "p2p_gbps", "a2a_latency_ms", "p2p_latency_ms"):
        for d in (2, 4):
            assert profile.__dict__[f][d] == pytest.approx(NODES_TRUTH.__dict__[f][d], rel=1e-6), (f, d)
            want = NODES_TRUTH.__dict__[f"inter_{f}"][d]
            assert profile.__dict__[f"inter_{f}"][d] == pytest.approx(want, rel=1e-6), (f, d)
        # a degree measured only across nodes: both tables hold its figure (pricing without a topology sees it)
        assert (
            profile.__dict__[f][8]
            == profile.__dict__[f"inter_{f}"][8]
            == pytest.approx(NODES_TRUTH.__dict__[f"inter_{f}"][8], rel=1e-6)
        )
    assert profile.bandwidth_gbps(2) == pytest.approx(10.0)
    assert profile.bandwidth_gbps(2, inter=True) == pytest.approx(0.025)
    # the report tells the two apart, and each predicts its own samples exactly
    assert set(report.comm) == {"ulysses-2", "ulysses-4", "ring-2", "ring-4"}
    assert set(report.inter_comm) == {f"{k}-{d}" for k in ("ulysses", "ring") for d in (2, 4, 8)}
    assert report.max_rel_error < 1e-6 and report.inter_comm["ring-8"].samples == 5
    data = json.loads(json.dumps(report.to_dict()))
    assert set(data) == {"compute", "comm", "inter_comm", "notes", "max_rel_error"}
    # the same samples priced as if measured inside a node: every one predicted at least 3x too fast
    flat = [CommSample(c.kind, c.degree, c.tokens_per_rank, c.ms) for c in _placed_samples(NODES_TRUTH, inter[:2])]
    assert max(prediction_errors(profile, flat)) < -0.67


def test_one_node_samples_fit_exactly_as_before():
    """Samples without placement give a profile without inter tables and a report without inter entries."""
    compute, comm = _samples(noise=0.0)
    profile, report = _fit(compute, comm)
    assert not profile.has_inter_tables and report.inter_comm == {}
    assert "inter_comm" not in report.to_dict()
    assert all("spans" not in c.to_dict() for c in comm)


def test_samples_across_nodes_travel_as_json():
    c = CommSample("ring", 4, 100, 7.0, spans=True)
    g = GroupSample([10, 20], 2, "ulysses", 5.0, spans=True)
    assert c.to_dict()["spans"] is True and CommSample.from_dict(json.loads(json.dumps(c.to_dict()))) == c
    assert GroupSample.from_dict(json.loads(json.dumps(g.to_dict()))) == g
    with pytest.raises(ProfileError, match="spans must be true or false"):
        CommSample("ring", 2, 10, 1.0, spans="yes")
    with pytest.raises(ProfileError, match="one device cannot span nodes"):
        GroupSample([10], 1, "ulysses", 1.0, spans=True)
    with pytest.raises(ProfileError, match="ulysses-2 across nodes: got 1 sample"):
        _fit(_samples(noise=0.0)[0], [*_samples(noise=0.0)[1], CommSample("ulysses", 2, 64, 3.0, spans=True)])


@pytest.mark.parametrize("kind", ["ring", "ulysses"])
def test_group_refit_across_nodes_fills_the_inter_tables_only(kind):
    from flexorch.solver.calibration import fit_group_comm, intra_from_inter

    lengths = [(256,), (1024,), (2048,), (32,) * 16, (512, 512)]
    truth = NODES_TRUTH.with_overrides(a1_ms=2e-5)  # ring: attention blocks long enough to hide some transfer
    measured = [GroupSample(s, 4, kind, group_time_ms(s, 4, kind, truth, spans=True), spans=True) for s in lengths]
    inside = [GroupSample(s, 4, kind, group_time_ms(s, 4, kind, truth) * 100) for s in lengths]  # ignored
    key = "inter_p2p" if kind == "ring" else "inter_a2a"
    start = truth.with_overrides(**{f"{key}_latency_ms": {4: 0.0}, f"{key}_gbps": {4: 1e4}})
    fitted, err = fit_group_comm(start, measured + inside, kind, 4, spans=True)
    assert err.samples == 5 and err.max_rel_error < 0.02
    for s in lengths:
        want = group_time_ms(s, 4, kind, truth, spans=True)
        assert group_time_ms(s, 4, kind, fitted, spans=True) == pytest.approx(want, rel=0.02)
        assert group_time_ms(s, 4, kind, fitted) == group_time_ms(s, 4, kind, start)  # intra figures untouched
    assert fitted.bandwidth_gbps(4, ring=kind == "ring", inter=True) == pytest.approx(
        truth.bandwidth_gbps(4, ring=kind == "ring", inter=True), rel=0.05
    )
    with pytest.raises(ProfileError, match=f"need >= 2 group samples for {kind}-4 across nodes, got 0"):
        fit_group_comm(start, inside, kind, 4, spans=True)
    copied = intra_from_inter(fitted, kind, 4)
    assert group_time_ms(lengths[0], 4, kind, copied) == pytest.approx(
        group_time_ms(lengths[0], 4, kind, fitted, spans=True)
    )


def test_a_windowed_models_probes_are_fitted_with_its_window():
    """Compute probes of a model whose layers slide (a share 5/6, window 512) recover a1 only when the fit knows
    the window: fitted with s^2 the long probes' attention looks cheap and a1 comes out far too low."""
    windowed = dict(attention_window=512, window_fraction=5 / 6)
    truth = TRUTH.with_overrides(**windowed)
    compute = []
    for lengths in ([64], [256], [1024], [2048], [4096], [8192], [64] * 16, [256] * 8, [512] * 4, [3000] * 2):
        compute.append(ComputeSample(lengths, group_time_ms(lengths, 1, "ulysses", truth)))
    _, comm = _samples(noise=0.0)
    aware, report = fit_profile("win", **DIMS, **MEMORY, **windowed, compute_samples=compute, comm_samples=comm)
    assert (aware.attention_window, aware.window_fraction) == (512, 5 / 6)
    assert aware.a1_ms == pytest.approx(TRUTH.a1_ms, rel=1e-6) and report.max_rel_error < 1e-6
    blind, blind_report = _fit(compute, comm)
    assert blind.a1_ms < 0.5 * TRUTH.a1_ms and blind_report.compute.max_rel_error > 0.01
