"""The driver's abort reaches only the world it was meant for, and what a worker raises on an aborted world counts
as the broken world's doing (a peer loss), not the worker's own error; a worker's own error says where it was
raised. In process, at the seams: a stand-in registry (the real socket abort is tests/test_process_groups.py)."""

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
