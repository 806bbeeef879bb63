"""Sharded checkpoints (``workers.sharded_checkpoint``, ``ranged_reads``, ``shard_staging``) on a one-rank gloo
world: loaded from S3 (moto's server on 127.0.0.1), a checkpoint of many small tensors costs two requests per file
(its size, then its bytes), not one per read of each tensor, a file larger than one read is fetched in ranges none of
which is fetched twice, and each loads what was saved. A staging directory whose owner died is swept, one whose owner
lives (by its pid, or by the lock it holds) is not, nor anything that is not a staging directory; a save stages in a
directory named by its process, sweeps before it stages and deletes its own after the copy, whether the copy failed
or not; the copy returns the SHA-256 of the bytes that reached the checkpoint."""

from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from flexorch.workers.process_groups import ProcessGroupRegistry
from flexorch.workers.shard_staging import STAGING_PREFIX, UNOWNED_AGE_S, sweep_staging
from flexorch.workers.sharded_checkpoint import load_sharded, save_sharded
from tests.s3_server import s3_server

LAYERS = 40
"""80 parameters; with AdamW's two moments and step each, 320 tensors in one file."""


def _trained(seed: int):
    torch.manual_seed(seed)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(LAYERS)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    scheduler.step()
    return model, optimizer, scheduler


@pytest.fixture(scope="module")
def s3():
    with s3_server() as server:
        yield server


def _save_and_load(s3, name: str) -> tuple[list[tuple[str, str, str | None]], dict[str, int]]:
    """Save a trained model, optimizer and schedule to S3 and load them into others (checked equal); the requests
    of the load (method, file name, range) and the checkpoint's files with their sizes."""
    with ProcessGroupRegistry(store=dist.HashStore(), rank=0, world_size=1, epoch=0, backend="gloo", timeout_s=10):
        saved = _trained(0)
        directory = f"{s3.root}/{name}/checkpoint_000001"
        save_sharded(directory, *saved, version=1)
        listed = s3.boto3.client("s3").list_objects_v2(Bucket="flexorch-test", Prefix=f"{name}/")["Contents"]
        files = {k["Key"].rsplit("/", 1)[1]: k["Size"] for k in listed if not k["Key"].endswith("/")}  # no markers
        assert sorted(files) == [".metadata", "__0_0.distcp", "train_state.json"]
        model, optimizer, scheduler = _trained(1)
        del s3.requests[:]
        assert load_sharded(directory, model, optimizer, scheduler) == 1
        reads = [(method, path.rsplit("/", 1)[1], span) for method, path, span in s3.requests]
    for key, value in saved[0].state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key
    for (_, a), (_, b) in zip(saved[1].state.items(), optimizer.state.items(), strict=True):
        assert all(torch.equal(a[k], b[k]) for k in ("exp_avg", "exp_avg_sq", "step"))
    assert scheduler.get_last_lr() == saved[2].get_last_lr()
    return reads, files


def test_an_s3_checkpoint_of_many_small_tensors_loads_in_a_few_requests_per_file(s3):
    reads, files = _save_and_load(s3, "many-small")
    # each file (the tensors, .metadata, train_state.json): its size, then one read; DCP's own reader read the
    # tensors and .metadata in about 7,700 requests
    assert sorted((method, f) for method, f, _ in reads) == sorted(
        [("HEAD", f) for f in files] + [("GET", f) for f in files]
    )


def test_a_file_larger_than_one_read_is_fetched_in_several_ranges_none_twice(s3, monkeypatch):
    from flexorch.workers import ranged_reads

    monkeypatch.setattr(ranged_reads, "RANGE_MAX", 4096)
    monkeypatch.setattr(ranged_reads, "RANGE_GAP", 0)
    reads, files = _save_and_load(s3, "in-ranges")
    spans = [span for method, f, span in reads if f == "__0_0.distcp" and method == "GET"]
    ranges = sorted(tuple(int(b) for b in span.removeprefix("bytes=").split("-")) for span in spans)
    assert len(ranges) > 1 and all(end - start < 4096 for start, end in ranges)
    assert all(a[1] < b[0] for a, b in zip(ranges, ranges[1:], strict=False))  # no byte fetched twice
    assert ranges[-1][1] < files["__0_0.distcp"]


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_the_sweep_deletes_only_the_staging_directories_whose_owner_is_gone(tmp_path, monkeypatch):
    dead, old = _dead_pid(), time.time() - 2 * UNOWNED_AGE_S
    made = {}
    for key, name in {
        "dead": f"{STAGING_PREFIX}{dead}-abc123_x",
        "live": f"{STAGING_PREFIX}{os.getpid()}-def456",
        "unowned_old": f"{STAGING_PREFIX}k3j_9zqa",
        "unowned_new": f"{STAGING_PREFIX}p0q1r2s3",
        "other": "flexorch-prepare-abc",
        "bench": f"{STAGING_PREFIX}bench-q6r4w71j",  # benchmarks/measured/checkpoint.py's: the prefix, not a stager's
        "odd": f"{STAGING_PREFIX}{dead}-has.dot",
    }.items():
        made[key] = tmp_path / name
        made[key].mkdir()
        (made[key] / "__0_0.distcp").write_bytes(b"x" * 10)
    os.utime(made["unowned_old"], (old, old))
    (tmp_path / f"{STAGING_PREFIX}{dead}-afile").write_text("not a directory")
    monkeypatch.setenv("FLEXORCH_STAGING_DIR", str(tmp_path))
    assert sorted(sweep_staging()) == sorted([str(made["dead"]), str(made["unowned_old"])])
    assert {p.name for p in tmp_path.iterdir()} == {
        made[k].name for k in ("live", "unowned_new", "other", "bench", "odd")
    } | {f"{STAGING_PREFIX}{dead}-afile"}
    assert sweep_staging(str(tmp_path)) == []


def test_a_staging_directory_locked_by_its_owner_is_kept_though_its_pid_looks_dead(tmp_path):
    # its owner in another pid namespace (a container sharing /dev/shm): the pid means nothing here, the lock does
    script = (
        "import fcntl, os, sys, time\n"
        "fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX)\n"
        "print('locked', flush=True)\n"
        "sys.stdin.read()\n"
    )
    staged = tmp_path / f"{STAGING_PREFIX}{_dead_pid()}-abc"
    staged.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", script, str(staged)], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        assert holder.stdout.readline() == b"locked\n"
        assert sweep_staging(str(tmp_path)) == [] and staged.is_dir()
    finally:
        holder.communicate(b"", timeout=30)
    assert sweep_staging(str(tmp_path)) == [str(staged)] and not staged.exists()


@pytest.mark.parametrize("fail", [False, True])
def test_a_save_stages_in_a_directory_named_by_its_process_and_deletes_it(tmp_path, monkeypatch, fail):
    from flexorch.workers import shard_staging

    monkeypatch.setenv("FLEXORCH_STAGING_DIR", str(tmp_path))
    stale = tmp_path / f"{STAGING_PREFIX}{_dead_pid()}-abc"
    stale.mkdir()
    seen = []

    real_copy = shard_staging._copy_staged

    def copy(staged, directory):
        seen.append(os.path.basename(staged))
        if fail:
            raise OSError("the bucket went away")
        return real_copy(staged, directory)

    monkeypatch.setattr(shard_staging, "_copy_staged", copy)
    with ProcessGroupRegistry(store=dist.HashStore(), rank=0, world_size=1, epoch=0, backend="gloo", timeout_s=10):
        write = shard_staging.stage_sharded(str(tmp_path / "out"), *_trained(0), version=3)
    with pytest.raises(RuntimeError, match="the bucket went away") if fail else contextlib.nullcontext():
        hashes = write.wait(30)
    if not fail:  # each file copied, with the SHA-256 of the bytes that reached the checkpoint
        out = tmp_path / "out"
        assert set(hashes) == {p.name for p in out.iterdir()} >= {".metadata", "__0_0.distcp", "train_state.json"}
        assert all(hashlib.sha256((out / f).read_bytes()).hexdigest() == h for f, h in hashes.items())
    assert not stale.exists()  # swept before staging
    assert seen and seen[0].startswith(f"{STAGING_PREFIX}{os.getpid()}-")
    assert not [p for p in os.listdir(tmp_path) if p.startswith(STAGING_PREFIX)]  # deleted after its copy
