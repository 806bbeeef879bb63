"""The MILP backends (``solver.backend``): HiGHS and CBC both plan small real instances validly, HiGHS's exact optimum
equals CBC's (both prove optimality), every MILP is built on the backend asked for, and bad or missing backends are
refused with the reason (fast; no timed asserts)."""

from __future__ import annotations

import time

import mip
import numpy as np
import pytest

from flexorch.config import ConfigError, PlanSettings, config_from_dict
from flexorch.data.lengths import bundled_lengths_path, read_lengths
from flexorch.solver import backend, get_profile
from flexorch.solver.bounds import micro_batch_bound_ms
from flexorch.solver.exact import solve_exact
from flexorch.solver.group_tables import GroupTables
from flexorch.solver.milp import best_static_draft, solve_micro_batch
from flexorch.solver.packing import Draft, group_types, time_table, type_caps, type_overheads
from tests.solver_helpers import TINY


def _problem(lengths, n, profile):
    lengths = np.asarray(lengths, dtype=np.int64)
    types = group_types(n, profile)
    return {
        "types": types,
        "table": time_table(lengths, types, profile),
        "lengths": lengths,
        "num_devices": n,
        "caps_by_type": type_caps(types, profile),
        "overheads": type_overheads(types, profile),
    }


def _check_draft(draft: Draft, items, p) -> None:
    """Every item in exactly one group, the groups within the devices and their memory, loads as the table says."""
    members = [i for mem in draft.members for i in mem]
    assert sorted(members) == sorted(items), "an item is missing or assigned twice"
    degrees = [p["types"][t].degree for t in draft.group_type]
    assert sum(degrees) <= p["num_devices"]
    for t, mem, load, tokens in zip(draft.group_type, draft.members, draft.loads, draft.tokens, strict=True):
        assert int(p["lengths"][mem].sum()) == tokens <= p["caps_by_type"][t]
        if mem:
            assert load == pytest.approx(p["overheads"][t] + p["table"][mem, t].sum(), rel=1e-9)


@pytest.fixture
def built_on(monkeypatch):
    """The backend of every model built through ``solver.backend.new_model`` while the test runs."""
    names: list[str] = []
    real = backend.new_model

    def recording(solver):
        names.append(solver)
        return real(solver)

    monkeypatch.setattr(backend, "new_model", recording)
    return names


def _tiny_instances(count, seed):
    """(N, lengths) micro-batches that fit N devices of TINY in one go (the exact model's setting: one micro-batch)."""
    rng = np.random.default_rng(seed)
    made = 0
    while made < count:
        n = int(rng.choice([2, 4, 8]))
        k = int(rng.integers(2, 7))
        top = n * TINY.tokens_per_device // 2
        lengths = np.minimum(top, np.ceil(rng.pareto(1.2, k) * 25 + 1)).astype(np.int64)
        if lengths.sum() <= 0.7 * n * TINY.tokens_per_device:
            made += 1
            yield n, lengths


@pytest.mark.parametrize("solver", backend.SOLVERS)
def test_exact_plans_are_valid_on_each_backend(solver, built_on):
    for n, lengths in _tiny_instances(6, seed=3):
        p = _problem(lengths, n, TINY)
        items = list(range(len(lengths)))
        start = best_static_draft(items, p["types"], p["table"], p["lengths"], n, p["caps_by_type"], p["overheads"])
        got = solve_exact(items, GroupTables(**p), time_limit_s=10.0, start=start, solver=solver)
        assert got is not None, (n, lengths)
        draft, proven = got
        assert proven
        _check_draft(draft, items, p)
        assert draft.makespan() <= start.makespan() * (1 + 1e-9)  # never worse than its warm start
    assert built_on and set(built_on) == {solver}


def test_highs_exact_optimum_equals_cbcs():
    """Oracle: on instances small enough for both to prove optimality, the optima agree (to the relative gap 1e-4
    at which python-mip stops both)."""
    compared = 0
    for seed in (11, 12):
        for n, lengths in _tiny_instances(6, seed):
            p = _problem(lengths, n, TINY)
            items = list(range(len(lengths)))
            got = {s: solve_exact(items, GroupTables(**p), time_limit_s=10.0, solver=s) for s in backend.SOLVERS}
            assert all(g is not None and g[1] for g in got.values()), (n, lengths, got)
            assert got["highs"][0].makespan() == pytest.approx(got["cbc"][0].makespan(), rel=2e-4), (n, lengths)
            compared += 1
    # and on the real profile: long Wikipedia-size sequences on 64 devices, the planner's exact path
    profile = get_profile("gpt-7b-a100").with_overrides(num_heads=64, num_kv_heads=64)
    for lengths in ([150_000, 80_000, 30_000, 9_000], [100_000, 90_000, 33_000, 31_000, 20_000, 12_000]):
        p = _problem(lengths, 64, profile)
        items = list(range(len(lengths)))
        got = {s: solve_exact(items, GroupTables(**p), time_limit_s=20.0, solver=s) for s in backend.SOLVERS}
        assert all(g is not None and g[1] for g in got.values()), (lengths, got)
        assert got["highs"][0].makespan() == pytest.approx(got["cbc"][0].makespan(), rel=2e-4), lengths
        _check_draft(got["highs"][0], items, p)
        compared += 1
    assert compared == 14


@pytest.mark.parametrize("solver", backend.SOLVERS)
def test_micro_batch_plans_are_valid_on_each_backend(solver, built_on):
    """A 200-sequence micro-batch of FlexSP's setting (bundled Wikipedia lengths, 64 devices, at most 70 % of their
    memory): the bisection solves MILPs on the backend asked for."""
    profile = get_profile("gpt-7b-a100").with_overrides(num_heads=64, num_kv_heads=64)
    data = read_lengths(bundled_lengths_path())
    lengths = np.random.default_rng(5).choice(data[(data > 0) & (data <= 384 * 1024)], 200)
    assert lengths.sum() <= 0.7 * 64 * profile.tokens_per_device
    p = _problem(lengths, 64, profile)
    items = list(range(len(lengths)))
    degrees = np.array([t.degree for t in p["types"]], dtype=np.float64)
    lb = micro_batch_bound_ms(p["table"], degrees, 64, p["overheads"])
    sol = solve_micro_batch(items, GroupTables(**p), lower_bound_ms=lb, time_budget_s=30.0, solver=solver)
    assert sol is not None
    _check_draft(sol.draft, items, p)
    assert sol.makespan_ms == pytest.approx(sol.draft.makespan()) and sol.makespan_ms >= lb * (1 - 1e-9)
    assert sol.ilp_solves >= 1 and sol.bisection_steps >= 1
    assert built_on and set(built_on) == {solver}  # at least one MILP was built, on this backend only


def test_an_unknown_solver_name_is_a_clear_value_error():
    p = _problem([40, 30, 20], 4, TINY)
    with pytest.raises(ValueError, match=r"unknown MILP solver 'glpk'; choose one of \['highs', 'cbc'\]"):
        backend.new_model("glpk")
    with pytest.raises(ValueError, match="unknown MILP solver 'gurobi'"):
        solve_exact([0, 1, 2], GroupTables(**p), time_limit_s=1.0, solver="gurobi")
    with pytest.raises(ValueError, match="unknown MILP solver 'CBC'"):  # also where no MILP would be needed
        solve_micro_batch([0, 1, 2], GroupTables(**p), lower_bound_ms=0.0, time_budget_s=1.0, solver="CBC")
    assert backend.solver_available("glpk") == (False, "unknown MILP solver 'glpk'; choose one of ['highs', 'cbc']")


@pytest.fixture
def fresh_availability():
    backend.solver_available.cache_clear()
    yield
    backend.solver_available.cache_clear()


def test_a_missing_solver_library_is_reported_with_the_fix(monkeypatch, fresh_availability):
    assert backend.solver_available("highs") == (True, "") and backend.solver_available("cbc") == (True, "")
    backend.solver_available.cache_clear()

    def no_library(*args, **kwargs):
        raise FileNotFoundError("HiGHS not found.")

    monkeypatch.setattr(mip, "Model", no_library)
    ok, why = backend.solver_available("highs")
    assert not ok
    assert why == (
        "python-mip cannot load the highs solver (FileNotFoundError: HiGHS not found.); `pip install highsbox`"
    )
    with pytest.raises(ValueError, match=r"cannot load the highs solver .*pip install highsbox"):
        backend.check_solver("highs")
    with pytest.raises(ValueError, match=r"cannot load the cbc solver .*pip install cbcbox"):
        backend.new_model("cbc")


def test_solve_time_limits_come_from_the_time_left():
    now = time.perf_counter()
    assert backend.time_left(now + 100.0, cap=0.2) == 0.2  # a bisection step's cap
    assert backend.time_left(now - 5.0) == backend.MIN_SOLVE_S  # past the deadline: the floor only
    assert backend.time_left(now - 5.0, floor=0.0) == 0.0
    assert backend.time_left(now + 0.5) <= 0.5  # never more than what is left


def test_the_plan_solver_setting_takes_the_backends_and_refuses_others():
    assert PlanSettings().solver == backend.DEFAULT_SOLVER
    for name in backend.SOLVERS:
        assert config_from_dict({"plan": {"solver": name}}).plan.solver == name
    for bad in ("gurobi", "HiGHS", ""):
        with pytest.raises(ConfigError, match=rf"plan.solver must be 'highs' or 'cbc', got '{bad}'"):
            config_from_dict({"plan": {"solver": bad}})
