"""``flexorch dashboard s3://...``: a run's records, copied to its checkpoint storage at each checkpoint
(``control.run_checkpoints``), are copied back into a local directory the plan viewer serves, and copied again as
they change; a storage without run records is refused, saying what to pass."""

from __future__ import annotations

import argparse
import json
import threading
import time
import urllib.request

import pytest

from flexorch.cli.dashboard import _dashboard_source
from flexorch.cli.main import main
from flexorch.config import ConfigError
from flexorch.control.checkpoint_store import CheckpointStore
from flexorch.control.run_checkpoints import MIRRORED, fetch_records
from flexorch.dashboards.viewer import ViewerServer
from tests.s3_server import s3_server


@pytest.fixture(scope="module")
def s3():
    with s3_server() as server:
        yield server


def _record(step: int) -> str:
    return json.dumps({"step": step, "plan": {"micro_batches": []}, "predicted_ms": 1.0}) + "\n"


def _mirror(tmp_path, storage: str, steps: int) -> None:
    """What a run's checkpoints leave in its storage: its records under ``run/``."""
    run = tmp_path / "run"
    run.mkdir(exist_ok=True)
    (run / "steps.jsonl").write_text("".join(_record(s) for s in range(1, steps + 1)))
    (run / "config.json").write_text(json.dumps({"steps": 9}))
    store = CheckpointStore(storage)
    for name in ("steps.jsonl", "config.json"):
        store.put_file(run / name, "run", name)


def test_the_records_in_storage_are_copied_back_and_again_as_they_change(s3, tmp_path, monkeypatch):
    storage = f"{s3.root}/dash/one"
    _mirror(tmp_path, storage, steps=2)
    into = tmp_path / "copy"
    assert fetch_records(storage, into) == [n for n in MIRRORED if n in ("config.json", "steps.jsonl")]
    assert len((into / "steps.jsonl").read_text().splitlines()) == 2
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    stop = threading.Event()
    local, what = _dashboard_source(argparse.Namespace(run_dir=storage, refresh=0.2), stop)
    assert what.startswith(f"{storage}/run (copied to {local}") and local.is_relative_to(tmp_path / "home")
    server = ViewerServer(local, port=0).start()
    try:
        _mirror(tmp_path, storage, steps=3)  # the next checkpoint copies the records again
        deadline = time.monotonic() + 20
        while len((local / "steps.jsonl").read_text().splitlines()) < 3:
            assert time.monotonic() < deadline, "the dashboard's copy was not refreshed"
            time.sleep(0.1)
        with urllib.request.urlopen(server.url, timeout=10) as page:
            assert page.status == 200
    finally:
        stop.set()  # the refreshing thread ends (else it would go on copying from the next test's server)
        server.shutdown()
        server.server_close()


def test_a_storage_without_run_records_is_refused_saying_what_to_pass(s3, tmp_path, capsys):
    storage = f"{s3.root}/dash/empty"
    with pytest.raises(ConfigError, match=r"run/steps.jsonl does not exist: pass the \[checkpoint\] storage of a run"):
        fetch_records(storage, tmp_path / "copy")
    assert main(["dashboard", storage, "--port", "0"]) != 0
    assert "run/steps.jsonl does not exist" in capsys.readouterr().err
