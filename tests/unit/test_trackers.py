"""Experiment trackers (``[tracking]``): every step record reaches TensorBoard, MLflow and W&B, read back with each
tool's own reader (TensorBoard's ``EventAccumulator``, ``MlflowClient.get_metric_history``, the records of W&B's
offline ``.wandb`` file); a tracker that fails is switched off while the others and the run go on; a tracker asked
for whose package is missing is refused with what to install. Records come from a real run
(``tests/data/recorded_run``) and from the real driver stepped in-process on a fake worker group (no Ray)."""

from __future__ import annotations

import json
import struct
import sys
import time
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest

from flexorch.config import (
    ConfigError,
    CorpusConfig,
    ModelConfig,
    OptimConfig,
    PlanSettings,
    TrackingSettings,
    TrainConfig,
    config_from_dict,
    load_train_config,
)
from flexorch.config.requirements import check_requirements
from flexorch.records.tracker_backends import MLflowTracker, flat_params
from flexorch.records.trackers import Trackers, step_figures
from flexorch.records.writer import StepRecords, read_records, skip_record
from tests.fake_cluster import fake_driver, memory_corpus
from tests.paths import DATA
from tests.train_helpers import cpu_profile, write_corpus

RECORDED = DATA / "recorded_run" / "steps.jsonl"
CONFIG = {"steps": 5, "workers": 4, "model": {"dim": 64, "num_layers": 2}, "plan": {"mode": "adaptive"}}


@pytest.fixture(scope="module")
def recorded() -> list[dict]:
    return read_records(RECORDED, validate=True)


def _tensorboard_series(run_dir: Path, tag: str = "loss") -> list[tuple[int, float]]:
    """(step, value) of every point of ``tag`` TensorBoard shows for ``run_dir`` (a purged point is gone, a point
    logged twice is there twice)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def _series(records: list[dict], key: str = "loss") -> list:
    """What :func:`_tensorboard_series` must find for ``records`` (TensorBoard keeps float32)."""
    return [(r["step"], pytest.approx(r[key], rel=1e-6)) for r in records]


def _env(**versions):
    """An environment whose installed distributions are ``versions`` (None: not installed) and this venv's others."""

    def installed(name: str) -> str:
        v = versions[name.replace("-", "_")] if name.replace("-", "_") in versions else metadata.version(name)
        if v is None:
            raise metadata.PackageNotFoundError(name)
        return v

    return installed


def _hide(monkeypatch, module: str) -> None:
    """Make ``module`` (and its submodules other tests imported) fail to import, as if it were not installed."""
    for name in {module, *(m for m in sys.modules if m.startswith(f"{module}."))}:
        monkeypatch.setitem(sys.modules, name, None)


def _mlflow_run(uri: str, name: str):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("flexorch").experiment_id])
    assert run.info.run_name == name
    return client, run


# ---------------------------------------------------------------- figures of a record


def test_step_figures_take_the_records_numbers_and_the_plans_shape(recorded, tmp_path):
    rec = recorded[4]
    fig = step_figures(rec)
    for key in ("loss", "tokens_per_s", "lr", "grad_norm", "measured_ms", "predicted_ms", "solve_s", "tokens"):
        assert fig[key] == rec[key], key
    mbs = rec["plan"]["micro_batches"]
    assert fig["micro_batches"] == len(mbs) and fig["groups"] == sum(len(mb) for mb in mbs) > len(mbs)
    assert (fig["workers"], fig["skipped"], fig["recoveries"]) == (4, 0, 0)
    assert "targets" not in fig and "gap" not in fig, "keys a record lacks are not made up"

    more = {**rec, "targets": 900, "gap": 0.25, "plan_budget_s": 0.5, "task_losses": {"chat": 2.5, "code/py": 3.0}}
    more["recoveries"] = [{"what": "shrink"}, {"what": "grow"}]
    fig = step_figures(more)
    assert (fig["targets"], fig["gap"], fig["plan_budget_s"], fig["recoveries"]) == (900, 0.25, 0.5, 2)
    assert (fig["loss/chat"], fig["loss/code_py"]) == (2.5, 3.0)

    base = {k: rec[k] for k in ("step", "epoch", "batch_index", "doc_ids", "seq_lengths", "world_size", "worker_ids")}
    base.update(mode="adaptive", solve_s=0.1, plan_wait_ms=0.0, boundary_ms=0.0, baselines_ms={}, recoveries=[])
    skipped = StepRecords(tmp_path).append(skip_record(base, "infeasible", "too long"))  # as the driver writes it
    fig = step_figures(skipped)
    assert fig["skipped"] == 1 and fig["solve_s"] == 0.1 and fig["tokens"] == rec["tokens"]
    assert not {"loss", "lr", "measured_ms", "micro_batches"} & set(fig), fig


def test_flat_params_are_dotted_text_cut_to_mlflows_limit():
    flat = flat_params({"steps": 5, "model": {"dim": 64, "hf": None}, "data": {"source": "x" * 50}, "t": (1, 2)}, 20)
    assert flat == {"steps": "5", "model.dim": "64", "model.hf": "null", "data.source": "x" * 20, "t": "[1, 2]"}


# ---------------------------------------------------------------- each tracker, read back with its own reader


def test_tensorboard_holds_every_step_and_a_resume_replaces_the_steps_trained_again(recorded, tmp_path):
    run_dir = tmp_path / "run"
    trackers = Trackers.open(TrackingSettings(tensorboard=True), run_dir, CONFIG)
    assert trackers.names == ["tensorboard"]
    for rec in recorded:
        trackers.log_step(rec)
    trackers.close()
    assert [r["step"] for r in recorded] == [0, 1, 2, 3, 4]
    assert _tensorboard_series(run_dir) == _series(recorded)

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    (text,) = acc.Tensors("config")
    assert json.loads(text.tensor_proto.string_val[0].decode()) == CONFIG

    # a resume from the checkpoint after step 2 trains steps 3 and 4 again: their new points replace the old
    again = [{**rec, "loss": rec["loss"] + 10} for rec in recorded[3:]]
    trackers = Trackers.open(TrackingSettings(tensorboard=True), run_dir, CONFIG, resumed_from=3)
    for rec in again:
        trackers.log_step(rec)
    trackers.close()
    assert _tensorboard_series(run_dir) == _series(recorded[:3] + again)

    # a fresh run in the same directory (as steps.jsonl, which it empties) shows itself only
    trackers = Trackers.open(TrackingSettings(tensorboard=True), run_dir, CONFIG)
    trackers.log_step(recorded[0])
    trackers.close()
    assert _tensorboard_series(run_dir) == _series(recorded[:1])


def test_mlflow_file_store_has_the_config_as_params_and_every_steps_metrics(recorded, tmp_path):
    uri = TrackingSettings(mlflow=str(tmp_path / "mlruns")).mlflow
    assert uri.startswith("file:///"), "a directory becomes an absolute file URI"
    trackers = Trackers.open(TrackingSettings(mlflow=uri, tensorboard=False), tmp_path / "run", CONFIG)
    assert trackers.names == ["mlflow"]
    for rec in recorded:
        trackers.log_step(rec)
    trackers.close()
    client, run = _mlflow_run(uri, "run")
    history = client.get_metric_history(run.info.run_id, "loss")
    assert [(m.step, m.value) for m in history] == [(r["step"], r["loss"]) for r in recorded]
    assert [m.timestamp for m in history] == [int(r["time"] * 1000) for r in recorded]
    tps = client.get_metric_history(run.info.run_id, "tokens_per_s")
    assert [m.value for m in tps] == [r["tokens_per_s"] for r in recorded]
    assert run.data.params == {"steps": "5", "workers": "4", "model.dim": "64", "model.num_layers": "2",
                               "plan.mode": "adaptive"}  # fmt: skip
    assert client.get_run(run.info.run_id).info.status == "FINISHED"


def _wandb_records(path: Path) -> list:
    """The records of a ``.wandb`` file: W&B's header (":W&B", magic, version) and then LevelDB's log format
    (32 KiB blocks of chunks: crc32, length, type; FULL = 1, FIRST = 2, MIDDLE = 3, LAST = 4), each record a
    ``wandb_internal_pb2.Record``. This wandb has no Python reader of its own (its service, in Go, writes them)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B", data[:8]
    pos, chunk, out = 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        _crc, size, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:
            pos += left
            continue
        if pos + 7 + size > len(data):  # a chunk still being written
            break
        chunk += data[pos + 7 : pos + 7 + size]
        pos += 7 + size
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(chunk)
            out.append(rec)
            chunk = b""
    return out


def _items(items) -> dict:
    """A W&B record's key/value items (a key is ``key``, or ``nested_key`` in newer versions) as a dict."""
    return {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items}


@pytest.mark.timeout(120)
def _finished_wandb_records(wandb_dir: Path, wait_s: float = 60.0) -> list:
    """The records of the one offline run's ``.wandb`` file once its exit record is in it: ``run.finish()`` returns
    when W&B's service has taken the exit, and the service may still be writing the file (on a loaded machine the
    file was still empty when finish returned)."""
    deadline = time.monotonic() + wait_s
    while True:
        paths = list(wandb_dir.glob("offline-run-*/run-*.wandb"))
        assert len(paths) <= 1, paths
        records = _wandb_records(paths[0]) if paths and paths[0].stat().st_size >= 7 else []
        if any(r.HasField("exit") for r in records):
            return records
        kinds = [r.WhichOneof("record_type") for r in records]
        assert time.monotonic() < deadline, f"no exit record in {paths} {wait_s:.0f} s after finish: {kinds}"
        time.sleep(0.2)


@pytest.mark.slow
def test_wandb_offline_run_file_holds_every_step(recorded, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    notes = []
    trackers = Trackers.open(
        TrackingSettings(wandb="offline", tensorboard=False), tmp_path / "run", CONFIG, 0, notes.append
    )
    assert trackers.names == ["wandb"] and "offline run in" in notes[0]
    for rec in recorded:
        trackers.log_step(rec)
    trackers.close()
    records = _finished_wandb_records(tmp_path / "run" / "wandb")
    history = [_items(r.history.item) for r in records if r.HasField("history")]
    assert [(h["step"], h["loss"]) for h in history] == [(r["step"], r["loss"]) for r in recorded]
    assert [h["workers"] for h in history] == [4] * 5
    (run,) = [r.run for r in records if r.HasField("run")]
    config = _items(run.config.update)
    assert config["model"] == CONFIG["model"] and config["start_step"] == 0
    assert run.display_name == "run"
    (exit_record,) = [r.exit for r in records if r.HasField("exit")]
    assert exit_record.exit_code == 0


# ---------------------------------------------------------------- failures


def test_a_tracker_that_fails_while_logging_is_switched_off_and_the_others_go_on(recorded, tmp_path, monkeypatch):
    real_log, calls = MLflowTracker.log, []

    def log(self, step, figures, wall_time):
        calls.append(step)
        if step == 2:
            raise ConnectionError("server went away")
        real_log(self, step, figures, wall_time)

    monkeypatch.setattr(MLflowTracker, "log", log)
    uri = (tmp_path / "mlruns").as_uri()
    trackers = Trackers.open(TrackingSettings(tensorboard=True, mlflow=uri), tmp_path / "run", CONFIG)
    with pytest.warns(RuntimeWarning, match="mlflow failed .ConnectionError: server went away.; it is off") as w:
        for rec in recorded:
            trackers.log_step(rec)
        trackers.close()
    assert len(w) == 1 and calls == [0, 1, 2], "warned once, never called again"
    assert trackers.names == ["tensorboard"]
    assert _tensorboard_series(tmp_path / "run") == _series(recorded)
    client, run = _mlflow_run(uri, "run")
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [0, 1]
    assert run.info.status == "FAILED"


def test_a_tracker_that_cannot_start_is_reported_and_left_off(tmp_path):
    (tmp_path / "file").write_text("")  # a store under a regular file cannot be made
    settings = TrackingSettings(tensorboard=True, mlflow=str(tmp_path / "file" / "mlruns"))
    notes = []
    trackers = Trackers.open(settings, tmp_path / "run", CONFIG, say=notes.append)
    assert trackers.names == ["tensorboard"]
    assert len(notes) == 2 and notes[0].startswith("tracking: mlflow could not start (NotADirectoryError"), notes
    assert notes[1].startswith("tracking: tensorboard events in"), notes
    trackers.log_step({"step": 0, "world_size": 1, "loss": 1.5})
    trackers.close()
    assert _tensorboard_series(tmp_path / "run") == [(0, 1.5)]


@pytest.mark.parametrize(
    ("settings", "module"),
    [({"tensorboard": True}, "tensorboard"), ({"mlflow": "mlruns"}, "mlflow"), ({"wandb": "offline"}, "wandb")],
)
def test_a_tracker_asked_for_without_its_package_is_refused_with_what_to_install(
    tmp_path, monkeypatch, settings, module
):
    monkeypatch.chdir(tmp_path)  # 'mlruns' is made absolute against the current directory
    _hide(monkeypatch, module)  # import fails, find_spec finds nothing
    with pytest.raises(ConfigError, match=r"pip install \"flexorch\[track\]\""):
        Trackers.open(TrackingSettings(**{"tensorboard": False, **settings}), tmp_path, CONFIG)
    cfg = config_from_dict({"tracking": settings})
    installed = _env(**{module.replace("-", "_"): None, "mlflow_skinny": None})
    with pytest.raises(
        ConfigError, match=rf"\[tracking\] {module} = .* not installed: pip install \"flexorch\[track\]\""
    ):
        check_requirements(cfg, installed)  # what `flexorch train` runs before Ray starts


def test_tensorboard_left_unset_is_on_when_installed_and_silently_off_when_not(tmp_path, monkeypatch):
    trackers = Trackers.open(TrackingSettings(), tmp_path / "a", CONFIG)
    assert trackers.names == ["tensorboard"]
    trackers.close()
    _hide(monkeypatch, "tensorboard")
    notes = []
    assert Trackers.open(TrackingSettings(), tmp_path / "b", CONFIG, say=notes.append).names == []
    assert notes == [] and not (tmp_path / "b").exists()
    check_requirements(config_from_dict({}), _env(tensorboard=None))  # nothing asked for, nothing required


def test_flexorch_train_refuses_a_missing_tracker_before_ray_starts(tmp_path, monkeypatch, capsys):
    import flexorch.cli.train as cli_train
    from flexorch.cli.main import main

    def refuse(*a, **k):
        raise AssertionError("Ray started before the check of the trackers' packages")

    def version(name: str) -> str:
        if name == "wandb":
            raise metadata.PackageNotFoundError(name)
        return real(name)

    real = metadata.version
    monkeypatch.setattr(cli_train, "ray_session", refuse)
    monkeypatch.setattr("flexorch.config.requirements.metadata.version", version)
    _hide(monkeypatch, "wandb")
    (tmp_path / "run.toml").write_text('[tracking]\nwandb = "offline"\n')
    corpus = write_corpus(tmp_path / "corpus")
    code = main(["train", "--config", str(tmp_path / "run.toml"), "--data", str(corpus), "--run-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert (
        "[tracking] wandb = 'offline' needs wandb >= 0.20, which is not installed: pip install \"flexorch[track]\""
        in err
    )


# ---------------------------------------------------------------- the [tracking] table


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ({"tensorboard": "yes"}, "tracking.tensorboard must be true, false or left out"),
        ({"mlflow": "s3://bucket/runs"}, "tracking.mlflow must be a tracking URI: a directory"),
        ({"mlflow": ""}, "tracking.mlflow must be a tracking URI"),
        ({"wandb": "on"}, "tracking.wandb must be 'offline' .* or 'online', or left out"),
        ({"wandb_project": ""}, "tracking.wandb_project must be a non-empty name"),
        ({"run_name": 3}, "tracking.run_name must be a non-empty name"),
        ({"tensorbord": True}, r"\[tracking\]: unknown keys \['tensorbord'\]"),
    ],
)
def test_bad_tracking_values_say_what_to_write(table, message):
    with pytest.raises(ConfigError, match=message):
        config_from_dict({"tracking": table})


def test_the_tracking_table_reads_from_toml_and_survives_config_json(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text(
        '[tracking]\ntensorboard = false\nmlflow = "sqlite:///mlflow.db"\nwandb = "online"\nrun-name = "a"\n'
    )
    cfg = load_train_config(toml)
    t = cfg.tracking
    assert (t.tensorboard, t.mlflow, t.wandb, t.run_name, t.mlflow_database) == (
        False,
        "sqlite:///mlflow.db",
        "online",
        "a",
        True,
    )
    assert config_from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    assert TrackingSettings(mlflow="file:rel/store").mlflow == (Path.cwd() / "rel/store").as_uri()
    assert TrackingSettings(mlflow="https://mlflow.example:5000").mlflow == "https://mlflow.example:5000"
    # a database store needs the full mlflow package (mlflow-skinny has no SQLAlchemy stores)
    with pytest.raises(ConfigError, match="needs mlflow >= 3.0, which is not installed: pip install 'mlflow>=3.0'"):
        check_requirements(cfg, _env(mlflow=None, wandb="0.31.0"))
    file_store = config_from_dict({"tracking": {"mlflow": "mlruns"}})
    check_requirements(file_store, _env(mlflow_skinny=None, mlflow="3.2.0"))  # the full package serves as well


# ---------------------------------------------------------------- the driver


LENGTHS = [5, 40, 120, 17, 90, 64, 127, 60, 8, 33, 128, 71, 12, 50, 99, 3, 110, 45, 64, 22, 100, 7, 30, 55]


@pytest.fixture(scope="module")
def corpus():
    rng = np.random.default_rng(0)
    return memory_corpus([rng.integers(1, 257, n) for n in LENGTHS], vocab_size=257)


def _driver_cfg(tmp_path: Path, tracking: TrackingSettings, **kw) -> TrainConfig:
    """A 4-step run of the tiny model on the in-memory corpus, planned with a forced layout (no MILP)."""
    plan = PlanSettings(
        profile=str(cpu_profile(tmp_path / "profile.json")), tokens_per_worker=64, mode="static-ulysses-2"
    )
    values = dict(steps=4, workers=4, batch_size=6, run_dir=str(tmp_path / "run"), model=ModelConfig(), plan=plan)
    values.update(optim=OptimConfig(lr=1e-3, warmup_steps=1), data=CorpusConfig(source="memory", max_context=128))
    return TrainConfig(**{**values, "tracking": tracking, **kw})


def test_a_run_logs_every_record_to_tensorboard_and_outlives_a_failing_tracker(tmp_path, monkeypatch, corpus):
    def log(self, step, figures, wall_time):
        raise ConnectionError("server went away")

    monkeypatch.setattr(MLflowTracker, "log", log)
    uri = (tmp_path / "mlruns").as_uri()
    driver, _ = fake_driver(_driver_cfg(tmp_path, TrackingSettings(tensorboard=True, mlflow=uri)), corpus)
    try:
        summary = driver.run()
    finally:
        driver.shutdown()
    assert summary["event"] == "done" and summary["steps"] == 4
    records = read_records(tmp_path / "run" / "steps.jsonl", validate=True)
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert _tensorboard_series(tmp_path / "run") == _series(records)
    assert _tensorboard_series(tmp_path / "run", "measured_ms") == _series(records, "measured_ms")
    events, done = driver.poll(0)
    said = [e["message"] for e in events if e["event"] == "progress" and e["message"].startswith("tracking:")]
    assert done and len(said) == 3, said
    assert said[0].startswith("tracking: tensorboard events in") and said[1].startswith("tracking: mlflow run")
    assert "mlflow failed (ConnectionError: server went away); it is off" in said[2]
    assert not [e for e in events if e["event"] == "error"]
    _, run = _mlflow_run(uri, "run")
    assert run.info.status == "FAILED" and run.data.params["steps"] == "4"


def test_a_roll_back_replaces_the_steps_trained_again_in_tensorboard(tmp_path, corpus):
    # 2 stages x 1 worker, stage-local parameters: worker 1 dies in step 3 with stage 1's only copy, so the run goes
    # back to the checkpoint after step 1 and trains step 2 again (another measured time, the same loss)
    from flexorch.config import ElasticSettings, PipelineSettings
    from tests.fake_cluster import Fault

    cfg = _driver_cfg(
        tmp_path, TrackingSettings(tensorboard=True), workers=2, checkpoint_every=2,
        plan=PlanSettings(profile=str(cpu_profile(tmp_path / "profile.json")), tokens_per_worker=64),
        pipeline=PipelineSettings(stages=2), elastic=ElasticSettings(wait_s=2.0),
    )  # fmt: skip
    driver, _ = fake_driver(cfg, corpus, slots=3, faults=[Fault(1, "step", 3)])
    try:
        driver.run()
    finally:
        driver.shutdown()
    records = read_records(tmp_path / "run" / "steps.jsonl", validate=True)
    assert [r["step"] for r in records] == [0, 1, 2, 3] and records[2]["recoveries"][0]["rollback"]
    assert _tensorboard_series(tmp_path / "run", "measured_ms") == _series(records, "measured_ms")
