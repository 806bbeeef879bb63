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
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["ProcessGroupRegistry", "RankSet", "canonical_rank_sets", "default_backend"]

RankSet = tuple[int, ...]


def default_backend() -> str:
    """gloo for CPU tensors, plus NCCL for CUDA tensors when CUDA is available."""
    return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"


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
    ) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank={rank} world_size={world_size}")
        if dist.is_initialized():
            raise RuntimeError("a torch.distributed world is already open in this process; close its registry first")
        self.rank, self.world_size, self.epoch = rank, world_size, epoch
        self.backend = backend or default_backend()
        self.timeout = timedelta(seconds=timeout_s)
        dist.init_process_group(
            self.backend,
            store=dist.PrefixStore(f"flexorch/epoch{epoch}", store),
            rank=rank,
            world_size=world_size,
            timeout=self.timeout,
        )
        self._groups: dict[RankSet, dist.ProcessGroup] = {tuple(range(world_size)): dist.group.WORLD}
        self._open = True

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
        device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else None
        gathered = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(self.world_size)]
        dist.all_gather(gathered, torch.tensor([digest], dtype=torch.int64, device=device), group=dist.group.WORLD)
        if any(int(g) != digest for g in gathered):
            raise ValueError(
                "ProcessGroupRegistry.ensure must get the same rank sets on every rank; "
                f"rank {self.rank} got {canon}, digests per rank: {[int(g) for g in gathered]}"
            )
        for rs in canon:
            if rs not in self._groups:
                self._groups[rs] = dist.new_group(list(rs), timeout=self.timeout)

    def group(self, ranks: Iterable[int]) -> dist.ProcessGroup:
        """The cached group of ``ranks``; this rank must be a member and ``ensure`` must have created it."""
        self._check_open()
        rs = tuple(sorted({int(r) for r in ranks}))
        if self.rank not in rs:
            raise ValueError(f"rank {self.rank} is not a member of group {list(rs)}")
        if rs not in self._groups:
            raise KeyError(f"group {list(rs)} was not created; call ensure() with it on every rank first")
        return self._groups[rs]

    def close(self) -> None:
        """Leave the world and drop every group of this epoch (idempotent)."""
        if self._open:
            self._open = False
            self._groups.clear()
            dist.destroy_process_group()

    def __enter__(self) -> ProcessGroupRegistry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if not self._open:
            raise RuntimeError(f"the registry of epoch {self.epoch} is closed")
