"""Worker devices and NCCL handling: the device pinned, the NCCL world bound to it, failed worlds aborted.

The GPU and NCCL branches run on CPU against fakes at the seams (``torch.cuda``, ``init_process_group``,
``_abort_process_group``, ``destroy_process_group``); what gloo can show runs for real, in-process (a world of one)
and between spawned processes (a peer killed). A CUDA test at the end runs the real NCCL path when a GPU is there.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from flexorch.workers.devices import DeviceUnavailableError, pin_device
from flexorch.workers.process_groups import ProcessGroupRegistry, abort_world, backend_for, uses_nccl

CUDA0 = torch.device("cuda", 0)
ENV = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
# flexorch.workers.actor (Ray, FSDP) is imported inside the tests that use it: the processes this module spawns
# import the module, and three of them importing Ray at once would take most of a test's time on a small machine.


class FakeCuda:
    """Stands in for ``torch.cuda``: ``count`` visible devices, records ``set_device``."""

    def __init__(self, available: bool = True, count: int = 1):
        self.available, self.count = available, count
        self.set_to: list = []

    def is_available(self) -> bool:
        return self.available

    def device_count(self) -> int:
        return self.count

    def set_device(self, device) -> None:
        self.set_to.append(device)


# ------------------------------------------------------------------ devices.pin_device


def test_cpu_worker_gets_no_device_and_touches_no_cuda():
    cuda = FakeCuda(available=False, count=0)
    assert pin_device(False, cuda=cuda) is None
    assert cuda.set_to == []


def test_gpu_worker_pins_the_first_visible_device_or_the_given_one():
    cuda = FakeCuda(count=2)
    assert pin_device(True, cuda=cuda) == CUDA0
    assert pin_device(True, 1, cuda=cuda) == torch.device("cuda", 1)
    assert cuda.set_to == [CUDA0, torch.device("cuda", 1)]


def test_torch_cuda_itself_is_the_default_seam(monkeypatch):
    set_to = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", set_to.append)
    assert pin_device(True) == CUDA0
    assert set_to == [CUDA0]


def test_use_gpu_without_cuda_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    cuda = FakeCuda(available=False, count=0)
    with pytest.raises(DeviceUnavailableError, match=r"use_gpu is set but torch.cuda.is_available\(\) is False") as e:
        pin_device(True, cuda=cuda)
    msg = str(e.value)
    assert "CUDA_VISIBLE_DEVICES=''" in msg and "run without use_gpu" in msg, msg
    assert cuda.set_to == []


def test_use_gpu_with_the_index_not_visible_is_a_clear_error():
    cuda = FakeCuda(count=1)
    with pytest.raises(DeviceUnavailableError, match=r"sees 1 CUDA device\(s\), so cuda:1 does not exist.*num_gpus"):
        pin_device(True, 1, cuda=cuda)
    with pytest.raises(ValueError, match="local_index must be >= 0"):
        pin_device(True, -1, cuda=cuda)
    assert cuda.set_to == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_worker_asked_for_a_gpu_on_a_cpu_machine_fails_at_construction():
    from flexorch.workers.actor import Worker

    with pytest.raises(DeviceUnavailableError, match="use_gpu is set"):
        Worker(0, {}, {}, 0, num_threads=0, use_gpu=True)


def test_worker_wants_a_gpu_when_told_or_else_when_cuda_is_there(monkeypatch):
    from flexorch.workers.actor import _wants_gpu

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _wants_gpu(True) is True and _wants_gpu(None) is False
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert _wants_gpu(False) is False and _wants_gpu(None) is True  # not in a Ray actor: as before pinning


# ------------------------------------------------------------------ the registry's NCCL branches, against fakes


@pytest.fixture
def fake_init(monkeypatch):
    """``dist.init_process_group`` replaced by a recorder (kwargs plus the NCCL env var at the time of the call)."""
    calls: list[dict] = []

    def init(backend, **kwargs):
        calls.append({"backend": backend, "env": os.environ.get(ENV), **kwargs})

    monkeypatch.setattr(dist, "init_process_group", init)
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.delenv("NCCL_ASYNC_ERROR_HANDLING", raising=False)
    return calls


def _registry(backend, device, timeout_s=42.0):
    return ProcessGroupRegistry(
        store=dist.HashStore(), rank=0, world_size=2, epoch=7, backend=backend, timeout_s=timeout_s, device=device
    )


@pytest.mark.parametrize(
    ("backend", "device", "backend_used", "bound"),
    [
        ("nccl", CUDA0, "nccl", True),
        ("cpu:gloo,cuda:nccl", torch.device("cuda", 1), "cpu:gloo,cuda:nccl", True),
        (None, CUDA0, "cpu:gloo,cuda:nccl", True),  # the backend follows the device
        ("gloo", CUDA0, "gloo", False),  # gloo cannot be bound to a CUDA device
        ("cpu:gloo,cuda:nccl", None, "cpu:gloo,cuda:nccl", False),  # no device: lazy NCCL, as before
        (None, torch.device("cpu"), "gloo", False),
    ],
)
def test_init_gets_device_id_only_for_nccl_with_a_cuda_device(fake_init, backend, device, backend_used, bound):
    reg = _registry(backend, device)
    (call,) = fake_init
    assert call["backend"] == reg.backend == backend_used
    assert call.get("device_id") == (device if bound else None)
    assert ("device_id" in call) is bound
    assert call["timeout"] == timedelta(seconds=42.0)  # NCCL's watchdog timeout is the registry's timeout_s
    assert (call["rank"], call["world_size"]) == (0, 2)


def test_a_cuda_device_without_index_is_refused(fake_init):
    with pytest.raises(ValueError, match="must name its index"):
        _registry("nccl", torch.device("cuda"))
    assert fake_init == []


def test_nccl_async_error_handling_is_on_before_the_nccl_world(fake_init, monkeypatch):
    _registry("cpu:gloo,cuda:nccl", CUDA0)
    assert fake_init[-1]["env"] == "2" and os.environ[ENV] == "2"  # CleanUpOnly: abort comms, keep the process
    monkeypatch.delenv(ENV)
    _registry("gloo", None)
    assert fake_init[-1]["env"] is None and ENV not in os.environ  # gloo worlds leave NCCL settings alone
    monkeypatch.setenv(ENV, "1")
    _registry("nccl", CUDA0)
    assert fake_init[-1]["env"] == "1"  # an explicit value wins
    monkeypatch.delenv(ENV)
    monkeypatch.setenv("NCCL_ASYNC_ERROR_HANDLING", "0")
    _registry("nccl", CUDA0)
    assert ENV not in os.environ  # nor is the deprecated name overridden


@pytest.fixture
def fake_teardown(monkeypatch):
    """``_abort_process_group`` and ``destroy_process_group`` replaced by recorders."""
    calls: list[str] = []
    monkeypatch.setattr(c10d, "_abort_process_group", lambda group=None: calls.append("abort"))
    monkeypatch.setattr(dist, "destroy_process_group", lambda group=None: calls.append("destroy"))
    return calls


@pytest.mark.parametrize(
    ("backend", "abort", "expected"),
    [
        ("nccl", True, ["abort"]),
        ("cpu:gloo,cuda:nccl", True, ["abort"]),
        ("nccl", False, ["destroy"]),
        ("gloo", True, ["destroy"]),  # nothing to abort in gloo
        ("gloo", False, ["destroy"]),
    ],
)
def test_close_aborts_nccl_worlds_and_destroys_gloo_ones_once(fake_init, fake_teardown, backend, abort, expected):
    reg = _registry(backend, CUDA0)
    reg.close(abort=abort)
    reg.close(abort=abort)
    reg.close()
    assert fake_teardown == expected
    with pytest.raises(RuntimeError, match="is closed"):
        reg.world  # noqa: B018


def test_abort_falls_back_to_the_nccl_backends_on_older_torch(monkeypatch):
    """Without ``_abort_process_group`` (torch < 2.5): abort each group's CUDA backend, then destroy."""
    monkeypatch.delattr(c10d, "_abort_process_group")
    calls: list[str] = []

    class Backend:
        def __init__(self, name):
            self.name = name

        def abort(self):
            calls.append(f"abort {self.name}")

    class Group:
        def __init__(self, name, has_cuda):
            self.name, self.has_cuda = name, has_cuda

        def _get_backend(self, device):
            assert device == torch.device("cuda")
            if not self.has_cuda:
                raise RuntimeError("No backend type associated with device type cuda")
            return Backend(self.name)

    monkeypatch.setattr(dist, "destroy_process_group", lambda group=None: calls.append("destroy"))
    abort_world([Group("world", True), Group("gloo-only", False), Group("sub", True)])
    assert calls == ["abort world", "abort sub", "destroy"]


def test_backend_names():
    assert [uses_nccl(b) for b in ("nccl", "cpu:gloo,cuda:nccl", "gloo", "cpu:gloo", "NCCL")] == [
        True,
        True,
        False,
        False,
        True,
    ]
    assert backend_for(None) == backend_for(torch.device("cpu")) == "gloo"
    assert backend_for(CUDA0) == "cpu:gloo,cuda:nccl"


# ------------------------------------------------------------------ the actor's wiring


class RecordingRegistry:
    def __init__(self, **kwargs):
        self.kwargs, self.closed = kwargs, []
        self.epoch = kwargs.get("epoch")

    def close(self, abort=False):
        self.closed.append(abort)


def _bare_worker(device=None):
    from flexorch.workers.actor import Worker

    w = Worker(5, {}, {}, 0, num_threads=0, use_gpu=False)  # on the CPU; the world's device is what the test says
    w.device = device
    return w


def test_worker_passes_its_device_and_backend_to_the_registry(monkeypatch):
    from flexorch.workers import actor

    monkeypatch.setattr(actor, "ProcessGroupRegistry", RecordingRegistry)
    checked = []  # the reachability check (tests/unit/test_network.py) needs the peer this test has not
    monkeypatch.setattr(actor, "check_reachable", lambda store, rank, n, epoch, binding, t: checked.append(rank) or 0.0)
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    w = _bare_worker(CUDA0)
    w._join("127.0.0.1", master.port, 1, 2, 3, 9.0)
    kw = w.registry.kwargs
    assert kw["device"] == CUDA0 and kw["backend"] == "cpu:gloo,cuda:nccl"
    assert (kw["rank"], kw["world_size"], kw["epoch"], kw["timeout_s"]) == (1, 2, 3, 9.0)
    w = _bare_worker(None)
    w._join("127.0.0.1", master.port, 0, 2, 3, 9.0)
    assert w.registry.kwargs["device"] is None and w.registry.kwargs["backend"] == "gloo"
    assert checked == [1, 0]  # every join checks its world's pairs before it forms


def test_a_failed_step_leaves_the_world_by_aborting_it():
    from flexorch.workers.errors import PeerLostError

    w = _bare_worker()
    w.registry = reg = RecordingRegistry()

    def step():
        raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer")

    with pytest.raises(PeerLostError, match="worker 5: the world broke"):
        w._guarded(step)
    assert reg.closed == [True] and w.registry is None
    w.registry = reg = RecordingRegistry()
    with pytest.raises(ValueError, match="a bug"):  # the worker's own error: re-raised, the world aborted all the same
        w._guarded(lambda: (_ for _ in ()).throw(ValueError("a bug")))
    assert reg.closed == [True]


def test_leave_world_destroys_unless_told_to_abort():
    w = _bare_worker()
    w.registry = reg = RecordingRegistry()
    w.leave_world()
    w.leave_world()  # idempotent: the registry is gone
    assert reg.closed == [False]
    w.registry = reg = RecordingRegistry()
    w.leave_world(abort=True)
    assert reg.closed == [True]


# ------------------------------------------------------------------ real gloo


def _one_rank_world(epoch: int) -> ProcessGroupRegistry:
    return ProcessGroupRegistry(store=dist.HashStore(), rank=0, world_size=1, epoch=epoch, backend="gloo", timeout_s=10)


@pytest.mark.parametrize("torch_has_abort", [True, False])
def test_abort_world_on_a_real_gloo_world_leaves_room_for_the_next(monkeypatch, torch_has_abort):
    """The real ``_abort_process_group`` of this torch (and the fallback for torch without it) end the world."""
    if not torch_has_abort:
        monkeypatch.delattr(c10d, "_abort_process_group")
    try:
        reg = _one_rank_world(0)
        reg.ensure([(0,)])
        abort_world([reg.world])
        assert not dist.is_initialized()
        with _one_rank_world(1) as reg:
            x = torch.full((2,), 3.0)
            dist.all_reduce(x, group=reg.world)
            assert x.tolist() == [3.0, 3.0]
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_registry_close_with_abort_on_real_gloo_is_idempotent():
    try:
        reg = _one_rank_world(2)
        reg.close(abort=True)
        assert not dist.is_initialized()
        reg.close(abort=True)  # no second destroy (it would raise: no world)
        with _one_rank_world(3):
            assert dist.get_world_size() == 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


DEAD_RANK, DEAD_EXIT = 2, 17


def _survive_a_dead_peer(rank: int, port: int, results) -> None:
    """A world of 3; rank 2 dies without a goodbye; 0 and 1 see the collective break, abort the world in bounded
    time and form a world of 2 on the same store."""
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    reg = ProcessGroupRegistry(store=store, rank=rank, world_size=3, epoch=0, backend="gloo", timeout_s=15)
    x = torch.ones(1)
    dist.all_reduce(x, group=reg.world)
    if rank == DEAD_RANK:
        os._exit(DEAD_EXIT)  # as a node loss would
    broke = None
    try:
        dist.all_reduce(torch.ones(1), group=reg.world)
    except Exception as e:  # noqa: BLE001 - the broken collective is what this test is about
        broke = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    t0 = time.monotonic()
    reg.close(abort=True)
    close_s = time.monotonic() - t0
    still_open = dist.is_initialized()
    with ProcessGroupRegistry(store=store, rank=rank, world_size=2, epoch=1, backend="gloo", timeout_s=15) as reg:
        y = torch.tensor([float(rank + 1)])
        dist.all_reduce(y, group=reg.world)
    results.put((rank, x.item(), broke, close_s, still_open, y.item()))


@pytest.mark.slow
def test_survivors_abort_a_world_whose_peer_died_and_form_a_new_one():
    ctx = mp.get_context("spawn")
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    results = ctx.Queue()
    procs = [ctx.Process(target=_survive_a_dead_peer, args=(r, master.port, results), daemon=True) for r in range(3)]
    for p in procs:
        p.start()
    got = {}
    deadline = time.monotonic() + 90
    try:
        while len(got) < 2:
            try:
                rank, *rest = results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"survivors hung: answers from ranks {sorted(got)} only")
            got[rank] = rest
        for p in procs:
            p.join(timeout=30)
        assert [p.exitcode for p in procs] == [0, 0, DEAD_EXIT]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    for rank in (0, 1):
        first, broke, close_s, still_open, second = got[rank]
        assert first == 3.0  # the world of 3 worked
        assert broke is not None, f"rank {rank}: a collective with a dead peer did not fail"
        assert close_s < 10.0 and not still_open, (rank, close_s, still_open)
        assert second == 3.0  # 1 + 2: the survivors' new world
