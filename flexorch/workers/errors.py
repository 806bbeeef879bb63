"""The errors a worker raises for the driver to sort (``flexorch.control.settle``), and the one place a failure in a
world becomes one of them (:func:`typed_failure`): apart from the worker so that every part of it can
raise them.

The driver sorts by class: a :class:`PeerLostError` (and its :class:`CollectiveTimeoutError`) means the world broke
and this worker is fine; a :class:`StepOutOfMemoryError` re-plans the step with less memory; anything else, a
:class:`WorldUnreachableError` included, is the worker's own error and stops the run.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = [
    "CollectiveTimeoutError",
    "PeerLostError",
    "StepOutOfMemoryError",
    "WorldUnreachableError",
    "drop_frames",
    "typed_failure",
]


class PeerLostError(RuntimeError):
    """A collective failed because the world broke (a peer died, hung or left); this worker has left the world
    and keeps its state from before the step, ready to join the next one."""


class CollectiveTimeoutError(PeerLostError):
    """A collective waited its timeout out: a peer never came (it hung, or died without closing its connections).
    The driver treats it as a lost peer."""


class StepOutOfMemoryError(RuntimeError):
    """This worker's device ran out of memory in a step. Its gradients are dropped and its cache emptied, so the
    state it holds is the state before the step; the driver re-plans the step with a smaller memory budget."""


class WorldUnreachableError(RuntimeError):
    """Before a world formed, some of its workers could not connect to others at the addresses their collectives
    announce (``flexorch.workers.network.check_reachable``): a setup error, named with the two addresses and what to
    set, not a lost worker. Every rank raises it, so the driver stops the run instead of shrinking it."""


def typed_failure(err: BaseException, who: str, aborted: bool = False) -> BaseException | None:
    """The typed error that ``err``, raised while this worker was in a world, stands for; None when it is the
    worker's own error. ``who`` starts the message (``"worker 3"``); ``aborted``: the driver shut this world down
    (``Worker.abort_world``), so whatever the world's work raised after that is the broken world's.

    By type: ``torch.OutOfMemoryError`` is a :class:`StepOutOfMemoryError`; a :class:`PeerLostError` raised at its
    source and a :class:`WorldUnreachableError` pass as they are; torch's ``DistError`` family
    (``DistBackendError``: NCCL errors and its watchdog's timeouts; ``DistNetworkError`` and ``DistStoreError``: the
    store's and the sockets' failures) and Python's ``ConnectionError`` are a lost peer, ``TimeoutError`` a
    collective timeout (c10d has no timeout type of its own: its timeouts are lost peers here).

    By text, in one case only: gloo's transport errors (``gloo::IoException``: "Connection closed by peer", "Timed
    out waiting ... for recv operation", "Read error", "Broken pipe") cross into Python as a plain ``RuntimeError``
    (checked on torch 2.13: a peer killed mid-collective, and one that never joined the collective), so a
    ``RuntimeError`` naming gloo (its messages carry their gloo source file) is a lost peer, a collective timeout
    when it says it timed out. Without this a dead or hung peer of a CPU world would stop the run as this worker's
    own error instead of shrinking the world."""
    text = str(err)
    first = text.splitlines()[0][:300] if text else type(err).__name__
    if isinstance(err, torch.OutOfMemoryError):
        return StepOutOfMemoryError(f"{who} ran out of device memory: {first if text else 'out of memory'}")
    if isinstance(err, PeerLostError | WorldUnreachableError):
        return err
    cls = None
    if isinstance(err, TimeoutError):
        cls = CollectiveTimeoutError
    elif isinstance(err, dist.DistError | ConnectionError):
        cls = PeerLostError
    elif isinstance(err, RuntimeError) and "gloo" in text:
        cls = CollectiveTimeoutError if "Timed out" in text else PeerLostError
    elif aborted:
        cls = PeerLostError
    return None if cls is None else cls(f"{who}: the world broke ({first})")


def drop_frames(err: BaseException) -> None:
    """Clear the tracebacks of ``err`` and of every exception chained to it (``__cause__``, ``__context__``): their
    frames hold the failed step's locals (the model, its activations and hooks, and through them the world's process
    groups), and a gloo group closes its sockets only when nothing holds it any more."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        err.__traceback__ = None
        err = err.__cause__ or err.__context__
