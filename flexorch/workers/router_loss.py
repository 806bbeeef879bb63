"""An MoE model's router load-balancing loss over the whole global batch, the same under every plan.

The loss is Transformers' ``load_balancing_loss_func`` (Switch Transformer, Fedus et al. 2021, arXiv 2101.03961,
eqs. 4-6). Over every routed row r of the batch (each token at each MoE layer: R rows), with ``p_r`` the softmax of
the router's logits (E experts) and ``c_e`` the number of the rows' top-k choices that are expert e::

    aux = E * sum_e (c_e / R) * (P_e / R),      P_e = sum_r p_{r,e}

It is not a sum over tokens: both factors are means over the whole batch. A rank running one micro-batch's shard
cannot know ``c`` and ``R`` of the step when it runs its first backward, and a loss taken per micro-batch or per
shard would change with the plan. So a step that trains it runs a forward-only pass first (:func:`router_prepass`):
every micro-batch as planned (its SP groups' collectives included), without gradients and without the LM head,
counting ``c``, ``P`` and ``R``, summed over the world in one all-reduce. ``c`` is constant (top-k has no
gradient), so::

    d aux / d theta = E / R^2 * sum_e c_e * d P_e / d theta

and ``P`` is a sum over rows: each micro-batch adds ``E / R^2 * sum_e c_e * P^mb_e`` over its own rows to its summed
loss (:meth:`RouterBalance.add`), times the coefficient and the step's predicted-token count ``N``, because the
executor divides the summed gradients by ``N`` after the all-reduce (``flexorch.workers.step_exec``). Summed over
ranks and micro-batches, the gradient is that of ``CE / N + coef * aux``: Transformers' ``loss`` with
``output_router_logits`` on the same batch. The price is one more forward without the head per step, paid only by
models whose config trains the router loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["RouterBalance", "RouterSpec", "router_prepass", "routing_sums"]


@dataclass(frozen=True)
class RouterSpec:
    """What an MoE model's router loss needs from its config (``ModelConfig``: ``num_experts``,
    ``experts_per_token``, ``router_aux_coef``)."""

    num_experts: int
    top_k: int
    coef: float


def _probs(logits, real):
    """One layer's router probabilities ``(rows, E)`` over the rows that are tokens (``real``; None: all)."""
    if real is not None:
        logits = logits[real.to(logits.device)]  # (rows, E) -> (real rows, E)
    return torch.softmax(logits, dim=-1)


def routing_sums(router_logits, spec: RouterSpec, real=None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(c (E,) float64 without gradient, P (E,) float32 with it, R)`` of one forward's router logits (one
    ``(rows, E)`` tensor per MoE layer), as Transformers' ``load_balancing_loss_func`` counts them: a softmax of each
    layer's logits, its top-k experts per row counted, its probabilities summed. ``real (rows,) bool``: the rows
    that are tokens of the batch (a shard's padding is not: Transformers' ``attention_mask`` leaves it out too)."""
    e = spec.num_experts
    counts = torch.zeros(e, dtype=torch.float64)
    probs = torch.zeros(e, dtype=torch.float32)
    rows = 0
    for logits in router_logits:
        p = _probs(logits, real)
        with torch.no_grad():
            chosen = torch.topk(p, spec.top_k, dim=-1).indices  # (rows, k)
            counts += torch.bincount(chosen.reshape(-1), minlength=e).cpu().double()
        probs = probs.to(p.device) + p.float().sum(0)  # (E,)
        rows += int(p.shape[0])
    return counts, probs, rows


def prob_sums(router_logits, spec: RouterSpec, real=None) -> torch.Tensor:
    """``P (E,)`` float32 of :func:`routing_sums`, with its gradient (what a micro-batch's term needs)."""
    sums = [_probs(logits, real).float().sum(0) for logits in router_logits]  # (E,) per layer
    return torch.stack(sums).sum(0) if sums else torch.zeros(spec.num_experts, dtype=torch.float32)


@dataclass
class RouterBalance:
    """The step's router loss: the world's ``c``, ``P`` and ``R`` from :func:`router_prepass`; the model adds each
    forward's term (:meth:`add`) and the executor adds it to the micro-batch's loss before the backward
    (:meth:`take`)."""

    spec: RouterSpec
    counts: torch.Tensor
    """(E,) float64: the world's top-k choices per expert."""
    prob_sums: torch.Tensor
    """(E,) float64: the world's summed router probabilities per expert."""
    rows: int
    predicted: int
    """The step's predicted tokens (what the executor divides the summed gradients by)."""
    real: torch.Tensor | None = None
    """The rows of the micro-batch about to run that are tokens, not padding (set by the executor)."""
    pending: torch.Tensor | None = None

    @property
    def aux_loss(self) -> float:
        """The step's load-balancing loss (Transformers' ``aux_loss``; unweighted)."""
        r = max(self.rows, 1)
        return float(self.spec.num_experts * (self.counts / r * self.prob_sums / r).sum())

    def add(self, router_logits) -> None:
        """Add the term of one forward's router logits (its own rows) to what :meth:`take` returns."""
        probs = prob_sums(router_logits, self.spec, self.real)
        r = max(self.rows, 1)
        w = self.spec.coef * self.predicted * self.spec.num_experts / r**2 * self.counts  # (E,)
        term = (probs * w.to(probs.device, probs.dtype)).sum()
        self.pending = term if self.pending is None else self.pending + term

    def take(self) -> torch.Tensor | None:
        """The summed terms since the last call (None: no forward added one), to add to the summed loss."""
        term, self.pending = self.pending, None
        return term


def router_prepass(run, works, world, world_size: int) -> RouterBalance | None:
    """The world's routing counts of the step, for a model that trains its router loss (``model.router_spec``; None:
    nothing runs, None is returned). ``run``: the step's ``MicroBatches`` (its inputs and attention per group);
    ``works``: the micro-batches this rank runs, in order (None: an idle one under FSDP, which still takes part in the
    gathers). Every rank of the world must call it, before its first micro-batch."""
    model = run.model
    spec = getattr(model, "router_spec", None)
    if spec is None:
        return None
    counts = torch.zeros(spec.num_experts, dtype=torch.float64)
    probs = torch.zeros(spec.num_experts, dtype=torch.float64)
    rows = 0
    with torch.no_grad():
        for work in works:
            ids, pos, _, attn, real = run.inputs(work)
            c, p, r = model(ids.to(run.device), pos.to(run.device), attn, routing=real)
            counts, probs, rows = counts + c, probs + p.detach().cpu().double(), rows + r
    buf = torch.cat([counts, probs, torch.tensor([float(rows)], dtype=torch.float64)])
    if world is not None and world_size > 1:
        buf = buf.to(run.device)
        dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=world)
        buf = buf.cpu()
    e = spec.num_experts
    return RouterBalance(
        spec, buf[:e], buf[e : 2 * e], int(round(float(buf[-1]))), predicted=run.rank_work.num_predicted
    )
