"""The multi-task plan picture (``flexorch/testing/multitask_svg.py``): valid SVG, one rectangle per part per
panel, placed by its start/time and block, coloured by task, with the plan's figures in the title. Pure and fast."""

from __future__ import annotations

import importlib.util
import math
import xml.etree.ElementTree as ET

import numpy as np
import pytest

from flexorch.solver.multitask import MetaOp, TaskBatch, plan_metaops, plan_tasks
from flexorch.solver.multitask.baselines import fixed_split_parts, in_turn_parts
from flexorch.solver.profiles import get_profile
from flexorch.testing.multitask_svg import multitask_svg, task_colour
from tests.paths import BENCHMARKS

NS = "{http://www.w3.org/2000/svg}"
PANELS = ("plan", "in_turn", "fixed_split")


def _metaops(rng, num_tasks: int, num_devices: int, least: int = 1) -> tuple[MetaOp, ...]:
    """T(n) = a/n^alpha + b per task; none runs on fewer than `least` devices."""
    counts = np.array([1 << k for k in range(num_devices.bit_length())], dtype=float)
    out = []
    for t in range(num_tasks):
        ms = rng.uniform(1, 20) / counts ** rng.uniform(0.5, 1.0) + rng.uniform(0.0, 0.5)
        ms[counts < least] = math.inf
        out.append(MetaOp(task=t, level=0, layers=int(rng.integers(4, 33)), layer_ms=tuple(ms), name=f"job{t}/shared"))
    return tuple(out)


def _plan(num_tasks=5, num_devices=64, seed=0, least=1):
    return plan_metaops(
        _metaops(np.random.default_rng(seed), num_tasks, num_devices, least), num_devices, max_evals=200
    )


def _rects(root, panel=None):
    return [
        r
        for r in root.iter(f"{NS}rect")
        if r.get("class") == "part" and (panel is None or r.get("data-panel") == panel)
    ]


def _box(r):
    return tuple(float(r.get(k)) for k in ("x", "y", "width", "height"))


def _key(task, level, layers, first, count, start, time):
    return (int(task), int(level), int(layers), int(first), int(count), round(float(start), 6), round(float(time), 6))


@pytest.fixture(scope="module")
def drawn():
    plan = _plan()
    return plan, ET.fromstring(multitask_svg(plan))


def test_svg_parses_with_one_rect_per_part_per_panel(drawn):
    plan, root = drawn
    expected = {
        "plan": plan.parts,
        "in_turn": in_turn_parts(plan.metaops, plan.num_devices),
        "fixed_split": fixed_split_parts(plan.metaops, plan.num_devices),
    }
    assert expected["fixed_split"]  # this plan has all three panels
    for panel, parts in expected.items():
        got = sorted(
            _key(*(r.get(f"data-{k}") for k in ("task", "level", "layers", "first", "count", "start-ms", "time-ms")))
            for r in _rects(root, panel)
        )
        want = sorted(
            _key(p.task, p.metaop, p.layers, p.devices[0], len(p.devices), p.start_ms, p.time_ms) for p in parts
        )
        assert got == want, panel
    assert len(_rects(root)) == sum(len(p) for p in expected.values())
    # each part's tooltip
    assert all(
        r.find(f"{NS}title") is not None and "layers on ranks" in r.find(f"{NS}title").text for r in _rects(root)
    )


def test_x_and_width_are_start_and_time_on_one_shared_scale(drawn):
    plan, root = drawn
    rects = _rects(root)
    start = np.array([float(r.get("data-start-ms")) for r in rects])
    time = np.array([float(r.get("data-time-ms")) for r in rects])
    x, _, w, _ = np.array([_box(r) for r in rects]).T
    scale = w / time
    assert np.allclose(scale, scale[0], rtol=1e-3)  # one scale over all panels: widths compare
    left = x - start * scale[0]
    assert np.allclose(left, left[0], atol=1e-2)
    # the longest schedule fills the time axis: all panels end within it, the Spindle one no later than a baseline
    ends = {
        p: max(float(a) + float(b) for a, b in ((r.get("x"), r.get("width")) for r in _rects(root, p))) for p in PANELS
    }
    assert max(ends.values()) == pytest.approx(left[0] + max(plan.makespan_ms, *plan.baselines_ms.values()) * scale[0])
    assert ends["plan"] == pytest.approx(left[0] + plan.makespan_ms * scale[0], abs=1e-2)
    assert ends["plan"] <= min(ends["in_turn"], ends["fixed_split"]) + 1e-2


def test_parts_that_overlap_in_time_do_not_overlap_in_rows(drawn):
    _, root = drawn
    for panel in PANELS:
        boxes = [_box(r) for r in _rects(root, panel)]
        rows = {}
        for r, (_, y, _, h) in zip(_rects(root, panel), boxes, strict=True):
            rows[int(r.get("data-first")), int(r.get("data-count"))] = (y, h)
        # y and height follow the block: one row height per panel
        row = {h / count for (_, count), (_, h) in rows.items()}
        assert max(row) == pytest.approx(min(row))
        for i, (x1, y1, w1, h1) in enumerate(boxes):
            for x2, y2, w2, h2 in boxes[i + 1 :]:
                if x1 < x2 + w2 - 1e-6 and x2 < x1 + w1 - 1e-6:  # overlap in time
                    assert y1 + h1 <= y2 + 1e-6 or y2 + h2 <= y1 + 1e-6, panel


def test_title_carries_makespan_bound_gap_and_speedups(drawn):
    plan, root = drawn
    summary = next(t for t in root.iter(f"{NS}text") if t.get("class") == "summary").text
    doc_title = root.find(f"{NS}title").text
    for text in (summary, doc_title):
        assert f"makespan {plan.makespan_ms:,.0f} ms" in text
        assert f"bound {plan.bound_ms:,.0f} ms" in text
        assert f"gap {plan.gap * 100:.1f} %" in text
        for key in ("in_turn", "fixed_split"):
            base = plan.baselines_ms[key]
            assert f"{base:,.0f} ms ({base / plan.makespan_ms:.2f}x)" in text


def test_each_task_has_its_own_colour():
    assert len({task_colour(t) for t in range(16)}) == 16
    plan = _plan(num_tasks=8, seed=3)
    root = ET.fromstring(multitask_svg(plan))
    fill_of: dict[str, set[str]] = {}
    for r in _rects(root):
        fill_of.setdefault(r.get("data-task"), set()).add(r.get("fill"))
    assert len(fill_of) == 8 and all(len(f) == 1 for f in fill_of.values())  # one colour per task...
    assert len({f for fs in fill_of.values() for f in fs}) == 8  # ...and different tasks differ
    legend = [r.get("fill") for r in root.iter(f"{NS}rect") if r.get("class") == "legend"]
    assert sorted(legend) == sorted(f for fs in fill_of.values() for f in fs)


def test_256_devices_one_rect_per_part_and_impossible_split_says_so():
    plan = _plan(num_tasks=4, num_devices=256, seed=1, least=128)  # 4 x 128 > 256: no fixed split
    assert plan.baselines_ms["fixed_split"] == math.inf
    svg = multitask_svg(plan, task_names=["a", "b", "c", "d"], title="big")
    root = ET.fromstring(svg)
    assert len(_rects(root, "plan")) == len(plan.parts) < 256
    assert len(_rects(root, "in_turn")) == 4 and not _rects(root, "fixed_split")
    assert "impossible" in svg and "fixed split n/a (n/a)" in svg and ">big<" in svg
    assert all(r.find(f"{NS}title").text.split()[0] in "abcd" for r in _rects(root))
    with pytest.raises(ValueError, match="2 names for 4 tasks"):
        multitask_svg(plan, task_names=["a", "b"])


def test_real_tasks_default_to_their_names_and_baselines_can_be_left_out():
    tasks = [TaskBatch(name=f"t{i}", lengths=[2000 + 500 * i] * (4 + 4 * i), adapter_rank=8) for i in range(3)]
    plan = plan_tasks(tasks, 8, get_profile("gpt-7b-a100"), max_evals=100)
    root = ET.fromstring(multitask_svg(plan, baselines=False))
    assert {r.get("data-panel") for r in _rects(root)} == {"plan"}
    legend_text = [t.text for t in root.iter(f"{NS}text")]
    assert {"t0", "t1", "t2"} <= set(legend_text)


def test_benchmark_writes_the_picture(tmp_path, capsys):
    path = BENCHMARKS / "sim" / "multi_task.py"
    spec = importlib.util.spec_from_file_location("bench_multi_task_svg", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "p.svg"
    assert bench.main(["--quick", "--svg", str(out)]) == 0
    root = ET.fromstring(out.read_text())
    assert _rects(root, "plan") and "64 devices x 3 tasks" in root.find(f"{NS}title").text
    with pytest.raises(SystemExit):
        bench.main(["--quick", "--svg", str(out), "--svg-row", "256:8"])
