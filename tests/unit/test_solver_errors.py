"""Bad input to the planner and the profiles: a clear error that names the problem, never a hang or a crash."""

import json
import subprocess
import sys

import numpy as np
import pytest

from flexorch.solver import (
    InfeasibleBatchError,
    PlannerConfig,
    PlanningError,
    ProfileError,
    get_profile,
    load_profile,
    plan_step,
)
from flexorch.solver.baselines import baseline_times_ms
from tests.paths import EXAMPLES
from tests.solver_helpers import TINY


def test_sequence_no_layout_can_hold_names_length_and_limit():
    with pytest.raises(InfeasibleBatchError, match=r"sequence 1 has 801 tokens .* 8 x 100 = 800 tokens"):
        plan_step([10, 801, 5], 8, TINY)
    # 6 devices: the largest group is 4
    with pytest.raises(InfeasibleBatchError, match=r"4 x 100 = 400"):
        plan_step([401], 6, TINY)


@pytest.mark.parametrize(
    "lengths, n, msg",
    [
        ([], 4, "empty"),
        ([5, 0, 3], 4, "sequence 1 has length 0"),
        ([5, -2], 4, "length -2"),
        ([1.5, 2], 4, "integers"),
        ([[1, 2]], 4, "flat list"),
        ([5], 0, "devices must be an integer >= 1"),
        ([5], -3, "devices"),
        ([5], 2.0, "devices"),
    ],
)
def test_bad_batches(lengths, n, msg):
    with pytest.raises(PlanningError, match=msg):
        plan_step(lengths, n, TINY)
    with pytest.raises(PlanningError, match=msg):
        baseline_times_ms(lengths, n, TINY)


def test_non_power_of_two_device_counts_plan_with_aligned_blocks():
    res = plan_step([90, 80, 70, 60, 5, 5], 6, TINY)
    for mb in res.plan.micro_batches:
        assert sum(g.degree for g in mb.groups) <= 6
        for g in mb.groups:
            assert g.ranks[0] % g.degree == 0


def test_planner_config_is_validated():
    with pytest.raises(ValueError, match="time limits"):
        PlannerConfig(time_limit_s=0)
    with pytest.raises(ValueError, match="kinds"):
        PlannerConfig(kinds=("magic",))
    with pytest.raises(ValueError, match="workers"):
        PlannerConfig(workers=0)


def test_ulysses_only_cannot_form_groups_larger_than_the_heads():
    # TINY has 4 heads: a sequence needing 8 devices has no Ulysses group
    with pytest.raises(InfeasibleBatchError, match="fits no group of kinds \\('ulysses',\\)"):
        plan_step([700, 10], 8, TINY, PlannerConfig(kinds=("ulysses",)))


def test_ring_only_planning_uses_ring_groups():
    res = plan_step([300, 200, 20, 10], 8, TINY, PlannerConfig(kinds=("ring",)))
    kinds = {g.kind for mb in res.plan.micro_batches for g in mb.groups if g.degree > 1}
    assert kinds <= {"ring"}


def test_unknown_profile_lists_the_known_ones():
    with pytest.raises(ProfileError, match="gpt-13b-a100, gpt-30b-a100, gpt-7b-a100"):
        get_profile("gpt-9000")


def test_profile_json_round_trip_and_errors(tmp_path):
    p = get_profile("gpt-7b-a100")
    f = tmp_path / "mine.json"
    f.write_text(p.to_json())
    q = load_profile(f)
    assert q == p and q.tokens_per_device == 6250
    assert get_profile(str(f)) == p
    with pytest.raises(ProfileError, match="does not exist"):
        load_profile(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ProfileError, match="not valid JSON"):
        load_profile(bad)
    data = json.loads(p.to_json())
    data["a1_ms"] = -1
    bad.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match="a1_ms must be a finite number >= 0"):
        load_profile(bad)
    data = json.loads(p.to_json())
    data["colour"] = "blue"
    bad.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match="unknown fields \\['colour'\\]"):
        load_profile(bad)
    del data["colour"], data["hidden"]
    bad.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match="missing"):
        load_profile(bad)
    data = json.loads(p.to_json())
    data["a2a_gbps"] = {"3": 10}
    bad.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match="powers of two"):
        load_profile(bad)


def test_latency_tables_round_trip_through_json_and_validate(tmp_path):
    p = get_profile("gpt-7b-a100")
    assert p.a2a_latency_ms == {} and p.p2p_latency_ms == {}  # built-ins: no latency term
    lat = p.with_overrides(a2a_latency_ms={2: 0.9, 4: 1.9}, p2p_latency_ms={2: 0.5})
    data = json.loads(lat.to_json())
    assert data["a2a_latency_ms"] == {"2": 0.9, "4": 1.9} and data["p2p_latency_ms"] == {"2": 0.5}
    f = tmp_path / "lat.json"
    f.write_text(lat.to_json())
    assert load_profile(f) == lat
    data.pop("a2a_latency_ms"), data.pop("p2p_latency_ms")  # older files without the tables stay valid
    f.write_text(json.dumps(data))
    assert load_profile(f) == p
    for table, value, msg in [
        ("a2a_latency_ms", {"3": 1.0}, "a2a_latency_ms keys must be powers of two >= 2"),
        ("p2p_latency_ms", {"1": 1.0}, "p2p_latency_ms keys must be powers of two >= 2"),
        ("a2a_latency_ms", {"2": -0.5}, r"a2a_latency_ms\[2\] must be a latency >= 0 ms"),
        ("p2p_latency_ms", {"4": None}, r"p2p_latency_ms\[4\] must be a latency >= 0 ms"),
        ("a2a_latency_ms", {"two": 1.0}, "a2a_latency_ms keys must be integers"),
        ("p2p_latency_ms", [1.0], r"p2p_latency_ms must be an object \{group size: ms\}"),
    ]:
        bad = json.loads(lat.to_json())
        bad[table] = value
        f.write_text(json.dumps(bad))
        with pytest.raises(ProfileError, match=msg):
            load_profile(f)
    with pytest.raises(ProfileError, match="must be a latency >= 0 ms"):
        p.with_overrides(a2a_latency_ms={2: float("nan")})


def test_example_profiles_load():
    root = EXAMPLES / "profiles"
    files = sorted(root.glob("*.json"))
    assert files
    for f in files:
        prof = load_profile(f)
        assert prof.tokens_per_device > 0 and prof.latency_ms(2) >= 0


def test_reference_constants_reproduce_flexsp_capacity():
    # FlexSP's GPT-7B at 384K context needs all 64 A100s: 64 x 28 GB / 4.48 MB = 400,000 tokens
    p = get_profile("gpt-7b-a100")
    assert 64 * p.tokens_per_device >= 384 * 1024 > 32 * p.tokens_per_device
    with pytest.raises(InfeasibleBatchError):
        plan_step(np.array([384 * 1024]), 32, p)


def test_solver_imports_neither_ray_nor_torch_distributed():
    code = (
        "import sys, pkgutil, importlib, flexorch.solver as s\n"
        "for m in pkgutil.walk_packages(s.__path__, 'flexorch.solver.'): importlib.import_module(m.name)\n"
        "bad = [m for m in sys.modules if m == 'ray' or m.startswith('ray.') or m.startswith('torch')]\n"
        "print(bad); sys.exit(1 if bad else 0)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
