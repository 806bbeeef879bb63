"""`flexorch plan` end to end on real files: output, JSON schema, and every kind of bad input."""

import json
import subprocess
import sys

import pytest

from orchestrator.cli import main
from orchestrator.lengths import parse_tokens, read_lengths
from orchestrator.record_schema import SCHEMA, validate_record
from orchestrator.records import read_records


def _run(args, capsys):
    code = main(args)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_json_lines_have_the_documented_fields(capsys):
    code, out, _ = _run(
        ["plan", "--devices", "16", "--batch", "64", "--steps", "2", "--json", "--time-limit", "0.5"], capsys
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
    args = ["plan", "--devices", "8", "--batch", "32", "--steps", "3", "--time-limit", "0.3", "--run-dir", str(run)]
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
        ["plan", "--devices", "8", "--batch", "32", "--steps", "2", "--svg", str(svg), "--time-limit", "0.3"],
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
        "--devices",
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
            "--devices",
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
            "--devices",
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
    code, out, _ = _run(["plan", "--lengths", str(d), "--devices", "2", "--batch", "2", "--steps", "1"], capsys)
    assert code == 0


def test_missing_file_unknown_profile_bad_config(tmp_path, capsys):
    code, _, err = _run(["plan", "--lengths", str(tmp_path / "nope.txt")], capsys)
    assert code == 2 and "does not exist" in err
    code, _, err = _run(["plan", "--profile", "gpt-9000"], capsys)
    assert code == 2 and "unknown profile 'gpt-9000'" in err
    cfg = tmp_path / "run.toml"
    cfg.write_text("devices = 8\nbatchsize = 3\n")
    code, _, err = _run(["plan", "--config", str(cfg)], capsys)
    assert code == 2 and "unknown keys ['batchsize']" in err
    cfg.write_text("devices = = 8\n")
    code, _, err = _run(["plan", "--config", str(cfg)], capsys)
    assert code == 2 and "not valid TOML" in err
    code, _, err = _run(["plan", "--devices", "0"], capsys)
    assert code == 2 and "--devices must be >= 1" in err
    code, _, err = _run(["plan", "--devices", "4", "--max-context", "1M"], capsys)
    assert code == 2 and "more than 4 devices hold" in err
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
        [sys.executable, "-m", "orchestrator.cli", "profiles"], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0 and "gpt-7b-a100" in r.stdout and "6250 tokens/device" in r.stdout
