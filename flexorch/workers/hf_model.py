"""Hugging Face causal LMs (``flexorch.config.hf.HF_FAMILIES``: Llama, Mistral, Qwen2, Qwen3, Phi-3, OLMo 2, Gemma 3,
and the mixture-of-experts Qwen3-MoE, Mixtral, OLMoE and GPT-OSS) trained with flexorch's sequence-parallel attention.

Transformers' modeling code runs as shipped; the one thing replaced is the attention kernel, through its
``AttentionInterface`` (the way DeepSpeed ALST and verl put Ulysses SP into Hugging Face models): the model is built
with ``attn_implementation="flexorch"``, and :func:`flexorch_attention` receives each layer's q/k/v as
``(1, heads, tokens, head_dim)`` after the model's own projections and rotary embedding, and calls the attention
callable the step bound to this micro-batch (single device, Ulysses or zigzag ring over its SP group, causal within
each packed document, within the layer's sliding window where the model gives one:
``flexorch.workers.step_exec.group_attention``). That callable travels as the keyword
``flexorch_attn`` of the model's forward, which Transformers passes through every decoder layer to the attention
function. The model is fed ``position_ids`` holding each token's position in its *own document* (global, not local
to a shard), so the model's rotary embedding rotates every token the same whatever the plan.

:class:`HFDecoder` gives the model flexorch's decoder interface, ``forward(input_ids (t,), position_ids (t,), attn)
-> logits (t, vocab)``, and keeps Transformers' parameter names (``model.layers.0.self_attn.q_proj.weight``...), so
its state dict is the checkpoint's.

Initial values come from the directory's safetensors weights (:func:`hf_weights`: one tensor at a time, and a
sharded worker reads only its rows), or, with no weights, from Transformers' initialisation scheme
(:func:`hf_random_init`: normal(0, initializer_range) weight matrices, expert weights, embeddings and GPT-OSS's
sinks, zero biases, norms at 1, at 0 for Gemma's ``1 + w`` norms) drawn in parameter order from a seeded
generator, so every worker and every world size gets the same values.
Transformers is imported only here, and only when a run uses an HF model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flexorch.config.model import ModelConfig
from flexorch.workers.chunked_loss import head_loss_sum
from flexorch.workers.lora import (
    add_adapters,
    apply_base_trainable,
    initial_adapter_param,
    is_adapter_param,
    with_adapter_values,
)
from flexorch.workers.model import call_attention, check_token_range, loss_sum
from flexorch.workers.router_loss import RouterBalance, RouterSpec, routing_sums

__all__ = ["ATTN_IMPLEMENTATION", "HFDecoder", "flexorch_attention", "hf_random_init", "hf_weights", "meta_hf_decoder"]

ATTN_IMPLEMENTATION = "flexorch"
"""The name flexorch's attention is registered under in Transformers' ``AttentionInterface``."""

_registered = False


def transformers_module():
    """``import transformers``, or an ImportError that says how to install it."""
    try:
        import transformers
    except ImportError:
        raise ImportError(
            "[model] hf needs the transformers package: pip install 'flexorch[hf]' (or pip install transformers)"
        ) from None
    return transformers


def flexorch_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Transformers' attention-function signature around flexorch's varlen SP attention: ``query (1, h, t, hd)``,
    ``key``/``value (1, h_kv, t, hd)`` -> ``(1, t, h, hd)``, no attention weights. The packed documents' boundaries
    and the SP group come with ``kwargs["flexorch_attn"]``; ``attention_mask`` is ignored (documents are separated by
    ``cu_seqlens``, and Transformers builds no mask for this implementation). A layer with a sliding window (Mistral,
    Gemma 3's local layers, Qwen's ``use_sliding_window``) passes it as ``sliding_window``: a query attends to that
    many latest keys of its document, itself included (Transformers' ``sliding_window_overlay``), and the kernel is
    given it as ``window``. GPT-OSS passes its attention sinks as ``s_aux`` (one logit per head): given as
    ``sinks`` (``flexorch.workers.attention.kernels.with_sinks``)."""
    attn = kwargs.get("flexorch_attn")
    if attn is None:
        raise RuntimeError(
            "a model built with attn_implementation='flexorch' ran without flexorch's attention: call it through "
            "HFDecoder.forward (input_ids, position_ids, attn)"
        )
    if dropout:
        raise ValueError(f"flexorch attention has no dropout, got dropout={dropout}")
    if kwargs.get("softcap") is not None:
        raise ValueError(f"flexorch attention computes no logit soft-capping, got softcap={kwargs['softcap']}")
    if query.shape[0] != 1:
        raise ValueError(f"flexorch attention takes one packed sequence (batch 1), got batch {query.shape[0]}")
    q = query[0].transpose(0, 1)  # (1, h, t, hd) -> (t, h, hd)
    k = key[0].transpose(0, 1)  # (1, h_kv, t, hd) -> (t, h_kv, hd)
    v = value[0].transpose(0, 1)
    default = q.shape[-1] ** -0.5
    kw = {} if scaling is None or scaling == default else {"softmax_scale": scaling}
    if kwargs.get("sliding_window") is not None:
        kw["window"] = int(kwargs["sliding_window"])
    if kwargs.get("s_aux") is not None:  # GPT-OSS's sinks: a learned logit per head in every row's softmax
        kw["sinks"] = kwargs["s_aux"]
    out = call_attention(attn, q, k, v, **kw)  # the compiled layer's graph breaks here (regional compile)
    return out.unsqueeze(0), None  # (t, h, hd) -> (1, t, h, hd)


def _self_only(q, k, v, **kwargs):
    """Attention of a lone token to itself, computed as attention (``q (1, h, hd)``, ``k``/``v (1, h_kv, hd)`` ->
    ``(1, h, hd)``): a softmax over one key is 1, so the output is ``v`` and q and k get (zero) gradients too."""
    rep = q.shape[1] // k.shape[1]  # GQA: each kv head serves h / h_kv query heads
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)  # (1, h_kv, hd) -> (1, h, hd)
    weight = torch.softmax((q * k).sum(-1, keepdim=True) * q.shape[-1] ** -0.5, dim=-1)  # (1, h, 1): ones
    return weight * v


def register_attention() -> None:
    """Register :func:`flexorch_attention` as ``attn_implementation="flexorch"`` (idempotent)."""
    global _registered
    if not _registered:
        transformers_module().AttentionInterface.register(ATTN_IMPLEMENTATION, flexorch_attention)
        _registered = True


class HFDecoder(nn.Module):
    """A Transformers ``...ForCausalLM``'s decoder (``model``) and LM head (``lm_head``) behind flexorch's decoder
    interface; parameter names are the checkpoint's. ``layers`` are the decoder layers (the FSDP units)."""

    def __init__(self, lm: nn.Module, cfg: ModelConfig) -> None:
        super().__init__()
        self.model = lm.model
        # tied embeddings: the head is the embedding matrix itself (one parameter, which to_empty and FSDP keep one)
        self.lm_head = None if cfg.tie_embeddings else lm.lm_head
        self.cfg = cfg
        self.hf_config = lm.config
        # an MoE model whose config trains the router loss (flexorch.workers.router_loss): the step arms
        # router_balance with the world's routing counts, and each forward with labels adds its term
        self.router_spec = (
            RouterSpec(cfg.num_experts, cfg.experts_per_token, cfg.router_aux_coef) if cfg.router_aux_coef else None
        )
        self.router_balance: RouterBalance | None = None

    @property
    def layers(self) -> nn.ModuleList:
        return self.model.layers

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attn,
        labels: torch.Tensor | None = None,
        routing: torch.Tensor | None = None,
    ):
        """``input_ids (t,)``, ``position_ids (t,)`` (position inside each token's document) -> logits
        ``(t, vocab_size)`` float32, or with ``labels (t,)`` the loss summed over them (float32 scalar; the head fused
        with the loss in chunks, ``flexorch.workers.chunked_loss``); ``attn`` (q, k, v (t, heads, hd)) is the only
        call that sees other tokens. An armed ``router_balance`` gets each forward's router logits (their term of
        the router loss, taken by the step). ``routing (t,) bool`` (the tokens that are not padding): an MoE model's
        routing sums of those tokens instead, no head (``flexorch.workers.router_loss.routing_sums``; the step's
        forward-only count, through this forward so that FSDP gathers as in any other)."""
        if routing is not None:
            return self._routing_sums(input_ids, position_ids, attn, routing)
        if input_ids.dim() != 1 or position_ids.shape != input_ids.shape:
            raise ValueError(
                f"input_ids and position_ids must both be (t,), got {tuple(input_ids.shape)} and "
                f"{tuple(position_ids.shape)}"
            )
        check_token_range(input_ids, self.cfg.vocab_size)
        if input_ids.numel() == 0:  # an idle rank's empty micro-batch (FSDP): Transformers cannot run 0 tokens
            logits = self._empty_logits(input_ids.device)
            return logits if labels is None else loss_sum(logits, labels)
        balance = self.router_balance if labels is not None else None
        extra = {"output_router_logits": True} if balance is not None else {}
        out = self.model(
            input_ids=input_ids[None], position_ids=position_ids[None], use_cache=False, flexorch_attn=attn, **extra
        )  # (t,) -> (1, t) in, (1, t, dim) out
        if balance is not None:
            balance.add(out.router_logits)  # one (t, experts) tensor per MoE layer
        if labels is not None:
            return head_loss_sum(out.last_hidden_state[0], self._head_weight(), labels, self.cfg.loss_chunk_tokens)
        return self._head(out.last_hidden_state[0])

    def _routing_sums(self, input_ids, position_ids, attn, real):
        if self.router_spec is None:
            raise RuntimeError(f"{self.cfg.family}: the model trains no router loss (no router_aux_coef)")
        if input_ids.numel() == 0:  # an idle rank under FSDP: every unit still gathers; it counts nothing
            self._empty_logits(input_ids.device)
            return routing_sums((), self.router_spec)
        out = self.model(
            input_ids=input_ids[None], position_ids=position_ids[None], use_cache=False, flexorch_attn=attn,
            output_router_logits=True,
        )  # fmt: skip
        return routing_sums(out.router_logits, self.router_spec, real)

    def _head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        """``(t, dim)`` -> logits ``(t, vocab)`` float32."""
        return F.linear(h, self._head_weight()).float()

    def _empty_logits(self, device) -> torch.Tensor:
        """``(0, vocab)`` logits still tied to every parameter: one dummy token runs through every layer (attending
        to itself only) and is sliced away, so the backward reaches each FSDP unit (zero gradients) and the rank
        takes part in every gather and reduce-scatter as ranks with tokens do."""
        one = torch.zeros(1, dtype=torch.int64, device=device)
        out = self.model(input_ids=one[None], position_ids=one[None], use_cache=False, flexorch_attn=_self_only)
        # (1, vocab) -> (0, vocab), a copy: FSDP2 warns on a view from a wrapped module (an in-place op on it would
        # drop the pre-backward hook), and every worker did after each world change that left a rank idle
        return self._head(out.last_hidden_state[0])[:0].clone()

    def to_empty(self, *, device, recurse: bool = True) -> HFDecoder:
        """``nn.Module.to_empty``, then the buffers computed from the config, not parameters, so left as
        uninitialised memory by ``to_empty``, set again on ``device``: the rotary embedding's frequencies (each layer
        kind's, with the config's RoPE scaling) and Gemma's embedding scale (``sqrt(hidden)``). Any other buffer is
        an error, not a silent garbage value."""
        super().to_empty(device=device, recurse=recurse)
        rotary = self.model.rotary_emb
        with torch.device("cpu"):
            fresh = type(rotary)(config=self.hf_config)
        for name, buf in fresh.named_buffers():
            rotary.get_buffer(name).copy_(buf)
        done = {f"model.rotary_emb.{n}" for n, _ in fresh.named_buffers()}
        embed = self.model.embed_tokens
        if hasattr(embed, "embed_scale"):  # Gemma3TextScaledWordEmbedding: the embedding times sqrt(hidden)
            embed.embed_scale.fill_(getattr(embed, "scalar_embed_scale", self.hf_config.hidden_size**0.5))
            done.add("model.embed_tokens.embed_scale")
        left = [n for n, _ in self.named_buffers() if n not in done]
        if left:
            raise RuntimeError(f"{self.cfg.family}: buffers {left} are not rebuilt after to_empty")
        return self

    def set_recompute(self, mode: str) -> None:
        """'none'; 'full': Transformers' own gradient checkpointing of each decoder layer (non-reentrant);
        'selective': each decoder layer's MLP (``layer.mlp``) recomputed in the backward, the rest of the layer kept
        (:func:`_selective_mlps`), as flexorch's decoder recomputes its MLP half: the MLP's intermediate activations
        (``intermediate_size`` wide, gated: most of a layer's bytes per token) are dropped, attention's collectives
        are not run again.

        Transformers 5.24 named it ``activation_checkpointing_enable`` (``gradient_checkpointing_enable`` stays as a
        deprecated alias until v6); 5.17 has only the older name, so the name present is used."""
        if mode == getattr(self, "_recompute", None):  # "auto" recompute sets it per micro-batch: only changes act
            return
        if mode not in ("none", "full", "selective"):
            raise ValueError(
                f"activation checkpointing of a Hugging Face model is 'none', 'full' or 'selective', got {mode!r}"
            )
        m = self.model
        if mode == "full":
            if hasattr(m, "activation_checkpointing_enable"):
                m.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        elif getattr(self, "_recompute", "none") == "full":
            (getattr(m, "activation_checkpointing_disable", None) or m.gradient_checkpointing_disable)()
        for mlp in _selective_mlps(self.layers):
            mlp.flexorch_recompute = mode == "selective"
        self._recompute = mode


def _selective_mlps(layers) -> list[nn.Module]:
    """Each decoder layer's MLP (``layer.mlp``: every family of ``HF_FAMILIES``), its forward
    wrapped once so that with ``flexorch_recompute`` set it runs under :func:`flexorch.workers.recompute.checkpointed`
    (only its input is kept; its activations are recomputed in the backward). The wrapper is an instance attribute:
    parameter names, state dicts and FSDP units are unchanged. It calls ``flexorch_plain_forward``, the MLP's own
    forward, which a compiled layer compiles too: the checkpoint is a graph break in the compiled layer, and the MLP
    under it would otherwise run eagerly."""
    from flexorch.workers.recompute import checkpointed

    out = []
    for i, layer in enumerate(layers):
        mlp = getattr(layer, "mlp", None)
        if not isinstance(mlp, nn.Module):
            raise ValueError(
                f"selective recompute needs each decoder layer's MLP as `layer.mlp`; layer {i} "
                f"({type(layer).__name__}) has none: use activation_checkpointing = 'full' or 'none'"
            )
        if not hasattr(mlp, "flexorch_recompute"):
            mlp.flexorch_plain_forward = mlp.forward  # what a compiled layer compiles (flexorch.workers.compile)

            def forward(x, *args, _mlp=mlp, **kwargs):
                if _mlp.flexorch_recompute and not args and not kwargs:
                    return checkpointed(_mlp.flexorch_plain_forward, x)
                return _mlp.flexorch_plain_forward(x, *args, **kwargs)

            mlp.forward = forward
            mlp.flexorch_recompute = False
        out.append(mlp)
    return out


def hf_config(cfg: ModelConfig):
    """The directory's Transformers config (local files only), set to flexorch's attention and fp32 weights."""
    tf = transformers_module()
    register_attention()
    conf = tf.AutoConfig.from_pretrained(cfg.hf, local_files_only=True)
    conf._attn_implementation = ATTN_IMPLEMENTATION
    return conf


def meta_hf_decoder(cfg: ModelConfig) -> HFDecoder:
    """The model on the meta device (no memory): allocate it with ``to_empty`` and fill it, or shard it first.
    ``cfg.adapters``: each decoder layer also holds the tasks' LoRA adapters (``flexorch.workers.lora``);
    ``cfg.base_trainable`` false: only they require gradients."""
    tf = transformers_module()
    conf = hf_config(cfg)
    with torch.device("meta"):
        lm = tf.AutoModelForCausalLM.from_config(conf, attn_implementation=ATTN_IMPLEMENTATION, dtype=torch.float32)
        model = HFDecoder(lm, cfg)
        if cfg.adapters:
            add_adapters(model, cfg.adapters)
    apply_base_trainable(model, cfg.base_trainable)
    names = [n for n, _ in model.named_parameters()]
    expected = [n for n, _ in cfg.param_shapes()]
    if names != expected:  # the config layer's shapes drive checks, init and re-sharding: they must be the model's
        raise RuntimeError(f"Transformers built parameters {names[:4]}..., flexorch expected {expected[:4]}...")
    return model


def hf_weights(cfg: ModelConfig, shapes, rows=None, *, seed: int = 0):
    """Yield ``(name, float32 CPU tensor)`` of each parameter in ``shapes`` from the directory's safetensors files,
    one tensor at a time; with ``rows(name) -> (start, stop) | None`` only those rows are read from disk (a sharded
    worker's), and parameters mapped to None are skipped. Adapter parameters are not in the files: they are
    generated (``flexorch.workers.lora.initial_adapter_value`` with ``seed``), those rows of them likewise."""
    from pathlib import Path

    from safetensors import safe_open

    from flexorch.config.hf import hf_weight_files

    files = hf_weight_files(Path(cfg.hf))
    for name, shape in shapes:
        span = rows(name) if rows is not None else (0, shape[0])
        if span is None:
            continue
        if is_adapter_param(name):
            yield name, initial_adapter_param(name, shape, seed, cfg.adapters)[span[0] : span[1]]
            continue
        with safe_open(str(files[name]), framework="pt") as f:
            stored = f.get_slice(name)
            if tuple(stored.get_shape()) != tuple(shape):
                raise ValueError(f"{name}: the checkpoint holds {tuple(stored.get_shape())}, the model {tuple(shape)}")
            value = stored[span[0] : span[1]].to(torch.float32)
        yield name, value


def hf_random_init(cfg: ModelConfig, seed: int, shapes):
    """Yield ``(name, float32 CPU tensor)`` of each whole parameter in ``shapes``, Transformers' initialisation
    scheme (normal(0, initializer_range) matrices and embeddings, zero biases, norms at 1, Gemma's ``1 + w`` norms
    at 0) drawn in order from a
    generator seeded with ``seed``. Adapter parameters come from generators of their own
    (``flexorch.workers.lora.initial_adapter_value``): the base values are those of the model without them."""
    return with_adapter_values(lambda base: _random_base(cfg, seed, base), shapes, seed, cfg.adapters)


def _random_base(cfg: ModelConfig, seed: int, shapes):
    from flexorch.config.hf import FAMILY_LAYOUTS

    norm = torch.ones if FAMILY_LAYOUTS[cfg.family].norm_ones else torch.zeros
    gen = torch.Generator().manual_seed(seed)
    for name, shape in shapes:
        if name.endswith(".bias") or name.endswith("_bias"):
            yield name, torch.zeros(shape, dtype=torch.float32)
        elif len(shape) == 1 and not name.endswith(".sinks"):  # RMSNorm weights (GPT-OSS's sinks: drawn)
            yield name, norm(shape, dtype=torch.float32)
        else:
            yield name, torch.empty(shape, dtype=torch.float32).normal_(0.0, cfg.init_std, generator=gen)
