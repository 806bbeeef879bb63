"""The static plan picture (``flexorch/dashboards/plan_svg.py``, `flexorch plan --svg`): boxes coloured by SP degree,
or, for a step of several tasks (``task_of``), by each group's task with the tasks in the legend; and the one palette
the dashboards' SVG pictures share. Pure and fast."""

from __future__ import annotations

import dataclasses
import xml.etree.ElementTree as ET

import numpy as np
import pytest

from flexorch.dashboards import plan_svg
from flexorch.dashboards.plan_svg import MIXED_COLOUR, PALETTE, render_steps_svg, render_svg, task_colour
from flexorch.solver.multitask.execute import plan_task_step, task_groups
from flexorch.solver.profiles import get_profile
from flexorch.solver.step_planner import heuristic_plan
from flexorch.testing import multitask_svg

NS = "{http://www.w3.org/2000/svg}"
PROFILE = get_profile("gpt-7b-a100")
LENGTHS = [20_000, 9_000, 3_000, 1_200, 800, 700, 600, 500, 400, 300]
TASK_OF = [0, 0, 1, 1, 1, 1, 2, 2, 2, 2]
NAMES = ["chat", "code", "docs"]


@pytest.fixture(scope="module")
def task_plan():
    plan, _ = plan_task_step(LENGTHS, TASK_OF, 8, PROFILE, adapter_ranks=(8, 4, 2))
    return plan


def _boxes(root) -> list:
    """The group boxes (white-stroked rects), in drawing order."""
    return [r for r in root.iter(f"{NS}rect") if r.get("stroke") == "white"]


def test_degree_mode_colours_by_degree_and_has_no_task_marks():
    plan = heuristic_plan(PROFILE, np.random.default_rng(1).lognormal(8, 1.2, 24).astype(int) + 16, 16, None).plan
    svg = render_svg(plan, PROFILE, "step 0")
    root = ET.fromstring(svg)
    degrees = [g.degree for mb in plan.micro_batches for g in mb.groups]
    assert [b.get("fill") for b in _boxes(root)] == [PALETTE[d.bit_length() - 1] for d in degrees]
    assert "data-task" not in svg and 'class="legend"' not in svg
    legend = [t.text for t in root.iter(f"{NS}text") if (t.text or "").startswith("SP ")]
    assert legend == [f"SP {d}" for d in sorted(set(degrees))]


def test_task_mode_colours_each_group_by_its_task(task_plan):
    svg = render_svg(task_plan, PROFILE, "tasks", task_of=TASK_OF, task_names=NAMES)
    root = ET.fromstring(svg)
    want = [t for row in task_groups(task_plan, TASK_OF) for t in row]
    boxes = _boxes(root)
    assert len(set(want)) == 3 and [int(b.get("data-task")) for b in boxes] == want
    assert [b.get("fill") for b in boxes] == [task_colour(t) for t in want]
    assert all(NAMES[t] in b.find(f"{NS}title").text for b, t in zip(boxes, want, strict=True))
    legend = [r for r in root.iter(f"{NS}rect") if r.get("class") == "legend"]
    assert [(int(r.get("data-task")), r.get("fill")) for r in legend] == [(t, task_colour(t)) for t in range(3)]
    texts = [t.text for t in root.iter(f"{NS}text")]
    assert all(n in texts for n in NAMES) and not any((t or "").startswith("SP ") for t in texts)
    # without names the tasks are numbered; a group of several tasks is grey, and the legend says so
    mixed = list(TASK_OF)
    first = task_plan.micro_batches[0].groups[0].seq_ids
    assert len(first) > 1
    mixed[first[0]] = 2 if mixed[first[0]] != 2 else 0
    root = ET.fromstring(render_steps_svg([("a", task_plan)], PROFILE, task_of=[mixed]))
    assert _boxes(root)[0].get("fill") == MIXED_COLOUR and _boxes(root)[0].get("data-task") == ""
    texts = [t.text for t in root.iter(f"{NS}text")]
    assert "task 0" in texts and "several tasks / no task" in texts


def test_task_mode_beside_a_step_without_tasks_and_bad_lengths(task_plan):
    plain = heuristic_plan(PROFILE, LENGTHS, 8, None).plan
    root = ET.fromstring(render_steps_svg([("tasks", task_plan), ("plain", plain)], PROFILE, task_of=[TASK_OF, None]))
    n_task = sum(len(mb.groups) for mb in task_plan.micro_batches)
    boxes = _boxes(root)
    assert all(b.get("fill") == MIXED_COLOUR for b in boxes[n_task:])  # the step without tasks: grey
    with pytest.raises(ValueError, match="one entry per step"):
        render_steps_svg([("tasks", task_plan)], PROFILE, task_of=[TASK_OF, TASK_OF])
    with pytest.raises(ValueError, match="9 tasks for the plan's 10 sequences"):
        render_svg(task_plan, PROFILE, task_of=TASK_OF[:-1])


def test_one_palette_for_every_picture():
    assert multitask_svg.task_colour is plan_svg.task_colour
    assert [task_colour(t) for t in range(len(PALETTE))] == list(PALETTE)
    assert len({task_colour(t) for t in range(40)}) == 40
    assert not hasattr(multitask_svg, "_PALETTE")  # no second copy


def test_node_boundaries_are_drawn_for_a_plan_on_nodes():
    from flexorch.solver.planner import Planner, PlannerConfig
    from flexorch.solver.topology import Topology

    profile = get_profile("gpt-7b-a100")
    topo = Topology((8, 8, 7), ("gpu-a", "gpu-b", "gpu-c"))
    with Planner(profile, PlannerConfig(time_limit_s=0.3, isolate=False)) as planner:
        plan = planner.plan([300, 4096, 60_000, 80, 2048, 9000], 23, topology=topo).plan
    svg = render_svg(plan, profile)
    root = ET.fromstring(svg)
    lines = [e for e in root.iter("{http://www.w3.org/2000/svg}line") if e.get("class") == "node"]
    assert len(lines) == 2  # between nodes 0/1 and 1/2
    assert "gpu-c (7)" in svg
    assert 'class="node"' not in render_svg(dataclasses.replace(plan, topology=None), profile)


def _slow_plan(speeds):
    """A plan of the test batch on 8 devices, priced with ``speeds`` (its topology's, as a speed-aware plan has)."""
    from flexorch.solver.topology import Topology

    plan = heuristic_plan(PROFILE, LENGTHS, 8, None).plan
    return dataclasses.replace(plan, topology=Topology.single(8).with_speeds(speeds))


def test_a_slow_device_is_shaded_with_its_speed():
    speeds = [1.0, 1.0, 1.0, 0.52, 1.0, 1.0, 0.7, 0.7]
    plan = _slow_plan(speeds)
    svg = render_svg(plan, PROFILE)
    root = ET.fromstring(svg)
    rects = list(root.iter(f"{NS}rect"))
    bands = [r for r in rects if r.get("class") == "slow"]
    # rank 3 alone, ranks 6-7 as one run (a slow node is shaded and labelled once); 0.85x and above is not slow
    assert [(b.get("data-rank"), b.get("data-ranks"), b.get("data-speed")) for b in bands] == [
        ("3", "1", "0.52"),
        ("6", "2", "0.7"),
    ]
    assert "rank 3: 0.52x the others" in bands[0].find(f"{NS}title").text
    assert "ranks 6-7: 0.70x the others" in bands[1].find(f"{NS}title").text
    # the band covers its device rows, across the panel, behind the boxes (drawn first: it shows where they idle)
    panel = next(r for r in rects if r.get("fill") == "white" and r.get("stroke") == "#333")
    row = float(panel.get("height")) / 8
    assert float(bands[0].get("y")) == pytest.approx(float(panel.get("y")) + 3 * row, abs=0.01)
    assert float(bands[1].get("height")) == pytest.approx(2 * row, abs=0.01)
    assert bands[0].get("width") == panel.get("width")
    assert max(rects.index(b) for b in bands) < min(rects.index(b) for b in _boxes(root))
    labels = [t for t in root.iter(f"{NS}text") if t.get("class") == "slow-label"]
    assert [t.find(f"{NS}title").tail for t in labels] == ["0.52x", "0.70x"]
    assert len([r for r in rects if r.get("class") == "slow-mark"]) == 2
    assert any("slow device (below 0.8x" in (t.text or "") for t in root.iter(f"{NS}text"))
    # each box says the pace its group runs at where a member is off 1.0: its slowest member's speed
    groups = [g for mb in plan.micro_batches for g in mb.groups]
    for box, g in zip(_boxes(root), groups, strict=True):
        pace = min(speeds[r] for r in g.ranks)
        tip = box.find(f"{NS}title").text
        assert (f"at {pace:.2f}x (its slowest member's speed)" in tip) == (pace != 1.0), tip


def test_no_shade_without_a_slow_device():
    plain = heuristic_plan(PROFILE, LENGTHS, 8, None).plan
    for plan in (plain, _slow_plan([1.0] * 7 + [0.85])):  # no speeds; one at 0.85x (not slow)
        svg = render_svg(plan, PROFILE)
        assert 'class="slow' not in svg and "slow device" not in svg
    assert "at 0.85x (its slowest member" in render_svg(_slow_plan([1.0] * 7 + [0.85]), PROFILE)
