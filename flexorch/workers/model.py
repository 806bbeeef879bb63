"""A LLaMA-style decoder whose attention call is the only sequence-parallel-aware point.

The model sees a flat packed batch (no batch dimension): ``input_ids (t,)`` and ``position_ids (t,)``, where a
position is the index of the token inside *its own document* (global, not local to a shard), so RoPE gives
every token the same rotation whatever the sharding. Attention is a callable ``attn(q, k, v) -> out`` bound by
the caller to the documents' ``cu_seqlens`` (and, for sequence parallelism, the group and method), e.g.
``functools.partial(ulysses_attn_varlen_func, cu_seqlens=layout.cu_seqlens, max_seqlen=layout.max_seqlen,
group=group)``. Everything else acts token by token, so a sharded forward equals the single-device one.

Pieces: RMSNorm (Zhang & Sennrich, arXiv 1910.07467), rotary position embedding (Su et al., arXiv 2104.09864),
grouped-query attention (Ainslie et al., arXiv 2305.13245), SwiGLU MLP (Shazeer, arXiv 2002.05202). Parameter
names follow Meta's LLaMA / torchtitan (``tok_embeddings``, ``layers.i.attention.wq``, ``feed_forward.w1``...).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from flexorch.config.model import ModelConfig
from flexorch.workers.attention.sharding import check_cu_seqlens
from flexorch.workers.chunked_loss import IGNORE_INDEX, LMHead, head_loss_sum
from flexorch.workers.lora import add_adapters, apply_base_trainable, with_adapter_values
from flexorch.workers.recompute import MODES as RECOMPUTE_MODES
from flexorch.workers.recompute import checkpointed

__all__ = [
    "IGNORE_INDEX",
    "AttnFn",
    "Decoder",
    "call_attention",
    "check_token_range",
    "init_model",
    "initial_parameters",
    "loss_sum",
    "next_token_labels",
    "stored_token_ids",
    "set_activation_checkpointing",
]

"""Label of positions that predict nothing (last token of a document, padding)."""

AttnFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``attn(q (t, h, hd), k (t, h_kv, hd), v (t, h_kv, hd)) -> (t, h, hd)``, causal within each document."""


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, in float32 (Zhang & Sennrich, arXiv 1910.07467, Sec. 4)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rope_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``(t, head_dim/2)`` float32 of the angles ``pos * theta^(-2i/head_dim)`` (RoPE, 2104.09864 Sec. 3.2).

    Angles are formed in float64: at position 1e6 a float32 angle would be off by ~0.06 rad.
    """
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64, device=position_ids.device) / head_dim)
    angles = position_ids.to(torch.float64)[:, None] * inv_freq[None, :]  # (t, 1) x (1, hd/2) -> (t, hd/2)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x (t, h, hd)`` pairwise by the angles of its token (rotate-half pairing (i, i + hd/2), GPT-NeoX)."""
    x1, x2 = x.float().chunk(2, dim=-1)  # (t, h, hd) -> 2 x (t, h, hd/2)
    c, s = cos[:, None, :], sin[:, None, :]  # (t, hd/2) -> (t, 1, hd/2), broadcast over heads
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)  # -> (t, h, hd)


@torch.compiler.disable
def call_attention(attn: AttnFn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs) -> torch.Tensor:
    """``attn(q, k, v, **kwargs)`` outside any compiled graph: the one place ``torch.compile`` of a decoder layer
    breaks its graph (regional compile, as TorchTitan compiles each block). The varlen kernels read the documents'
    host offsets and sequence-parallel attention runs collectives, neither of which belongs in a traced graph; the
    code before and after (norms, projections, RoPE, the MLP) compiles and fuses."""
    return attn(q, k, v, **kwargs)


class Attention(nn.Module):
    """q/k/v/o projections without bias, GQA (2305.13245), RoPE on q and k; the kernel is the ``attn`` argument."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.h, self.h_kv, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, self.h * self.hd, bias=False)
        self.wk = nn.Linear(cfg.dim, self.h_kv * self.hd, bias=False)
        self.wv = nn.Linear(cfg.dim, self.h_kv * self.hd, bias=False)
        self.wo = nn.Linear(self.h * self.hd, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttnFn) -> torch.Tensor:
        t = x.shape[0]
        q = self.wq(x).view(t, self.h, self.hd)  # (t, dim) -> (t, h * hd) -> (t, h, hd)
        k = self.wk(x).view(t, self.h_kv, self.hd)  # (t, dim) -> (t, h_kv * hd) -> (t, h_kv, hd)
        v = self.wv(x).view(t, self.h_kv, self.hd)
        out = call_attention(attn, apply_rope(q, cos, sin), apply_rope(k, cos, sin), v)
        if not isinstance(out, torch.Tensor) or out.shape != q.shape:
            got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise ValueError(f"attn must return a (t, h, hd) = {tuple(q.shape)} tensor, got {got}")
        return self.wo(out.reshape(t, self.h * self.hd))  # (t, h, hd) -> (t, h * hd) -> (t, dim)


class FeedForward(nn.Module):
    """SwiGLU MLP: w2(silu(w1 x) * w3 x) (Shazeer, arXiv 2002.05202, Sec. 2)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x)).

    ``recompute`` (``flexorch.workers.recompute``): 'full' runs the block again in the backward, 'selective' its
    MLP half only; set it with :func:`set_activation_checkpointing`."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)
        self.recompute = "none"

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttnFn) -> torch.Tensor:
        if self.recompute == "full":
            return checkpointed(functools.partial(self._forward, attn=attn), x, cos, sin)
        return self._forward(x, cos, sin, attn)

    def _forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttnFn) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin, attn)
        if self.recompute == "selective":
            return x + checkpointed(self._mlp, x)
        return x + self._mlp(x)

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.feed_forward(self.ffn_norm(x))


def set_activation_checkpointing(model: nn.Module, mode: str) -> None:
    """Set every decoder block's recompute mode: 'none', 'full' or 'selective' (``flexorch.workers.recompute``)."""
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"activation checkpointing must be one of {RECOMPUTE_MODES}, got {mode!r}")
    for m in model.modules():
        if isinstance(m, Block):
            m.recompute = mode


class Decoder(nn.Module):
    """Token embedding, ``num_layers`` blocks, final RMSNorm, LM head. Build it with :func:`init_model`.

    ``cfg.adapters``: each block also holds the tasks' LoRA adapters (``flexorch.workers.lora``: a ``lora``
    submodule after the block's own, a hook on each target linear map); ``cfg.base_trainable`` false: only they
    require gradients."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = None if cfg.tie_embeddings else LMHead(cfg.dim, cfg.vocab_size)
        if cfg.adapters:
            add_adapters(self, cfg.adapters)
        apply_base_trainable(self, cfg.base_trainable)

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, attn: AttnFn, labels: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``input_ids (t,)``, ``position_ids (t,)`` int64 (position inside each token's document) ->
        logits ``(t, vocab_size)`` float32; with ``labels (t,)``, the loss summed over them instead (float32 scalar,
        the head fused with the loss in chunks of ``cfg.loss_chunk_tokens``: no whole logits held). ``attn`` is the
        only call that sees other tokens."""
        if input_ids.dim() != 1 or position_ids.shape != input_ids.shape:
            raise ValueError(
                f"input_ids and position_ids must both be (t,), got {tuple(input_ids.shape)} and "
                f"{tuple(position_ids.shape)}"
            )
        check_token_range(input_ids, self.cfg.vocab_size)
        cos, sin = rope_cos_sin(position_ids, self.cfg.head_dim, self.cfg.rope_theta)  # (t, hd/2) each
        x = self.tok_embeddings(input_ids)  # (t,) -> (t, dim)
        for layer in self.layers:
            x = layer(x, cos, sin, attn)
        x = self.norm(x)
        weight = self.tok_embeddings.weight if self.output is None else self.output.weight
        if labels is not None:
            return head_loss_sum(x, weight, labels, self.cfg.loss_chunk_tokens)
        return F.linear(x, weight).float()  # (t, dim) x (vocab, dim)^T -> (t, vocab)


def _is_residual_output(name: str) -> bool:
    return name.endswith(("attention.wo.weight", "feed_forward.w2.weight"))


def init_model(cfg: ModelConfig, seed: int, *, device: torch.device | str | None = None) -> Decoder:
    """A decoder with deterministic parameters: the same ``(cfg, seed)`` gives bitwise-equal weights anywhere.

    Weight matrices ~ N(0, init_std) drawn from ``torch.Generator().manual_seed(seed)`` on the CPU in parameter
    order (never the global RNG); the outputs of residual branches (``wo``, ``w2``) are scaled by
    ``1/sqrt(2 * num_layers)`` (GPT-2, Radford et al. 2019, Sec. 2.3: residual-layer weights scaled by
    1/sqrt(N) for N residual layers); norm weights are ones.
    """
    with torch.device("meta"):
        model = Decoder(cfg)
    model = model.to_empty(device=device or "cpu")
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in initial_parameters(cfg, seed, [(n, p.shape) for n, p in params.items()]):
            params[name].copy_(value)
    return model


def initial_parameters(cfg: ModelConfig, seed: int, shapes):
    """Yield ``(name, float32 CPU tensor)`` of each parameter's initial value, one at a time, in the order of
    ``shapes`` (``(name, shape)`` in ``named_parameters`` order): what :func:`init_model` copies in. A sharded
    worker keeps its rows of each and drops the rest, so no process ever holds the whole initial model, and the
    values are the same whatever the sharding. Adapter parameters (``cfg.adapters``) come from generators of their
    own (``flexorch.workers.lora.initial_adapter_value``): the base values are those of the model without them."""
    return with_adapter_values(functools.partial(_base_initial, cfg, seed), shapes, seed, cfg.adapters)


def _base_initial(cfg: ModelConfig, seed: int, shapes):
    gen = torch.Generator().manual_seed(seed)
    residual_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
    for name, shape in shapes:
        if len(shape) == 1:  # RMSNorm weights
            yield name, torch.ones(shape, dtype=torch.float32)
            continue
        std = residual_std if _is_residual_output(name) else cfg.init_std
        yield name, torch.empty(shape, dtype=torch.float32).normal_(0.0, std, generator=gen)


def stored_token_ids(tokens: torch.Tensor) -> torch.Tensor:
    """The token ids of documents as the corpus stores them (``flexorch.data.targets``: a token that carries no
    loss is stored as ``~id``, negative): ``~x`` where ``x < 0``; plain ids come back unchanged."""
    return torch.where(tokens < 0, ~tokens, tokens)


def next_token_labels(tokens: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Labels ``(T,)``: token i+1 of the same document, ``IGNORE_INDEX`` at the last token of every document and
    where token i+1 is not a loss target. ``tokens`` as stored (``flexorch.data.targets``: a token that is not a
    target is ``~id``, negative); plain ids (all >= 0) make every next token a target."""
    offsets = check_cu_seqlens(cu_seqlens, tokens.shape[0])
    labels = torch.roll(tokens, shifts=-1, dims=0).to(torch.int64)
    labels[labels < 0] = IGNORE_INDEX  # the next token is context only (a prompt, a masked turn)
    last = torch.tensor(offsets[1:], dtype=torch.int64, device=tokens.device) - 1
    labels[last] = IGNORE_INDEX  # documents never predict across a boundary
    return labels


def loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy summed (not averaged) over positions whose label is not ``IGNORE_INDEX``; float32 scalar.

    The trainer divides by the step's *global* number of predicted tokens, so every token weighs the same
    whatever the packing or sharding. A shard with nothing to predict gives 0 (and zero gradients).
    """
    return F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")


def check_token_range(tokens: torch.Tensor, vocab_size: int) -> None:
    """Raise ValueError naming the first id outside [0, vocab_size), its position and the vocab size."""
    if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
        raise ValueError(f"token ids must be an integer tensor, got {tokens.dtype}")
    bad = (tokens < 0) | (tokens >= vocab_size)
    if tokens.numel() and bool(bad.any()):
        pos = int(bad.flatten().nonzero()[0, 0])
        tid = int(tokens.flatten()[pos])
        raise ValueError(
            f"token id {tid} at position {pos} is outside the vocabulary [0, {vocab_size}) "
            f"({int(bad.sum())} of {tokens.numel()} ids out of range)"
        )
