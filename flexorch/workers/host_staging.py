"""Host-memory copies of a worker's state for asynchronous checkpoints, in buffers kept from one save to the next.

An asynchronous save copies the state the step is about to change (parameters, optimizer moments) to host memory,
and a background thread writes the copy while training goes on (``workers.checkpoint_writes``). A fresh copy costs
its memory's first touch as well as the copy: on this project's CPU machines ``clone()`` of 150 MB took 242 ms where
``copy_()`` into buffers already touched took 23 ms (``benchmarks/measured/checkpoint.py``), and that copy is the part
of an asynchronous save the step waits for. So :class:`HostStaging` keeps one buffer per tensor (by its place in the
state) and copies into it at each save; a buffer is re-made only when its tensor's shape or dtype changed. From CUDA
the buffers are pinned and the copies non-blocking, synchronised once (torchtitan's ``async_with_pinned_mem`` and
DCP's cached staging do the same).

A buffer is rewritten by the next :meth:`HostStaging.copy`, so the caller must not stage again before the write of the
previous copy is done (``ModelState.finish_upload`` is waited for first: at most one save in flight).
"""

from __future__ import annotations

import torch

__all__ = ["HostStaging"]


class HostStaging:
    """Kept host buffers, one per tensor of a state tree (nested dicts, lists, tuples of tensors and plain values)."""

    def __init__(self):
        self._buffers: dict[tuple, torch.Tensor] = {}

    def copy(self, tree):
        """A copy of ``tree`` whose tensors are in this staging's host buffers (detached, on the CPU); plain values
        are kept as they are. Buffers of paths no longer in ``tree`` are released."""
        seen: set[tuple] = set()
        out = self._copy(tree, (), seen)
        for path in set(self._buffers) - seen:
            del self._buffers[path]
        if any(b.is_pinned() for b in self._buffers.values()) and torch.cuda.is_available():
            torch.cuda.synchronize()  # the non-blocking device-to-host copies have landed
        return out

    @property
    def nbytes(self) -> int:
        """Bytes held in the kept buffers."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def _copy(self, obj, path: tuple, seen: set[tuple]):
        if isinstance(obj, torch.Tensor):
            seen.add(path)
            return self._buffer(path, obj).copy_(obj.detach(), non_blocking=obj.device.type == "cuda")
        if isinstance(obj, dict):
            return {k: self._copy(v, (*path, k), seen) for k, v in obj.items()}
        if isinstance(obj, list | tuple):
            return type(obj)(self._copy(v, (*path, i), seen) for i, v in enumerate(obj))
        return obj

    def _buffer(self, path: tuple, like: torch.Tensor) -> torch.Tensor:
        buf = self._buffers.get(path)
        if buf is None or buf.shape != like.shape or buf.dtype != like.dtype:
            pin = like.device.type == "cuda"
            buf = torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=pin)
            self._buffers[path] = buf
        return buf
