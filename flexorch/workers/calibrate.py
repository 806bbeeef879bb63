"""Timing probes for calibrating the cost model on the real workers (``flexorch profile``).

A probe splits the world into groups of one degree and kind; every group runs forward + backward of the model
on the same synthetic packed micro-batch (documents of the given lengths), exactly as a training step would
(same sharding, same SP attention, same kernels), while all the other groups run theirs, so the machine is as
busy as in training. Every rank reports its median time; the driver fits the profile (``solver.calibration``).

Where the groups lie: by default aligned blocks of ``degree`` ranks filling the world (one node). On several nodes
(ranks contiguous per node, ``solver.topology``) the driver lays them out itself (:func:`group_starts`): ``"intra"``
packs blocks inside each node, ``"inter"`` puts one block across each node boundary, so that the fit can tell a
group inside a node from one across nodes. Every group is a block of consecutive ranks (``GroupWork``); ranks in no
group idle.
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

__all__ = [
    "Probe",
    "PLACEMENTS",
    "group_starts",
    "probe_groups",
    "run_probes",
    "activation_bytes_per_token",
    "with_recompute_transient",
]

PLACEMENTS = ("", "intra", "inter")
"""Where a probe's groups lie: '' (aligned blocks, one node), 'intra' (each inside one node), 'inter' (each across
node boundaries)."""


@dataclass(frozen=True)
class Probe:
    """Groups of ``degree`` consecutive ranks each run one micro-batch of documents ``lengths``."""

    degree: int
    """SP degree of every group (1: every rank alone)."""
    kind: str
    """'ulysses' or 'ring'."""
    lengths: tuple[int, ...]
    """Token counts of the documents of the micro-batch every group runs."""
    repeats: int = 3
    """Timed runs (after one warm-up run); each rank reports their median."""
    starts: tuple[int, ...] | None = None
    """First rank of each group (ascending, blocks not overlapping); None: aligned blocks ``0, d, 2d, ...`` that
    fill the world (ranks past the last whole block idle)."""
    placement: str = ""
    """Where the groups lie (:data:`PLACEMENTS`); 'inter' groups' samples are fitted into the across-node tables."""

    def __post_init__(self) -> None:
        if self.placement not in PLACEMENTS:
            raise ValueError(f"Probe placement must be one of {PLACEMENTS}, got {self.placement!r}")
        if self.starts is not None:
            starts = tuple(int(s) for s in self.starts)
            object.__setattr__(self, "starts", starts)
            gaps = [b - a for a, b in zip(starts, starts[1:], strict=False)]
            if not starts or starts[0] < 0 or any(g < self.degree for g in gaps):
                raise ValueError(
                    f"Probe starts {list(starts)} must be non-empty, >= 0 and ascending by at least the degree "
                    f"{self.degree} (blocks that do not overlap)"
                )


def group_starts(degree: int, node_sizes, placement: str) -> tuple[int, ...]:
    """First ranks of the groups of ``degree`` consecutive ranks a probe lays on nodes of ``node_sizes`` (workers
    per node in rank order, ranks contiguous per node).

    'intra': ``size // degree`` blocks packed from the start of each node (none on a node smaller than the degree).
    'inter': one block across each node boundary, half on either side where the nodes allow (a balanced split moves
    the most bytes across the boundary), the block spanning exactly the two nodes and not overlapping the one before;
    a boundary no such block fits (a node too small) has none. A degree no two adjacent nodes hold: aligned blocks
    of the world (each across several nodes). Empty when nothing fits."""
    sizes = [int(s) for s in node_sizes]
    d = int(degree)
    node_starts = [sum(sizes[:i]) for i in range(len(sizes))]
    if placement == "intra":
        return tuple(first + k * d for first, size in zip(node_starts, sizes, strict=True) for k in range(size // d))
    if placement != "inter":
        raise ValueError(f"group_starts: placement must be 'intra' or 'inter', got {placement!r}")
    if len(sizes) < 2 or d < 2:
        return ()
    if all(a + b < d for a, b in zip(sizes, sizes[1:], strict=False)):
        return tuple(range(0, sum(sizes) - d + 1, d))
    out: list[int] = []
    for i in range(1, len(sizes)):
        boundary = node_starts[i]
        lo = max(node_starts[i - 1], boundary - d + 1, out[-1] + d if out else 0)
        hi = min(boundary - 1, boundary + sizes[i] - d)
        if lo <= hi:
            out.append(min(max(boundary - d // 2, lo), hi))
    return tuple(out)


def probe_groups(probe: Probe, world_size: int) -> list[tuple[int, ...]]:
    """The rank blocks of ``probe``'s groups in a world of ``world_size`` (every rank builds the same list)."""
    d = probe.degree
    starts = range(0, world_size - world_size % d, d) if probe.starts is None else probe.starts
    groups = [tuple(range(f, f + d)) for f in starts]
    if groups and groups[-1][-1] >= world_size:
        raise ValueError(f"probe groups {groups} do not fit a world of {world_size} ranks")
    return groups


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
    """Median ms of every probe on this rank (0 for a rank in none of its groups, :func:`probe_groups`, which
    idles); grads are discarded. ``every_rank`` (sharded model state, whose gathers span the world): idle ranks run
    an empty micro-batch."""
    out = []
    device = next(model.parameters()).device  # the probes' inputs go where the model is (a GPU worker's device)
    for i, probe in enumerate(probes):
        d = probe.degree
        mine = next((g for g in probe_groups(probe, world_size) if rank in g), None)
        times = []
        for rep in range(probe.repeats + 1):  # the first run warms up (allocations, group creation)
            if world is not None:
                dist.barrier(group=world)
            if mine is None:
                if every_rank:
                    empty = torch.zeros(0, dtype=torch.int64, device=device)
                    _routing_count(model, empty, empty, None, torch.zeros(0, dtype=torch.bool))
                    model(empty, empty, lambda q, k, v: q, labels=empty).backward()
                    model.zero_grad(set_to_none=True)
                times.append(0.0)
                continue
            first = mine[0]
            work = GroupWork(0, mine, probe.kind, ())
            tokens, cu = _synthetic(probe.lengths, vocab_size, seed=i)
            _sync(device)
            t0 = time.perf_counter()
            ids, pos, labels, layout = micro_batch_inputs(tokens, cu, rank - first, d, probe.kind)
            attn = group_attention(layout, work, group_of(work.ranks) if d > 1 else None, None)
            _routing_count(model, ids.to(device), pos.to(device), attn, layout.loss_mask)
            model(ids.to(device), pos.to(device), attn, labels=labels.to(device)).backward()  # head + loss, chunked
            _sync(device)  # CUDA runs asynchronously: time the kernels, not their launch
            if rep:
                times.append((time.perf_counter() - t0) * 1e3)
            model.zero_grad(set_to_none=True)
        out.append(float(np.median(times)))
    return out


def _routing_count(model, ids, pos, attn, real) -> None:
    """An MoE model that trains its router loss counts the step's routing in a forward of its own before each
    micro-batch (``flexorch.workers.router_loss``): a probe runs it too, so the fitted compute terms include it."""
    if getattr(model, "router_spec", None) is not None:
        with torch.no_grad():
            model(ids, pos, attn, routing=real)


def activation_bytes_per_token(model, vocab_size: int, tokens: int = 512) -> float:
    """Bytes saved for backward per token by a training step's forward and loss (the loss keeps the fp32
    log-softmax of the logits), measured on one device for one document
    of ``tokens`` tokens. What an SP group of degree d > 1 holds beyond this per local token (Ulysses's all-to-all
    copies) is added by the profile (``Profile.act_bytes_per_local_token``)."""
    ids, cu = _synthetic([tokens], vocab_size, seed=0)
    ids, pos, labels, layout = micro_batch_inputs(ids, cu, 0, 1, "ulysses")
    attn = group_attention(layout, GroupWork(0, (0,), "ulysses", ()), None, None)
    dev = next(model.parameters()).device
    return measure_activation_bytes(model, ids.to(dev), pos.to(dev), attn, labels.to(dev)) / tokens


def with_recompute_transient(kept: float, none: float, model) -> float:
    """Bytes per token at a recomputing step's peak: what the forward kept (``kept``, 'full' or 'selective'), plus
    what the backward re-creates while it recomputes one layer (or one layer's MLP) before that layer's gradients
    free it: ``(none - kept) / layers``, ``none`` the bytes kept without recompute. The meter sees what a forward
    keeps, not the backward's peak; priced on ``kept`` alone, 'full' would look about 18x cheaper than 'none' for a
    1.1B Llama (``flexorch.workers.activation_count``), not the 10x its peak is."""
    layers = len(model.layers) if hasattr(model, "layers") else 1
    return kept + max(0.0, none - kept) / max(1, layers)


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
