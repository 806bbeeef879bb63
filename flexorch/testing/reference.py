"""The single-process reference that every sequence-parallel plan must reproduce (docs/design.md §1, the invariant).

One global batch of documents is packed into one sequence (``cu_seqlens``), run through the model with
single-device varlen attention, and trained with the loss ``sum of token losses / number of predicted tokens``
(every document predicts its own next tokens, never across a boundary). A distributed step that shards the
same documents over any mix of SP groups, sums the per-rank loss sums, divides by the same global count and
all-reduces the gradients must give the same loss and, up to float reordering, the same parameters.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from flexorch.config.model import ModelConfig
from flexorch.config.optim import OptimConfig
from flexorch.workers.attention.api import varlen_attn_func
from flexorch.workers.model import check_token_range, loss_sum, next_token_labels, stored_token_ids
from flexorch.workers.model_source import build_model
from flexorch.workers.optim import build_optimizer, clip_grad_norm_

__all__ = [
    "PackedBatch",
    "pack_documents",
    "reference_loss_sum",
    "reference_step",
    "reference_train",
    "reference_train_tasks",
]


@dataclass(frozen=True)
class PackedBatch:
    """Documents concatenated into one flat sequence, with what the model and the loss need."""

    tokens: torch.Tensor
    """(T,) int64 token ids, documents back to back."""
    position_ids: torch.Tensor
    """(T,) int64 position of each token inside its document."""
    cu_seqlens: torch.Tensor
    """(n_docs + 1,) int32 document boundaries."""
    max_seqlen: int
    """Longest document."""
    labels: torch.Tensor
    """(T,) int64 next token of the same document, -100 at each document's last token and where the next token is
    not a loss target."""
    n_predicted: int
    """Number of positions with a label: sum(len(doc) - 1) for plain text."""


def _as_tokens(doc: np.ndarray | torch.Tensor, i: int) -> torch.Tensor:
    t = torch.as_tensor(doc)
    if t.dim() != 1 or t.numel() == 0 or t.dtype.is_floating_point or t.dtype == torch.bool:
        raise ValueError(f"document {i} must be a non-empty 1-D integer array, got {tuple(t.shape)} {t.dtype}")
    return t.to(torch.int64)


def pack_documents(docs: Sequence[np.ndarray | torch.Tensor]) -> PackedBatch:
    """Pack documents (1-D integer arrays, each non-empty, as stored: ``flexorch.data.targets``, a token that is
    not a loss target is ``~id``) into one :class:`PackedBatch`."""
    if len(docs) == 0:
        raise ValueError("a batch needs at least one document")
    seqs = [_as_tokens(d, i) for i, d in enumerate(docs)]
    lengths = torch.tensor([s.numel() for s in seqs], dtype=torch.int64)
    cu = torch.zeros(len(seqs) + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(lengths, 0)
    stored = torch.cat(seqs)
    tokens = stored_token_ids(stored)
    labels = next_token_labels(stored, cu)
    starts = torch.repeat_interleave(cu[:-1], lengths)  # (T,) start offset of each token's document
    return PackedBatch(
        tokens=tokens,
        position_ids=torch.arange(tokens.numel(), dtype=torch.int64) - starts,
        cu_seqlens=cu.to(torch.int32),
        max_seqlen=int(lengths.max()),
        labels=labels,
        n_predicted=int((labels != -100).sum()),
    )


def reference_loss_sum(model: torch.nn.Module, batch: PackedBatch) -> torch.Tensor:
    """Summed next-token loss of the packed batch with single-device varlen attention (differentiable)."""
    attn = functools.partial(varlen_attn_func, cu_seqlens=batch.cu_seqlens, max_seqlen=batch.max_seqlen)
    logits = model(batch.tokens, batch.position_ids, attn)  # (T, vocab)
    return loss_sum(logits, batch.labels)


def reference_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    docs: Sequence[np.ndarray | torch.Tensor],
    optim_cfg: OptimConfig,
) -> float:
    """One training step on one global batch; returns its mean loss over the predicted tokens."""
    batch = pack_documents(docs)
    if batch.n_predicted == 0:
        raise ValueError(f"the batch's {len(docs)} documents have no token to predict (length 1, or no target)")
    optimizer.zero_grad(set_to_none=True)
    loss = reference_loss_sum(model, batch) / batch.n_predicted
    loss.backward()
    if optim_cfg.grad_clip is not None:
        clip_grad_norm_(model.parameters(), optim_cfg.grad_clip)
    optimizer.step()
    scheduler.step()
    return float(loss.detach())


def reference_train(
    model_cfg: ModelConfig,
    optim_cfg: OptimConfig,
    batches: Sequence[Sequence[np.ndarray | torch.Tensor]],
    seed: int,
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Train ``build_model(model_cfg, seed)`` on ``batches`` (one global batch per step); returns the losses
    and the final model state dict."""
    model = build_model(model_cfg, seed)
    optimizer, scheduler = build_optimizer(model, optim_cfg)
    losses = []
    for step, docs in enumerate(batches):
        for i, doc in enumerate(docs):
            try:
                check_token_range(stored_token_ids(_as_tokens(doc, i)), model_cfg.vocab_size)
            except ValueError as e:
                raise ValueError(f"step {step}, document {i}: {e}") from None
        losses.append(reference_step(model, optimizer, scheduler, docs, optim_cfg))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def reference_train_tasks(
    model_cfg: ModelConfig,
    optim_cfg: OptimConfig,
    batches: Sequence[Sequence[tuple[int, np.ndarray | torch.Tensor]]],
    seed: int,
    task_names: Sequence[str],
    task_weights: Sequence[float],
) -> tuple[list[float], list[dict[str, float]], dict[str, torch.Tensor]]:
    """The reference of a run of ``[[tasks]]``: each step's documents (``(task index, tokens)`` pairs) are packed
    per task and run with that task's adapter active (``flexorch.workers.lora``); the step's loss is
    ``sum_t w_t * (task t's summed loss / task t's targets)`` with the weights normalised to sum to 1, then one
    clip and one AdamW step, as a distributed step must give for any plan. Returns the step losses, each step's
    per-task mean losses and the final state dict."""
    from flexorch.workers.lora import set_active_task

    model = build_model(model_cfg, seed)
    optimizer, scheduler = build_optimizer(model, optim_cfg)
    total_w = float(sum(task_weights))
    losses: list[float] = []
    per_task: list[dict[str, float]] = []
    for docs in batches:
        optimizer.zero_grad(set_to_none=True)
        step_loss = torch.zeros((), dtype=torch.float64)
        means: dict[str, float] = {}
        for t, name in enumerate(task_names):
            mine = [d for k, d in docs if k == t]
            if not mine:
                continue
            batch = pack_documents(mine)
            set_active_task(model, name)
            summed = reference_loss_sum(model, batch)
            means[name] = float(summed.detach()) / batch.n_predicted if batch.n_predicted else 0.0
            if batch.n_predicted:
                part = summed * (float(task_weights[t]) / total_w / batch.n_predicted)
                part.backward()
                step_loss += part.detach().double()
        set_active_task(model, None)
        if optim_cfg.grad_clip is not None:
            clip_grad_norm_([p for p in model.parameters() if p.grad is not None], optim_cfg.grad_clip)
        optimizer.step()
        scheduler.step()
        losses.append(float(step_loss))
        per_task.append(means)
    return losses, per_task, {k: v.detach().clone() for k, v in model.state_dict().items()}
