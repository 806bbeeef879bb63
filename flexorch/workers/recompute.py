"""Activation checkpointing per decoder layer: recompute in the backward instead of keeping activations.

Modes (``[sharding] activation_checkpointing``): ``none``; ``full``, every decoder layer keeps only its input and
is run again in the backward (Chen et al., "Training Deep Nets with Sublinear Memory Cost", arXiv 1604.06174);
``selective``, each layer keeps attention's saved tensors and recomputes the MLP and its norm (a per-layer choice
in the spirit of Korthikanti et al., arXiv 2205.05198, Sec. 5: recompute what is cheap per byte kept; here the
SwiGLU MLP, whose three ``ffn_dim`` activations dominate a layer's memory, while attention's collectives, the
expensive part to run twice under sequence parallelism, are not repeated).

Uses ``torch.utils.checkpoint`` in its non-reentrant form *inside* the block's forward (the pattern torchtitan uses
with FSDP2: the block is the FSDP unit, so its all-gather hooks fire once and the recompute runs on the parameters
the pre-backward hook gathered). The activation meter (``flexorch.workers.activation_memory``) cannot see the
inputs a checkpoint keeps alive (they are held by the recompute, not saved for backward), so the checkpoint reports
them with :func:`note_kept`: the measured bytes are what the mode really keeps.
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar

import torch
from torch.utils.checkpoint import checkpoint

__all__ = ["MODES", "built_mode", "checkpointed", "kept_tensor_sink", "note_kept"]

MODES = ("none", "full", "selective")


def built_mode(sharding: dict) -> str:
    """The mode a worker's model is built in for its ``sharding`` (``recompute``: ``[sharding]
    activation_checkpointing``; ``stages``: ``[pipeline] stages``): 'auto' builds it 'full' (the mode the planner
    packs micro-batches for) and each micro-batch's task says whether it runs 'none' instead; with pipeline stages
    'none' whatever the setting (a stage checkpoints the layers its plan says, ``flexorch.workers.pipeline.stage``)."""
    if sharding.get("stages", 1) != 1:
        return "none"
    return "full" if sharding["recompute"] == "auto" else sharding["recompute"]


kept_tensor_sink: ContextVar[Callable[[torch.Tensor], None] | None] = ContextVar("kept_tensor_sink", default=None)
"""Where :func:`note_kept` reports tensors (set by an active activation meter; None: nobody is measuring)."""


@torch.compiler.disable
def note_kept(*tensors: torch.Tensor) -> None:
    """Report tensors a checkpoint keeps alive until the backward to the active meter, if any (run eagerly: a
    compiled layer cannot trace the context variable)."""
    sink = kept_tensor_sink.get()
    if sink is not None:
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                sink(t)


def checkpointed(fn: Callable, *args):
    """``fn(*args)`` whose activations are recomputed in the backward; only ``args`` are kept."""
    if torch.is_grad_enabled():
        note_kept(*args)
        return checkpoint(fn, *args, use_reentrant=False)
    return fn(*args)
