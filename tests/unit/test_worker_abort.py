"""The driver's abort reaches only the world it was meant for, and what a worker raises on an aborted world counts
as the broken world's doing (a peer loss), not the worker's own error; a worker's own error says where it was
raised. In process, at the seams: a stand-in registry (the real socket abort is tests/unit/test_process_groups.py)."""

from __future__ import annotations

import pytest

from flexorch.control.settle import _where
from flexorch.workers.actor import Worker
from flexorch.workers.errors import PeerLostError


class _Registry:
    def __init__(self, epoch: int):
        self.epoch, self.aborted, self.closed = epoch, 0, False

    def abort_sockets(self) -> int:
        self.aborted += 1
        return 3

    def close(self, abort: bool = False) -> None:
        self.closed = True


@pytest.fixture
def worker():
    return Worker(0, {}, {}, 0, num_threads=0, use_gpu=False)


def test_a_late_abort_for_an_older_world_leaves_the_new_one_alone(worker):
    assert worker.abort_world(4) == 0  # no world
    worker.registry = reg = _Registry(epoch=5)
    assert worker.abort_world(4) == 0 and reg.aborted == 0  # queued behind the failure of epoch 4: ignored
    assert worker.abort_world(5) == 3 and reg.aborted == 1
    assert worker.abort_world() == 3  # no epoch named: the current world


def test_an_error_on_an_aborted_world_is_a_peer_loss_and_otherwise_the_workers_own(worker):
    def broken():
        raise AttributeError("'Parameter' object has no attribute 'to_local'")  # what a torn-down FSDP gather left

    worker.registry = _Registry(epoch=7)
    with pytest.raises(AttributeError) as own:  # no abort: a bug of this worker, with its traceback as a note
        worker._guarded(broken)
    assert worker.registry is None
    assert _where(own.value).startswith(" (at test_worker_abort.py:") and own.value.__notes__
    worker.registry = _Registry(epoch=8)
    worker.abort_world(8)
    with pytest.raises(PeerLostError, match="worker 0: the world broke"):
        worker._guarded(broken)


def test_where_is_empty_without_a_traceback_note():
    assert _where(RuntimeError("x")) == ""


def test_a_rendezvous_store_that_closes_under_the_join_is_given_up_within_the_connect_limit(worker, monkeypatch):
    # the plain connect reaches the store, then it closes (the world broke meanwhile): TCPStore's client used to
    # retry for the whole collective timeout (120 s), so a survivor sat it out and was killed as hung, its shard
    # lost (CI: no emergency checkpoint). Now the connect has STORE_CONNECT_S; the collective timeout comes after.
    import socket
    import threading
    import time

    from flexorch.workers import actor

    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def accept_and_close() -> None:  # a store that takes a connection and drops it, every time
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            conn.close()

    threading.Thread(target=accept_and_close, daemon=True).start()
    monkeypatch.setattr(actor, "STORE_CONNECT_S", 2.0)
    t0 = time.monotonic()
    try:
        with pytest.raises(PeerLostError, match="the world broke"):
            worker._guarded(worker._join, "127.0.0.1", port, 0, 2, 7, 120.0)
    finally:
        server.close()
    assert time.monotonic() - t0 < 60, "retried for the collective timeout instead of the connect limit"
