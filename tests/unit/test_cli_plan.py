"""`flexorch plan` end to end on real files: output, JSON schema, and every kind of bad input."""

import json
import re
import subprocess
import sys

import pytest

from flexorch.cli.main import main
from flexorch.cli.plan import parse_speeds
from flexorch.data.lengths import parse_tokens, read_lengths
from flexorch.records.schema import SCHEMA, validate_record
from flexorch.records.writer import read_records
from tests.pipeline_helpers import TIGHT_PROFILE


def _run(args, capsys):
    code = main(args)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_json_lines_have_the_documented_fields(capsys):
    code, out, _ = _run(
        ["plan", "--workers", "16", "--batch", "64", "--steps", "2", "--json", "--time-limit", "0.5"], capsys
    )
    assert code == 0
    recs = [json.loads(line) for line in out.strip().splitlines()]
    assert [r["step"] for r in recs] == [0, 1]
    for r in recs:
        assert validate_record(r) is r and r["schema"] == SCHEMA and r["source"] == "plan"
        assert r["bound_ms"] <= r["predicted_ms"]
        assert r["tokens"] == sum(s - 1 for s in r["seq_lengths"]) and r["world_size"] == 16
        assert {"static-ulysses-16", "static-ring-16", "static-ulysses-1", "batchada"} <= set(r["baselines_ms"])
        ids = sorted(i for mb in r["plan"]["micro_batches"] for g in mb for i in g["seq_ids"])
        assert ids == list(range(64))
        # the timeline is the cost model's schedule: groups of a micro-batch start together, the last one ends at
        # the predicted step time
        ends = [t["start_ms"] + t["time_ms"] for t in r["timeline"]]
        assert max(ends) == pytest.approx(r["predicted_ms"], rel=1e-6)
        for mb in r["plan"]["micro_batches"]:
            for g in mb:
                assert g["kind"] in ("ulysses", "ring") and len(g["ranks"]) == g["degree"]
                assert len(g["seq_lengths"]) == len(g["seq_ids"])


def test_run_dir_gets_the_records_it_printed(tmp_path, capsys):
    run = tmp_path / "plan-run"
    args = ["plan", "--workers", "8", "--batch", "32", "--steps", "3", "--time-limit", "0.3", "--run-dir", str(run)]
    code, out, _ = _run(args + ["--json"], capsys)
    assert code == 0
    printed = [json.loads(line) for line in out.splitlines()]
    written = read_records(run / "steps.jsonl", validate=True)
    assert written == printed and [r["step"] for r in written] == [0, 1, 2]
    code, out, _ = _run(args, capsys)  # the table run names the file and how to view it
    assert code == 0 and f"flexorch dashboard {run}" in out and len(read_records(run / "steps.jsonl")) == 3


def test_table_and_picture(tmp_path, capsys):
    svg = tmp_path / "p.svg"
    code, out, err = _run(
        ["plan", "--workers", "8", "--batch", "32", "--steps", "2", "--svg", str(svg), "--time-limit", "0.3"],
        capsys,
    )
    assert code == 0, err
    assert "x batchada" in out and "summary over 2 steps" in out
    text = svg.read_text()
    assert text.startswith("<svg") and text.count("<rect") > 3 and "step 1" in text


def test_batches_are_seeded_and_cover_the_data_once_per_epoch(tmp_path, capsys):
    f = tmp_path / "lengths.txt"
    f.write_text("\n".join(str(10 + i) for i in range(12)) + "\n")
    args = [
        "plan",
        "--lengths",
        str(f),
        "--workers",
        "4",
        "--profile",
        "gpt-7b-a100",
        "--batch",
        "4",
        "--steps",
        "3",
        "--json",
        "--seed",
        "5",
    ]
    _, out1, _ = _run(args, capsys)
    _, out2, _ = _run(args, capsys)
    plans1 = [(r["step"], r["plan"]) for r in map(json.loads, out1.splitlines())]
    plans2 = [(r["step"], r["plan"]) for r in map(json.loads, out2.splitlines())]
    assert plans1 == plans2
    seen = sorted(
        s
        for line in out1.splitlines()
        for mb in json.loads(line)["plan"]["micro_batches"]
        for g in mb
        for s in g["seq_lengths"]
    )
    assert seen == list(range(10, 22))  # 3 steps x 4 = the 12 sequences, each once


def test_over_long_drop_is_counted_and_reject_fails(tmp_path, capsys):
    f = tmp_path / "lengths.txt"
    f.write_text("100\n200\n0\n500000\n300\n")
    code, out, _ = _run(
        [
            "plan",
            "--lengths",
            str(f),
            "--workers",
            "8",
            "--batch",
            "3",
            "--steps",
            "1",
            "--max-context",
            "32K",
        ],
        capsys,
    )
    assert code == 0 and "dropped 1 empty and 1 over 32768 tokens" in out
    code, _, err = _run(
        [
            "plan",
            "--lengths",
            str(f),
            "--workers",
            "8",
            "--batch",
            "3",
            "--steps",
            "1",
            "--max-context",
            "32K",
            "--over-long",
            "reject",
        ],
        capsys,
    )
    assert code == 2 and "1 sequence(s) exceed --max-context 32768" in err


@pytest.mark.parametrize(
    "content, msg",
    [("12\nabc\n", "expected one integer length per line"), ("", "holds no lengths"), ("-4\n", "negative")],
)
def test_malformed_lengths_files(tmp_path, capsys, content, msg):
    f = tmp_path / "l.txt"
    f.write_text(content)
    code, _, err = _run(["plan", "--lengths", str(f), "--steps", "1"], capsys)
    assert code == 2 and msg in err and str(f) in err


def test_jsonl_and_directory_sources(tmp_path, capsys):
    j = tmp_path / "docs.jsonl"
    j.write_text("\n".join(json.dumps({"body": "x" * n}) for n in (5, 70, 300, 9)) + "\n")
    assert read_lengths(j, text_field="body").tolist() == [5, 70, 300, 9]
    code, _, err = _run(["plan", "--lengths", str(j), "--steps", "1"], capsys)
    assert code == 2 and "no 'text' field" in err
    j.write_text('{"text": "ok"}\n{broken\n')
    code, _, err = _run(["plan", "--lengths", str(j), "--steps", "1"], capsys)
    assert code == 2 and "docs.jsonl:2: not valid JSON" in err
    d = tmp_path / "src"
    (d / "pkg").mkdir(parents=True)
    (d / "a.py").write_text("print('hi')\n")
    (d / "pkg" / "b.md").write_text("é" * 10)
    (d / "image.png").write_bytes(b"\x89PNG")
    assert sorted(read_lengths(d).tolist()) == [12, 20]  # bytes: é is 2 bytes in UTF-8; png skipped
    code, out, _ = _run(["plan", "--lengths", str(d), "--workers", "2", "--batch", "2", "--steps", "1"], capsys)
    assert code == 0


def test_missing_file_unknown_profile_bad_config(tmp_path, capsys):
    code, _, err = _run(["plan", "--lengths", str(tmp_path / "nope.txt")], capsys)
    assert code == 2 and "does not exist" in err
    code, _, err = _run(["plan", "--profile", "gpt-9000"], capsys)
    assert code == 2 and "unknown profile 'gpt-9000'" in err
    cfg = tmp_path / "run.toml"
    cfg.write_text("workers = 8\nbatchsize = 3\n")
    code, _, err = _run(["plan", "--config", str(cfg)], capsys)
    assert code == 2 and "unknown keys ['batchsize']" in err
    cfg.write_text("workers = = 8\n")
    code, _, err = _run(["plan", "--config", str(cfg)], capsys)
    assert code == 2 and "not valid TOML" in err
    code, _, err = _run(["plan", "--workers", "0"], capsys)
    assert code == 2 and "--workers must be >= 1" in err
    code, _, err = _run(["plan", "--workers", "4", "--max-context", "1M"], capsys)
    assert code == 2 and "more than 4 workers hold" in err
    code, _, err = _run(["plan", "--batch", "200000", "--steps", "1"], capsys)
    assert code == 2 and "needs at least that many" in err


def test_example_config_runs(capsys):
    code, out, _ = _run(["plan", "--config", "examples/plan_laptop.toml", "--steps", "1"], capsys)
    assert code == 0 and "summary over 1 steps" in out


def test_parse_tokens():
    assert parse_tokens("384K") == 393216 and parse_tokens("2m") == 2 * 1024 * 1024 and parse_tokens("77") == 77
    for bad in ("", "K", "12Q", "0"):
        with pytest.raises(ValueError):
            parse_tokens(bad)


def test_console_script_is_installed():
    r = subprocess.run(
        [sys.executable, "-m", "flexorch.cli.main", "profiles"], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0 and "gpt-7b-a100" in r.stdout and "6250 tokens/worker" in r.stdout


PIPELINE = ["plan", "--workers", "8", "--batch", "32", "--steps", "2", "--pipeline-stages", "2", "--time-limit", "0.5"]


def test_pipeline_json_lines_are_the_records_written(tmp_path, capsys):
    run = tmp_path / "pp-run"
    code, out, err = _run(PIPELINE + ["--json", "--run-dir", str(run)], capsys)
    assert code == 0, err
    printed = [json.loads(line) for line in out.splitlines()]
    written = read_records(run / "steps.jsonl", validate=True)
    assert written == printed and [r["step"] for r in written] == [0, 1]
    for r in written:
        assert validate_record(r) is r and r["source"] == "plan"
        # the train driver's floor: never slower (simulated) than plain 1F1B or Seq1F1B on the same stages; where a
        # baseline's schedule is faster, it is the plan (status names it) and its predicted time is the step's
        fitting = {k: v for k, v in r["baselines_ms"].items() if v is not None}
        assert r["predicted_ms"] <= min(fitting.values()) + 1e-9
        assert r["status"] in ("pipeline", "pipeline-1f1b", "pipeline-seq1f1b-4")
        if r["status"] != "pipeline":
            assert r["predicted_ms"] == pytest.approx(fitting[r["status"].removeprefix("pipeline-")], rel=1e-12)
        assert r["plan"] is None and r["timeline"] is None and r["bound_ms"] == 0.0 and r["world_size"] == 8
        pipe = r["pipeline"]
        assert (pipe["stages"], pipe["degree"], pipe["layers"]) == (2, 4, [16, 16])
        assert pipe["stage_ranks"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
        assert r["shape"] == f"pp 2x4 · {len(pipe['units'])} units"
        assert set(r["baselines_ms"]) == {"1f1b", "seq1f1b-4"}
        # one forward and one backward per unit and stage; the simulated schedule ends at the predicted step time
        keys = [(o["stage"], o["kind"], o["unit"]) for o in pipe["ops"]]
        assert sorted(keys) == sorted((s, k, u) for s in range(2) for k in "FB" for u in range(len(pipe["units"])))
        assert max(o["end_ms"] for o in pipe["ops"]) == pytest.approx(r["predicted_ms"], rel=1e-9)
        assert 0.0 <= pipe["bubble_share"] < 1.0
        assert sum(u["tokens"] for u in pipe["units"]) == sum(r["seq_lengths"])


def test_pipeline_table_rows_summary_and_picture(tmp_path, capsys):
    run, svg = tmp_path / "pp-run", tmp_path / "pp.svg"
    code, out, err = _run(PIPELINE + ["--run-dir", str(run), "--svg", str(svg)], capsys)
    assert code == 0, err
    assert "pipeline stages 2" in out
    head = next(line for line in out.splitlines() if line.lstrip().startswith("step "))
    assert head.split()[:9] == ["step", "solve_s", "step_ms", "bubble", "gran", "x", "1f1b", "x", "seq1f1b-4"]
    rows = [line for line in out.splitlines() if line[:4].strip().isdigit()]
    recs = read_records(run / "steps.jsonl", validate=True)
    assert len(rows) == len(recs) == 2
    for row, r in zip(rows, recs, strict=True):
        cells = row.split()
        assert cells[0] == str(r["step"]) and row.endswith(r["shape"]) and r["shape"].startswith("pp 2x4 · ")
        assert float(cells[1]) == pytest.approx(r["solve_s"], abs=6e-4)
        assert int(cells[2]) == round(r["predicted_ms"])
        assert float(cells[3].rstrip("%")) == pytest.approx(r["pipeline"]["bubble_share"] * 100, abs=0.06)
        assert int(cells[4]) == r["pipeline"]["granularity"]
        for cell, name in zip(cells[5:7], ("1f1b", "seq1f1b-4"), strict=True):
            assert float(cell.rstrip("x")) == pytest.approx(r["baselines_ms"][name] / r["predicted_ms"], abs=0.006)
    assert "summary over 2 steps" in out and "simulated bubble median" in out and "vs seq1f1b-4" in out
    assert f"flexorch dashboard {run}" in out
    text = svg.read_text()
    assert text.startswith("<svg") and "step 1: pp 2x4" in text
    ops = sum(len(r["pipeline"]["ops"]) for r in recs)
    assert text.count("<title>stage ") == ops  # one box per forward and backward of every step


def test_pipeline_stages_auto_picks_a_split(capsys):
    code, out, err = _run(
        ["plan", "--workers", "8", "--batch", "16", "--steps", "1", "--pipeline-stages", "auto", "--json"], capsys
    )
    assert code == 0, err
    (rec,) = [validate_record(json.loads(line)) for line in out.splitlines()]
    pipe = rec["pipeline"]
    assert pipe["stages"] >= 2 and pipe["stages"] * pipe["degree"] == 8 and 32 % pipe["degree"] == 0


@pytest.mark.parametrize(
    "value, extra, msg",
    [
        ("0", [], "--pipeline-stages must be a positive integer (>= 1) or 'auto', got 0"),
        ("-3", [], "--pipeline-stages must be a positive integer (>= 1) or 'auto', got -3"),
        ("two", [], "--pipeline-stages must be a positive integer or 'auto', got 'two'"),
        ("2.5", [], "--pipeline-stages must be a positive integer or 'auto', got '2.5'"),
        ("33", ["--workers", "64"], "--pipeline-stages 33 is more stages than profile gpt-7b-a100's 32 layers"),
        ("16", [], "--pipeline-stages 16 needs at least 16 workers, --workers is 8"),
        ("2", ["--heads", "2"], "--pipeline-stages 2 on 8 workers puts 4 workers on each stage"),
        ("auto", ["--workers", "64", "--heads", "1"], "--pipeline-stages auto: no split of 64 workers"),
    ],
)
def test_bad_pipeline_stages_exit_2_before_any_step(tmp_path, capsys, value, extra, msg):
    run = tmp_path / "run"
    args = ["plan", "--workers", "8", "--batch", "8", "--steps", "1", "--run-dir", str(run)]
    code, out, err = _run(args + extra + ["--pipeline-stages", value], capsys)
    assert code == 2 and msg in err and err.startswith("flexorch plan: error: ")
    assert not (run / "steps.jsonl").exists()  # refused before planning (and writing) anything


def test_pipeline_batch_no_checkpointing_fits_is_an_error(tmp_path, capsys):
    """A real batch the SP planner runs but no pipeline can hold (``TIGHT_PROFILE``): a 6000-token sequence needs
    0.11 GiB on stage 0, over its 0.09 GiB. As on the SP path, an infeasible step is an error (exit 2) naming the
    step."""
    profile = tmp_path / "three-layers.json"
    profile.write_text(json.dumps(TIGHT_PROFILE))
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("6000\n100\n200\n")
    args = ["plan", "--profile", str(profile), "--lengths", str(lengths), "--workers", "2", "--batch", "3"]
    code, _, err = _run(args + ["--steps", "1"], capsys)
    assert code == 0, err  # SP groups hold it
    code, _, err = _run(args + ["--steps", "1", "--pipeline-stages", "2"], capsys)
    assert code == 2
    assert "step 0 (--pipeline-stages 2): no activation checkpointing fits the memory budget" in err
    assert "unit chain of 6000 tokens" in err


def test_pipeline_batch_that_fits_only_back_to_back(tmp_path, capsys):
    """Four ~3000-token sequences on ``TIGHT_PROFILE``: two units in flight on stage 0 are over its 5000 tokens, so
    each sequence runs as a pipeline of its own, one after another; the units say which pipeline they are in."""
    profile = tmp_path / "three-layers.json"
    profile.write_text(json.dumps(TIGHT_PROFILE))
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("3000\n3000\n2800\n2900\n")
    run = tmp_path / "run"
    args = ["plan", "--profile", str(profile), "--lengths", str(lengths), "--workers", "2", "--batch", "4"]
    code, out, err = _run(args + ["--steps", "1", "--pipeline-stages", "2", "--run-dir", str(run)], capsys)
    assert code == 0, err
    (rec,) = read_records(run / "steps.jsonl", validate=True)
    assert rec["shape"] == "pp 2x1 · 4 units · 4 back-to-back"
    assert sorted(u["pipeline"] for u in rec["pipeline"]["units"]) == [0, 1, 2, 3]
    # the baselines hold it only with a micro-batch per sequence (4 = 2P), also back to back
    assert all(v is not None and v > 0 for v in rec["baselines_ms"].values())
    assert "1 step(s) as back-to-back pipelines" in out and out.count("4 back-to-back") == 1


def test_pipeline_stages_from_a_config_file_and_1_means_sp(tmp_path, capsys):
    conf = tmp_path / "plan.toml"
    conf.write_text("workers = 8\nbatch = 8\nsteps = 1\ntime_limit = 0.5\npipeline_stages = 2\njson = true\n")
    code, out, err = _run(["plan", "--config", str(conf)], capsys)
    assert code == 0, err
    (rec,) = [validate_record(json.loads(line)) for line in out.splitlines()]
    assert rec["pipeline"]["stages"] == 2 and rec["plan"] is None
    # as in `flexorch train`, one stage is no pipeline: SP groups per step (the flag wins over the file)
    code, out, err = _run(["plan", "--config", str(conf), "--pipeline-stages", "1"], capsys)
    assert code == 0, err
    (rec,) = [validate_record(json.loads(line)) for line in out.splitlines()]
    assert rec["pipeline"] is None and rec["plan"]["num_devices"] == 8


def test_gpus_per_node_plans_on_nodes_and_blind_compares(tmp_path, capsys):
    args = ["plan", "--workers", "23", "--gpus-per-node", "8", "--batch", "48", "--steps", "1", "--time-limit", "0.4"]
    code, out, _ = _run([*args, "--json"], capsys)
    assert code == 0
    (rec,) = [json.loads(line) for line in out.strip().splitlines()]
    assert validate_record(rec) is rec and rec["plan"]["topology"] == {"node_sizes": [8, 8, 7]}
    bounds = [0, 8, 16, 23]
    for mb in rec["plan"]["micro_batches"]:
        for g in mb:
            if g["degree"] <= 2:  # two nodes hold any set of groups of 1 and 2: none crosses a boundary
                assert not any(g["ranks"][0] < b <= g["ranks"][-1] for b in bounds)
    svg = tmp_path / "p.svg"
    code, out, _ = _run(["plan", "--nodes", "8,7,8", "--topology", "blind", "--batch", "48", "--steps", "1",
                         "--time-limit", "0.4", "--svg", str(svg)], capsys)  # fmt: skip
    assert code == 0 and "3 nodes: 8, 7, 8 (blind)" in out and 'class="node"' in svg.read_text()
    code, _, err = _run(["plan", "--nodes", "8,x", "--steps", "1"], capsys)
    assert code == 2 and "--nodes" in err
    code, _, err = _run(["plan", "--nodes", "8,8", "--workers", "12", "--steps", "1"], capsys)
    assert code == 2 and "--workers is 12" in err


SLOW = ["plan", "--workers", "4", "--batch", "16", "--steps", "2", "--time-limit", "0.3"]


def test_speeds_plan_around_a_slow_worker_beside_the_speed_blind_plan(tmp_path, capsys):
    run, svg = tmp_path / "run", tmp_path / "p.svg"
    code, out, err = _run([*SLOW, "--speeds", "1,1,0.5,1", "--run-dir", str(run), "--svg", str(svg)], capsys)
    assert code == 0, err
    assert "seed 0, speeds rank 2 0.50x" in out
    recs = read_records(run / "steps.jsonl", validate=True)
    assert [r["plan"]["topology"] for r in recs] == [{"node_sizes": [4], "speeds": [1.0, 1.0, 0.5, 1.0]}] * 2
    # one line under each step's row: the blind plan of the same batch priced with the speeds, and the ratio
    lines = [line for line in out.splitlines() if "speeds: speed-blind plan" in line]
    assert len(lines) == 2
    for line, rec in zip(lines, recs, strict=True):
        blind, aware = (float(x) for x in re.findall(r"(\d+) ms", line))
        assert aware == round(rec["predicted_ms"])
        assert float(re.search(r"ms: ([\d.]+)x", line).group(1)) == pytest.approx(blind / rec["predicted_ms"], abs=6e-3)
        assert "tokens rank 2 (0.50x) " in line
    ratio = re.search(r"speed-blind plans \(same batch, both priced with the speeds\): median ([\d.]+)x", out)
    assert ratio and float(ratio.group(1)) >= 1.0
    # the slow worker gets a smaller share of the tokens than the speed-blind planner gives it (~ a quarter)
    shares = {}
    for which in ("aware", "blind"):
        line = next(x for x in out.splitlines() if f"share of the step's tokens per rank, speed-{which}:" in x)
        shares[which] = [float(x) for x in re.findall(r"rank \d \([\d.]+x\) ([\d.]+)%", line)]
        assert len(shares[which]) == 4 and sum(shares[which]) == pytest.approx(100, abs=0.3)
    assert shares["aware"][2] < shares["blind"][2]
    assert 'class="slow"' in svg.read_text()  # the picture shades the slow device


def test_speeds_per_rank_index_per_node_and_from_a_config_file(tmp_path, capsys):
    code, out, err = _run([*SLOW, "--nodes", "2,2", "--speeds", "node1=0.7,0=0.9", "--json"], capsys)
    assert code == 0, err
    recs = [json.loads(line) for line in out.splitlines()]  # --json: stdout stays one record per line
    assert [r["plan"]["topology"] for r in recs] == [{"node_sizes": [2, 2], "speeds": [0.9, 1.0, 0.7, 0.7]}] * 2
    conf = tmp_path / "plan.toml"
    conf.write_text("workers = 4\nbatch = 16\nsteps = 1\ntime_limit = 0.3\njson = true\nspeeds = [1, 1, 1, 0.5]\n")
    code, out, err = _run(["plan", "--config", str(conf)], capsys)
    assert code == 0, err
    assert json.loads(out)["plan"]["topology"]["speeds"] == [1.0, 1.0, 1.0, 0.5]
    code, out, err = _run(["plan", "--config", str(conf), "--speeds", "3:0.25"], capsys)  # the flag wins
    assert code == 0, err
    assert json.loads(out)["plan"]["topology"]["speeds"] == [1.0, 1.0, 1.0, 0.25]


def test_parse_speeds_forms():
    assert parse_speeds(None, 4) is None
    assert parse_speeds("1, 1,0.5,1", 4) == (1.0, 1.0, 0.5, 1.0)
    assert parse_speeds("3=0.5", 4) == parse_speeds("3:0.5", 4) == (1.0, 1.0, 1.0, 0.5)
    assert parse_speeds("node1=0.7", 5, (3, 2)) == (1.0, 1.0, 1.0, 0.7, 0.7)
    assert parse_speeds("node0=0.5,1=2", 5, (3, 2)) == (0.5, 2.0, 0.5, 1.0, 1.0)  # a rank beside its node wins
    assert parse_speeds({"node1": 0.7, "0": 0.9}, 4, (2, 2)) == (0.9, 1.0, 0.7, 0.7)  # a TOML table
    assert parse_speeds([1, 0.5], 2) == (1.0, 0.5)


@pytest.mark.parametrize(
    "extra, msg",
    [
        (["--speeds", "1,1,0.5"], "--speeds gives 3 speed(s) for 4 workers; give one per worker in rank order"),
        (["--speeds", "1,1,0,1"], "--speeds: the speed of rank 2 must be a number > 0"),
        (["--speeds", "1,1,-0.5,1"], "--speeds: the speed of rank 2 must be a number > 0"),
        (["--speeds", "1,fast,1,1"], "--speeds: the speed of rank 1 must be a number > 0 (a relative speed: 1.0"),
        (["--speeds", "1,1,nan,1"], "--speeds: the speed of rank 2 must be a number > 0"),
        (["--speeds", "1,1,inf,1"], "--speeds: the speed of rank 2 must be a number > 0"),
        (["--speeds", "3=0"], "--speeds: the speed of rank 3 must be a number > 0"),
        (["--speeds", "7=0.5"], "--speeds: rank 7 is outside the 4 workers (ranks 0-3)"),
        (["--speeds", "node1=0.7"], "--speeds node1=0.7 names a node, but the plan has none: give --nodes"),
        (["--nodes", "2,2", "--speeds", "node5=0.7"], "--speeds: unknown node 'node5'; the nodes are node0, node1"),
        (["--nodes", "2,2", "--speeds", "node1=slow"], "--speeds: the speed of node node1 must be a number > 0"),
        (["--speeds", "1,1,3=0.5,1"], "--speeds mixes plain speeds and KEY=SPEED pairs"),
        (["--speeds", "3=0.5,3:0.6"], "--speeds names '3' twice"),
        (["--speeds", " "], "--speeds is empty"),
        (["--speeds", "1,1,0.5,1", "--pipeline-stages", "2"], "--speeds prices SP groups; a pipelined plan"),
    ],
)
def test_bad_speeds_exit_2_before_any_step(tmp_path, capsys, extra, msg):
    run = tmp_path / "run"
    code, out, err = _run([*SLOW, "--run-dir", str(run), *extra], capsys)
    assert code == 2 and msg in err and err.startswith("flexorch plan: error: "), err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not (run / "steps.jsonl").exists() and "step_ms" not in out  # refused before planning anything


def test_a_window_prices_the_steps_attention_by_its_band_and_bad_windows_exit_2(tmp_path, capsys):
    """--window / --window-share (or config keys window, window_share): the same batch with a 1K window on 5 of 6
    layers is predicted cheaper than the quadratic model's (its long documents' attention costs ``2 s w - w^2``)."""
    base = ["plan", "--workers", "16", "--batch", "64", "--steps", "1", "--json", "--time-limit", "0.5"]
    predicted = {}
    for name, extra in (("global", []), ("windowed", ["--window", "1K", "--window-share", "5/6"])):
        code, out, _ = _run([*base, *extra], capsys)
        assert code == 0
        predicted[name] = json.loads(out.strip().splitlines()[0])["predicted_ms"]
    assert predicted["windowed"] < 0.97 * predicted["global"], predicted
    cfg = tmp_path / "plan.toml"
    cfg.write_text('window = "1K"\nwindow_share = "5/6"\n')
    code, out, _ = _run([*base, "--config", str(cfg)], capsys)
    assert code == 0 and json.loads(out.strip().splitlines()[0])["predicted_ms"] < 0.97 * predicted["global"]
    for extra, msg in ((["--window-share", "1"], "--window-share needs --window"),
                       (["--window", "1K", "--window-share", "7"], "--window-share must be in (0, 1]"),
                       (["--window", "1K", "--window-share", "a/b"], "must be a fraction like 5/6"),
                       (["--window", "lots"], "--window: not a token count")):  # fmt: skip
        code, _, err = _run([*base, *extra], capsys)
        assert code == 2 and msg in err, err
