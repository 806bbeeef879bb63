"""One torch.distributed world per membership epoch, and the sub-groups a plan names inside it.

Contract (``torch.distributed.new_group`` must be entered by every rank of the world, in the same order):

* :meth:`ProcessGroupRegistry.ensure` is a *collective over the whole world*: every rank calls it with the
  same rank sets (for instance all sequence-parallel groups of the current plan, members or not). It
  canonicalises the list (deduplicated, sorted by size then ranks), checks with one all-gather that every rank
  passed the same list (a mismatch raises on every rank instead of deadlocking), then creates the missing
  groups in that order.
* :meth:`ProcessGroupRegistry.group` is local: it returns a group already created by ``ensure``.

Overlapping groups ({0,1,2,3}, {0,1}, {2,3}, {1,3}) are ordinary torch sub-groups of one world, each with its
own gloo/NCCL communicator, so collectives on them stay correct (unlike ``ray.util.collective``, see
docs/design.md §3). Nothing here is global state: callers pass the groups on as arguments.

NCCL (backends ``"nccl"`` and ``"cpu:gloo,cuda:nccl"``). Read against the torch 2.13 source (``distributed_c10d.py``,
``ProcessGroupNCCL.hpp``/``.cpp``); the calls used are older than 2.11, the GPU machines' torch. Two private names
are looked up, never assumed: ``_abort_process_group`` (with a fallback, :func:`abort_world`) and c10d's group
counter (:func:`_restart_group_names`, which says why no public call does its job):

* Given the worker's CUDA ``device``, the world is created with ``init_process_group(..., device_id=device)``: the
  world is bound to that device (``ProcessGroup.bound_device_id``) and its NCCL communicator is formed at once.
  ``new_group`` then splits each sub-group's communicator off the world's (``ncclCommSplit``) instead of a fresh
  rendezvous: ``_new_process_group_helper`` splits exactly when the default group has a ``bound_device_id`` and
  the backend bound to it ``supports_splitting`` (``ProcessGroupNCCL`` does); sub-groups inherit the bound device.
  Non-members take part in the split too (``perform_nocolor_split``), which :meth:`ProcessGroupRegistry.ensure`
  already guarantees (every rank creates every group). ``dist.split_group`` is not used: it takes disjoint splits
  only, and the plan's groups overlap.
* The collective timeout is the registry's ``timeout_s`` (the actor passes ``[elastic] collective_timeout_s``):
  for NCCL it is the watchdog's per-collective timeout (``ProcessGroupNCCL.Options._timeout``).
* ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` defaults to 3 (``SkipCleanUp``: on an error or timeout the watchdog tears the
  process down without aborting its communicators). An elastic world needs its survivors alive, so unless the
  environment sets it, the registry sets 2 (``CleanUpOnly``: the watchdog aborts the communicators and the failed
  work raises, the process lives on) before the NCCL world exists; the value is read when a ``ProcessGroupNCCL``
  is constructed.
* ``close(abort=True)`` aborts the communicators (``ncclCommAbort``) instead of destroying them: a destroy waits
  for outstanding work and can hang when a peer died. gloo has nothing to abort; it is destroyed as usual.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
from collections.abc import Iterable
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

__all__ = [
    "NCCL_ASYNC_ERROR_HANDLING",
    "ProcessGroupRegistry",
    "RankSet",
    "abort_world",
    "socket_inodes",
    "backend_for",
    "canonical_rank_sets",
    "default_backend",
    "uses_nccl",
]

RankSet = tuple[int, ...]


NCCL_ASYNC_ERROR_HANDLING = "2"
"""``CleanUpOnly`` (``ErrorHandlingMode`` in ``ProcessGroupNCCL.hpp``): on an NCCL error or timeout the watchdog aborts
the communicators and fails the work, without killing the process (the default, 3, kills it)."""


def default_backend() -> str:
    """gloo for CPU tensors, plus NCCL for CUDA tensors when CUDA is available."""
    return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"


def backend_for(device: torch.device | None) -> str:
    """The backend of a worker computing on ``device``: gloo for CPU tensors, plus NCCL for CUDA tensors when the
    worker has a CUDA device (None: CPU). Unlike :func:`default_backend` it ignores GPUs the worker was not given."""
    return "cpu:gloo,cuda:nccl" if device is not None and device.type == "cuda" else "gloo"


def uses_nccl(backend: str) -> bool:
    """Whether ``backend`` (``"nccl"``, ``"gloo"``, ``"cpu:gloo,cuda:nccl"``...) creates NCCL communicators."""
    return any(part.rpartition(":")[2].strip().lower() == "nccl" for part in str(backend).split(","))


def abort_world(groups: Iterable[dist.ProcessGroup] = ()) -> None:
    """Abort every communicator of this process's world and forget the world, without waiting on any peer.

    torch 2.13 (and 2.11; the function dates from about 2.5): ``distributed_c10d._abort_process_group()`` aborts
    every group of the world inside one NCCL group call (so the aborts cannot deadlock each other) and clears c10d's
    state. Older torch: abort the CUDA backend of each of ``groups`` (the world first), then destroy, which no longer
    waits on the aborted communicators. Backends with nothing to abort (gloo) are skipped.
    """
    abort_all = getattr(c10d, "_abort_process_group", None)  # private API: looked up, not assumed
    if abort_all is not None:
        abort_all()
        return
    for pg in groups:
        try:
            backend = pg._get_backend(torch.device("cuda"))
        except (RuntimeError, AttributeError):  # no CUDA backend in this group (gloo), or not a member
            continue
        backend.abort()
    dist.destroy_process_group()


def _restart_group_names() -> None:
    """Name this world's groups from the start, as every other rank does. The one write to c10d's private state in
    flexorch, kept here alone.

    Why: c10d names the world and each ``new_group`` by a per-process counter (``_World.group_count``: "0" for the
    world, then "1", "2", ...), and each group's gloo rendezvous keys carry that name. ``init_process_group`` takes a
    number before its rendezvous; when that rendezvous fails (a peer died while the world formed) no world is left,
    yet the number stays taken. Without the reset, that process names every group of its next world one ahead of its
    peers, and their rendezvous wait on keys nobody writes until the collective timeout.

    No public call does it in torch 2.13 (read in ``distributed_c10d.py``): ``destroy_process_group`` resets the
    counter, but only by destroying a world, and raises when there is none (as after a failed init);
    ``init_process_group``'s ``group_name`` is ignored; ``new_group(use_local_synchronization=True)`` names sub-groups
    by their ranks but not the world, and changes who must enter it. Called only while no world is open, when no
    group holds a name; looked up, so a torch without the attribute skips it."""
    world = getattr(c10d, "_world", None)  # private: looked up, not assumed
    if world is not None and getattr(world, "group_count", 0):
        world.group_count = 0


def _fds() -> list[int]:
    try:
        return [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:  # no /proc (not Linux): nothing is known about the sockets
        return []


def _inode(fd: int) -> int | None:
    try:
        link = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None
    return int(link[8:-1]) if link.startswith("socket:[") else None


def socket_inodes() -> set[int]:
    """Inodes of this process's open sockets (Linux ``/proc``; empty elsewhere)."""
    return {i for i in map(_inode, _fds()) if i is not None}


def canonical_rank_sets(rank_sets: Iterable[Iterable[int]], world_size: int) -> list[RankSet]:
    """Deduplicated, sorted rank sets in the order every rank creates them; raises ValueError on bad ranks."""
    canon = set()
    for ranks in rank_sets:
        rs = tuple(sorted({int(r) for r in ranks}))
        if not rs or rs[0] < 0 or rs[-1] >= world_size:
            raise ValueError(f"rank set {sorted(ranks)} is empty or outside the world of size {world_size}")
        canon.add(rs)
    return sorted(canon, key=lambda rs: (len(rs), rs))


class ProcessGroupRegistry:
    """Owns the torch.distributed world of one membership epoch and caches its sub-groups.

    Opening joins the world (a rendezvous on ``store`` under the prefix ``flexorch/epoch<epoch>``, so one
    store serves every epoch); :meth:`close` leaves it. One registry may be open per process at a time.
    """

    def __init__(
        self,
        *,
        store: dist.Store,
        rank: int,
        world_size: int,
        epoch: int,
        backend: str | None = None,
        timeout_s: float = 300.0,
        device: torch.device | None = None,
    ) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank={rank} world_size={world_size}")
        if device is not None and device.type == "cuda" and device.index is None:
            raise ValueError(f"device must name its index (cuda:0, not cuda), got {device}")
        if dist.is_initialized():
            raise RuntimeError("a torch.distributed world is already open in this process; close its registry first")
        self.rank, self.world_size, self.epoch = rank, world_size, epoch
        self.device = device
        """This worker's device (None: CPU); an NCCL world is bound to it when it is a CUDA device."""
        self.backend = backend or (default_backend() if device is None else backend_for(device))
        self.timeout = timedelta(seconds=timeout_s)
        bind = {}
        if uses_nccl(self.backend):
            if "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in os.environ and "NCCL_ASYNC_ERROR_HANDLING" not in os.environ:
                os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = NCCL_ASYNC_ERROR_HANDLING  # an explicit value wins
            if device is not None and device.type == "cuda":
                bind["device_id"] = device  # eager NCCL init; sub-groups split off the world (module docstring)
        _restart_group_names()
        before = socket_inodes()
        dist.init_process_group(
            self.backend,
            store=dist.PrefixStore(f"flexorch/epoch{epoch}", store),
            rank=rank,
            world_size=world_size,
            timeout=self.timeout,
            **bind,
        )
        self._groups: dict[RankSet, dist.ProcessGroup] = {tuple(range(world_size)): dist.group.WORLD}
        self._open = True
        self.sockets: set[int] = socket_inodes() - before
        """Inodes of the sockets this world opened (its gloo pairs and listeners; :meth:`abort_sockets`)."""

    @property
    def world(self) -> dist.ProcessGroup:
        """The group of all ranks of this epoch."""
        self._check_open()
        return dist.group.WORLD

    def ensure(self, rank_sets: Iterable[Iterable[int]]) -> None:
        """Collective over the world: create the missing rank sets, in the same order on every rank."""
        self._check_open()
        canon = canonical_rank_sets(rank_sets, self.world_size)
        digest = int.from_bytes(hashlib.sha256(repr(canon).encode()).digest()[:7], "little")
        # A pure-NCCL world has no CPU collectives; "gloo" and "cpu:gloo,cuda:nccl" take CPU tensors.
        device = None
        if self.backend == "nccl":
            device = self.device if self.device is not None else torch.device("cuda", torch.cuda.current_device())
        gathered = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(self.world_size)]
        dist.all_gather(gathered, torch.tensor([digest], dtype=torch.int64, device=device), group=dist.group.WORLD)
        if any(int(g) != digest for g in gathered):
            raise ValueError(
                "ProcessGroupRegistry.ensure must get the same rank sets on every rank; "
                f"rank {self.rank} got {canon}, digests per rank: {[int(g) for g in gathered]}"
            )
        missing = [rs for rs in canon if rs not in self._groups]
        before = socket_inodes() if missing else set()
        for rs in missing:
            self._groups[rs] = dist.new_group(list(rs), timeout=self.timeout)
        if missing:
            self.sockets |= socket_inodes() - before

    def group(self, ranks: Iterable[int]) -> dist.ProcessGroup:
        """The cached group of ``ranks``; this rank must be a member and ``ensure`` must have created it."""
        self._check_open()
        rs = tuple(sorted({int(r) for r in ranks}))
        if self.rank not in rs:
            raise ValueError(f"rank {self.rank} is not a member of group {list(rs)}")
        if rs not in self._groups:
            raise KeyError(f"group {list(rs)} was not created; call ensure() with it on every rank first")
        return self._groups[rs]

    @contextlib.contextmanager
    def tracking(self):
        """Count the sockets opened inside the block as this world's (groups made outside :meth:`ensure`, such as a
        device mesh's), so :meth:`abort_sockets` reaches them too."""
        before = socket_inodes()
        try:
            yield
        finally:
            self.sockets |= socket_inodes() - before

    def abort_sockets(self) -> int:
        """Shut down every socket this world opened, from any thread; returns how many. The way to abort a gloo
        world: gloo's ``abort``/``shutdown`` neither interrupt a collective in flight nor close its connections
        (checked on torch 2.13), and a group's sockets close only when it is freed, which pending work on it delays
        until the collective timeout. A shut-down connection makes this rank's blocked collective fail at once, and the
        peer's operations on it too; a rank waiting on a frozen peer is freed only by its own abort, so every survivor
        aborts. Listening sockets are left alone (gloo's accept loop terminates the process on a shut-down one)."""
        targets = set(self.sockets)
        done = 0
        for fd in _fds():
            if _inode(fd) in targets:
                try:
                    with socket.socket(fileno=os.dup(fd)) as sock:  # a duplicate: the original fd stays gloo's
                        if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                            continue  # a listener: gloo's accept loop dies on a shut-down one (std::terminate)
                        sock.shutdown(socket.SHUT_RDWR)
                    done += 1
                except OSError:  # closed meanwhile, or not connected
                    pass
        return done

    def close(self, abort: bool = False) -> None:
        """Leave the world and drop every group of this epoch (idempotent).

        ``abort``: the world failed (a peer died or hung, a collective broke): with NCCL the communicators are
        aborted (:func:`abort_world`) rather than destroyed, since a destroy waits on work a dead peer never
        finishes. gloo has nothing to abort and is destroyed either way."""
        if not self._open:
            return
        self._open = False
        groups = [g for g in self._groups.values() if isinstance(g, dist.ProcessGroup)]  # the world first
        self._groups.clear()
        if abort and uses_nccl(self.backend):
            abort_world(groups)
        else:
            dist.destroy_process_group()

    def __enter__(self) -> ProcessGroupRegistry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if not self._open:
            raise RuntimeError(f"the registry of epoch {self.epoch} is closed")
