"""Timing probes for calibrating the cost model on the real workers (``flexorch profile``).

A probe splits the world into groups of one degree and kind; every group runs forward + backward of the model
on the same synthetic packed micro-batch (documents of the given lengths), exactly as a training step would
(same sharding, same SP attention, same kernels), while all the other groups run theirs, so the machine is as
busy as in training. Every rank reports its median time; the driver fits the profile (``solver.calibration``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from flexorch.work.step import GroupWork
from flexorch.workers.activation_memory import measure_activation_bytes
from flexorch.workers.step_exec import group_attention, micro_batch_inputs

__all__ = ["Probe", "run_probes", "activation_bytes_per_token"]


@dataclass(frozen=True)
class Probe:
    """Groups of ``degree`` ranks (aligned blocks) each run one micro-batch of documents ``lengths``."""

    degree: int
    kind: str
    lengths: tuple[int, ...]
    repeats: int = 3


def _synthetic(lengths, vocab_size: int, seed: int) -> tuple[torch.Tensor, list[int]]:
    rng = np.random.default_rng(seed)
    total = int(sum(lengths))
    tokens = torch.from_numpy(rng.integers(0, vocab_size, size=total).astype(np.int64))
    return tokens, [0, *np.cumsum(lengths).tolist()]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_probes(
    model, probes, rank: int, world_size: int, group_of, world, vocab_size: int, *, every_rank: bool = False
) -> list[float]:
    """Median ms of every probe on this rank (ranks beyond the last full group idle); grads are discarded.
    ``every_rank`` (sharded model state, whose gathers span the world): idle ranks run an empty micro-batch."""
    out = []
    device = next(model.parameters()).device  # the probes' inputs go where the model is (a GPU worker's device)
    for i, probe in enumerate(probes):
        d = probe.degree
        groups = world_size // d
        times = []
        for rep in range(probe.repeats + 1):  # the first run warms up (allocations, group creation)
            if world is not None:
                dist.barrier(group=world)
            if rank >= groups * d:
                if every_rank:
                    empty = torch.zeros(0, dtype=torch.int64, device=device)
                    model(empty, empty, lambda q, k, v: q, labels=empty).backward()
                    model.zero_grad(set_to_none=True)
                times.append(0.0)
                continue
            first = rank - rank % d
            work = GroupWork(0, tuple(range(first, first + d)), probe.kind, ())
            tokens, cu = _synthetic(probe.lengths, vocab_size, seed=i)
            _sync(device)
            t0 = time.perf_counter()
            ids, pos, labels, layout = micro_batch_inputs(tokens, cu, rank - first, d, probe.kind)
            attn = group_attention(layout, work, group_of(work.ranks) if d > 1 else None, None)
            model(ids.to(device), pos.to(device), attn, labels=labels.to(device)).backward()  # head + loss, chunked
            _sync(device)  # CUDA runs asynchronously: time the kernels, not their launch
            if rep:
                times.append((time.perf_counter() - t0) * 1e3)
            model.zero_grad(set_to_none=True)
        out.append(float(np.median(times)))
    return out


def activation_bytes_per_token(model, vocab_size: int, tokens: int = 512) -> float:
    """Bytes saved for backward per token by a training step's forward and loss (the loss keeps the fp32
    log-softmax of the logits, ~9 % of the total on the default model), measured on one device for one document
    of ``tokens`` tokens. What an SP group of degree d > 1 holds beyond this per local token (Ulysses's all-to-all
    copies) is added by the profile (``Profile.act_bytes_per_local_token``)."""
    ids, cu = _synthetic([tokens], vocab_size, seed=0)
    ids, pos, labels, layout = micro_batch_inputs(ids, cu, 0, 1, "ulysses")
    attn = group_attention(layout, GroupWork(0, (0,), "ulysses", ()), None, None)
    dev = next(model.parameters()).device
    return measure_activation_bytes(model, ids.to(dev), pos.to(dev), attn, labels.to(dev)) / tokens


def stage_activation_bytes(model, vocab_size: int, tokens: int = 512) -> tuple[float, float]:
    """(bytes per token per decoder layer, bytes per token of the LM head and loss) that pipeline stages save for
    backward, measured by running a document of ``tokens`` tokens through two real stages of ``model`` (layers
    [0, L-1) with the embedding, then the last layer with the head); the pipeline's stage memory model uses them."""
    from flexorch.solver.pipeline.chunking import Piece
    from flexorch.workers.pipeline.stage import StageModule, UnitInput

    n = model.cfg.num_layers
    if n < 2:
        raise ValueError(f"pipeline stages need a model of at least 2 layers, this one has {n}")
    ids, _ = _synthetic([tokens], vocab_size, seed=0)
    unit = UnitInput([Piece(0, 0, tokens)], [ids.long()])
    first = StageModule(model.cfg, 0, n - 1, 0, 2, model=model)
    first.forward_unit(0, unit, None, 1)
    per_layer = first.held_bytes / tokens / (n - 1)
    last = StageModule(model.cfg, n - 1, n, 1, 2, model=model)
    dev = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    last.forward_unit(0, unit, torch.zeros(tokens, model.cfg.dim, device=dev, dtype=dtype), 1)
    head = max(last.held_bytes / tokens - per_layer, 0.0)
    for s in (first, last):  # drop the graphs (nothing runs backward)
        s._units.clear()
        s.cache.clear()
    return per_layer, head
