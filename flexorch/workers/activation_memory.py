"""Measure activation memory exactly, on any device: the bytes autograd keeps for backward during a forward.

``torch.autograd.graph.saved_tensors_hooks`` sees every tensor saved for backward (by built-in ops and by
custom ``autograd.Function``'s ``save_for_backward``, e.g. the SP attention kernels). Several saved tensors
often share one storage (views, the same input saved by two ops), so bytes are summed over *distinct storages*
(deduplicated by the storage's data pointer). Storages of parameters and buffers are not activations and can
be excluded; a parameter saved as itself or as a view (a matmul saves ``w.t()``: under FSDP2 a view of the gathered
parameter, freed after the unit's forward and gathered again for its backward) is never counted. Tensors an
activation checkpoint keeps alive for its recompute are reported to the active meter by
``flexorch.workers.recompute.note_kept``. What the meter cannot see: tensors an ``autograd.Function`` stashes on
``ctx`` by attribute or a recompute's closure holds (a Transformers layer's cos/sin under full recompute), and the
allocator's transient peak inside a kernel or during a layer's recompute in the backward. The result is what the
planner's ``act_per_token`` models (docs/design.md §2.1): ``measure_activation_bytes(...) / tokens``. Its figures
match a count by hand of what each layer keeps (``flexorch.workers.activation_count``) and ``torch.profiler``'s memory
events (``tests/unit/test_activation_count.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from flexorch.workers.model import AttnFn
from flexorch.workers.recompute import kept_tensor_sink

__all__ = ["SavedTensorMeter", "measure_activation_bytes", "saved_tensor_meter"]


@dataclass
class SavedTensorMeter:
    """Running totals of the distinct storages saved for backward while the meter is active."""

    exclude: frozenset[int] = frozenset()
    """Storage data pointers not to count (parameters, buffers)."""
    storages: dict[int, int] = field(default_factory=dict)
    """data_ptr -> nbytes of every distinct counted storage."""
    saved_tensors: int = 0
    """Tensors saved (before deduplication, excluded ones included)."""

    @property
    def bytes(self) -> int:
        """Total bytes of the distinct counted storages."""
        return sum(self.storages.values())

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self.saved_tensors += 1
        if isinstance(t if t._base is None else t._base, nn.Parameter):
            return t  # a parameter or a view of one (``w.t()`` saved by a matmul): model state, not activations
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self.exclude and storage.nbytes() > 0:
            # Saved tensors stay alive until backward (the caller holds the graph), so pointers are not reused.
            self.storages[ptr] = storage.nbytes()
        return t


def _storage_ptrs(tensors: Iterable[torch.Tensor]) -> frozenset[int]:
    # a DTensor (FSDP2's sharded parameter) has no storage of its own: its local shard has
    return frozenset((t.to_local() if hasattr(t, "to_local") else t).untyped_storage().data_ptr() for t in tensors)


@contextlib.contextmanager
def saved_tensor_meter(exclude: Iterable[torch.Tensor] = ()) -> Iterator[SavedTensorMeter]:
    """Count what autograd saves inside the ``with`` block, leaving out the storages of ``exclude``.

    Keep the forward's output alive until the block ends: freed activations could hand their address to a
    later one and be counted once.
    """
    meter = SavedTensorMeter(exclude=_storage_ptrs(exclude))
    token = kept_tensor_sink.set(meter._pack)  # inputs an activation checkpoint keeps (flexorch.workers.recompute)
    try:
        with torch.autograd.graph.saved_tensors_hooks(meter._pack, lambda t: t):
            yield meter
    finally:
        kept_tensor_sink.reset(token)


def measure_activation_bytes(
    model: nn.Module,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    attn: AttnFn,
    labels: torch.Tensor | None = None,
) -> int:
    """Bytes of the distinct storages saved for backward by one forward of ``model`` (parameters and buffers
    excluded), and with ``labels`` by the head and the loss too, as a training step runs them (fused in chunks:
    ``ModelConfig.loss_chunk_tokens``). Runs the forward with gradients enabled and drops its graph afterwards."""
    with torch.enable_grad(), saved_tensor_meter([*model.parameters(), *model.buffers()]) as meter:
        out = model(input_ids, position_ids, attn) if labels is None else model(input_ids, position_ids, attn, labels)
        del out  # the graph (and every saved tensor) is freed only after counting is done
    return meter.bytes
