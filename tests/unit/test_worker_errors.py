"""What a failure inside a worker's world becomes (``flexorch.workers.errors.typed_failure``): torch's typed errors
by type, gloo's transport errors (a plain ``RuntimeError`` on torch 2.13) by their one narrow text rule, and anything
else the worker's own error. The driver sorts by these classes (``flexorch.control.settle``)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from flexorch.workers.errors import (
    CollectiveTimeoutError,
    PeerLostError,
    StepOutOfMemoryError,
    WorldUnreachableError,
    typed_failure,
)

# gloo's messages as torch 2.13 raises them: a peer killed mid-collective, and one that never joined the collective
GLOO_CLOSED = "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [::1]:1"
GLOO_TIMEOUT = "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 3s"


@pytest.mark.parametrize(
    ("err", "cls"),
    [
        (RuntimeError(GLOO_CLOSED), PeerLostError),
        (RuntimeError(GLOO_TIMEOUT), CollectiveTimeoutError),
        (dist.DistBackendError("NCCL error: remote process exited"), PeerLostError),
        (dist.DistNetworkError("Connection reset by peer"), PeerLostError),
        (dist.DistStoreError("wait timeout after 1000ms"), PeerLostError),
        (BrokenPipeError(32, "Broken pipe"), PeerLostError),
        (TimeoutError("timed out"), CollectiveTimeoutError),
    ],
)
def test_a_broken_world_is_a_lost_peer_named_with_its_cause(err, cls):
    got = typed_failure(err, "worker 3")
    assert type(got) is cls and isinstance(got, PeerLostError)
    assert str(got).startswith("worker 3: the world broke (") and str(err).splitlines()[0][:40] in str(got)


def test_errors_typed_at_their_source_pass_as_they_are():
    for err in (PeerLostError("worker 1: the world broke (the rendezvous store is gone)"), WorldUnreachableError("x")):
        assert typed_failure(err, "worker 1") is err


def test_out_of_memory_is_its_own_kind():
    got = typed_failure(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore"), "worker 2")
    assert isinstance(got, StepOutOfMemoryError) and not isinstance(got, PeerLostError)
    assert str(got) == "worker 2 ran out of device memory: CUDA out of memory. Tried to allocate 2.00 GiB"


def test_the_workers_own_error_stays_its_own_unless_the_driver_aborted_the_world():
    for err in (ValueError("a bug"), RuntimeError("the request timed out"), AttributeError("no attribute 'to_local'")):
        assert typed_failure(err, "worker 0") is None  # text alone names no broken world outside gloo's errors
        assert type(typed_failure(err, "worker 0", aborted=True)) is PeerLostError
