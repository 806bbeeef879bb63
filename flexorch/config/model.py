"""Shape of the LLaMA-style decoder (``flexorch.workers.model`` builds it), its presets and its parameter count.

Pure data: no torch, so a run file can be read and checked without the data plane.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from flexorch.config.adapters import LoraSpec, check_adapters, with_adapter_shapes

__all__ = ["MODEL_PRESETS", "RUN_KEYS", "ModelConfig", "model_config"]


RUN_KEYS = frozenset({"loss_chunk_tokens", "compile", "attention"})
"""ModelConfig fields that say how the model runs, not what it is: allowed beside ``[model] hf``, and a checkpoint
resumes whatever they were when it was written."""


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shape of the decoder; validated on construction."""

    vocab_size: int = 257
    """Token ids are in [0, vocab_size); the byte tokenizer uses 256 bytes + BOS."""
    dim: int = 64
    """Hidden size."""
    num_layers: int = 2
    """Number of decoder blocks."""
    num_heads: int = 4
    """Query heads; ``dim`` must be divisible by it."""
    num_kv_heads: int = 2
    """Key/value heads (GQA); must divide ``num_heads``."""
    ffn_dim: int = 172
    """Hidden size of the SwiGLU MLP (LLaMA: about 8/3 * dim)."""
    rope_theta: float = 10000.0
    """RoPE base: frequencies theta^(-2i/head_dim)."""
    norm_eps: float = 1e-5
    """Epsilon inside RMSNorm's square root."""
    init_std: float = 0.02
    """Standard deviation of the normal initialisation of weight matrices."""
    tie_embeddings: bool = False
    """Share the token embedding with the LM head."""
    hf: str | None = None
    """A Hugging Face model directory (absolute; ``[model] hf = "DIR"``, read by :func:`~flexorch.config.hf.
    hf_model_config`): the model is that directory's Transformers model, and the fields above are its shape."""
    family: str = "flexorch"
    """'flexorch' (our decoder, ``flexorch.workers.model``) or a Transformers ``model_type`` in ``HF_FAMILIES``."""
    head_size: int = 0
    """The size of one attention head when a Hugging Face config sets one other than dim / num_heads (``head_dim``:
    Qwen3, Gemma 3); 0: dim / num_heads (:attr:`head_dim` reads either)."""
    qkv_bias: bool = False
    """The q/k/v projections have biases (Qwen2; ``attention_bias`` of Llama, Qwen3, OLMo 2, Gemma 3)."""
    o_bias: bool = False
    """The attention's output projection has a bias (``attention_bias`` of Llama, Qwen3, OLMo 2, Gemma 3)."""
    mlp_bias: bool = False
    """The MLP's projections have biases (Llama's ``mlp_bias``)."""
    num_experts: int = 0
    """Experts in each MoE layer (Qwen3-MoE, Mixtral, OLMoE: ``flexorch.config.hf_moe``); 0: a dense model."""
    experts_per_token: int = 0
    """The experts each token is routed to (``num_experts_per_tok``): what it computes (:meth:`active_params`)."""
    expert_ffn_dim: int = 0
    """One expert's intermediate size."""
    moe_layers: tuple[int, ...] = ()
    """The layers whose MLP is an MoE block (the others keep a dense MLP of ``ffn_dim``)."""
    router_aux_coef: float = 0.0
    """The weight of the router's load-balancing loss in the objective (``router_aux_loss_coef`` where the config
    sets ``output_router_logits``; ``flexorch.workers.router_loss``); 0.0: not trained."""
    attention_window: int | None = None
    """The sliding attention window of the layers in :attr:`window_layers` (Mistral's, Gemma 3's ``sliding_window``):
    a query attends to the ``attention_window`` latest keys of its document, itself included."""
    window_layers: tuple[int, ...] = ()
    """The layers that use :attr:`attention_window` (every layer when the window is set and this is empty, as a
    config written before it existed meant); the others attend to their whole document."""
    hf_weights: bool = False
    """``hf``'s directory holds safetensors weights (else the model starts from a random initialisation)."""
    loss_chunk_tokens: int = 4096
    """The LM head and the loss run over chunks of this many tokens, each recomputed in the backward, so no
    ``(tokens, vocab)`` float32 logits of a whole micro-batch are ever held (``flexorch.workers.chunked_loss``);
    0: the whole logits at once. Not part of the model's shape (allowed beside ``hf``)."""
    compile: bool | None = None
    """Regional ``torch.compile`` of each decoder layer (``flexorch.workers.compile``); unset: on with a GPU, off
    on a CPU. Not part of the model's shape."""
    attention: str = "auto"
    """The varlen attention kernel: ``auto`` (on a GPU, the fastest of the kernels that match the ``math`` reference
    there, measured at worker start: ``flexorch.workers.attention.choice``) or one of ``flash_attn``,
    ``torch_cudnn``, ``torch_flash``, ``torch_cpu``, ``math``. Not part of the model's shape."""
    adapters: tuple[LoraSpec, ...] = ()
    """Per-task LoRA adapters on the decoder layers (``flexorch.config.adapters``, built by
    ``flexorch.workers.lora``; a run sets them from ``[[tasks]]``); part of the model's shape (its parameters)."""
    base_trainable: bool = True
    """The base model's parameters train; false: only the adapters do (every other parameter is built with
    ``requires_grad=False``)."""

    def __post_init__(self) -> None:
        c = self.loss_chunk_tokens
        if isinstance(c, bool) or not isinstance(c, int) or c < 0:
            raise ValueError(f"ModelConfig.loss_chunk_tokens must be an integer >= 0 (0: no chunks), got {c!r}")
        if self.compile is not None and not isinstance(self.compile, bool):
            raise ValueError(f"ModelConfig.compile must be true or false (unset: on with a GPU), got {self.compile!r}")
        backends = ("auto", "flash_attn", "torch_cudnn", "torch_flash", "torch_cpu", "math")
        if self.attention not in backends:
            raise ValueError(f"ModelConfig.attention must be one of {list(backends)}, got {self.attention!r}")
        for name in ("vocab_size", "dim", "num_layers", "num_heads", "num_kv_heads", "ffn_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelConfig.{name} must be an integer >= 1, got {value!r}")
        for name in ("rope_theta", "norm_eps", "init_std"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
                raise ValueError(f"ModelConfig.{name} must be a finite number > 0, got {value!r}")
        if not isinstance(self.tie_embeddings, bool):
            raise ValueError(f"ModelConfig.tie_embeddings must be a bool, got {self.tie_embeddings!r}")
        hs = self.head_size
        if isinstance(hs, bool) or not isinstance(hs, int) or hs < 0:
            raise ValueError(f"ModelConfig.head_size must be an integer >= 0 (0: dim / num_heads), got {hs!r}")
        if hs and self.hf is None:
            raise ValueError(f"ModelConfig.head_size={hs}: flexorch's own decoder's heads are dim / num_heads; set 0")
        if not hs and self.dim % self.num_heads:
            raise ValueError(f"ModelConfig: dim={self.dim} is not divisible by num_heads={self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig: num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        biased = self.qkv_bias or self.o_bias or self.mlp_bias
        if (self.family == "flexorch") != (self.hf is None) or (self.family == "flexorch" and biased):
            raise ValueError(
                f"ModelConfig: family {self.family!r} with hf={self.hf!r}, biases {biased}: a Hugging Face "
                "model comes from [model] hf = DIR alone"
            )
        self._set_window_layers()
        self._set_moe()
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig: head_dim={self.head_dim} (dim / num_heads) must be even for RoPE")
        if not isinstance(self.base_trainable, bool):
            raise ValueError(f"ModelConfig.base_trainable must be true or false, got {self.base_trainable!r}")
        self._set_adapters()

    def _set_window_layers(self) -> None:
        w, layers = self.attention_window, self.window_layers
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
            raise ValueError(f"ModelConfig.attention_window must be an integer >= 1 or None, got {w!r}")
        if isinstance(layers, str | bytes) or not isinstance(layers, tuple | list):
            raise ValueError(f"ModelConfig.window_layers must be a list of layer indices, got {layers!r}")
        layers = tuple(layers) if w is None or layers else tuple(range(self.num_layers))
        if w is None and layers:
            raise ValueError(f"ModelConfig.window_layers={list(layers)} without an attention_window")
        bad = [i for i in layers if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.num_layers]
        if bad or len(set(layers)) != len(layers) or list(layers) != sorted(layers):
            raise ValueError(
                f"ModelConfig.window_layers must be distinct layer indices in [0, {self.num_layers}) in order, got "
                f"{list(layers)}"
            )
        object.__setattr__(self, "window_layers", layers)

    def _set_moe(self) -> None:
        e, k, f, layers = self.num_experts, self.experts_per_token, self.expert_ffn_dim, self.moe_layers
        if isinstance(layers, str | bytes) or not isinstance(layers, tuple | list):
            raise ValueError(f"ModelConfig.moe_layers must be a list of layer indices, got {layers!r}")
        object.__setattr__(self, "moe_layers", tuple(layers))
        ints = all(isinstance(v, int) and not isinstance(v, bool) for v in (e, k, f, *layers))
        coef = self.router_aux_coef
        if not ints or not isinstance(coef, int | float) or isinstance(coef, bool) or not 0 <= coef < math.inf:
            raise ValueError(
                "ModelConfig: num_experts, experts_per_token, expert_ffn_dim and moe_layers must be integers and "
                f"router_aux_coef a number >= 0, got {e, k, f, list(layers), coef}"
            )
        if e == 0:
            if k or f or layers or coef:
                raise ValueError(
                    "ModelConfig: experts_per_token, expert_ffn_dim, moe_layers and router_aux_coef need num_experts"
                )
            return
        if self.hf is None:
            raise ValueError(
                "ModelConfig.num_experts: flexorch's own decoder is dense; an MoE model comes from [model] hf"
            )
        if (
            not 1 <= k <= e
            or f < 1
            or not layers
            or list(layers) != sorted(set(layers))
            or not 0 <= layers[0] <= layers[-1] < self.num_layers
        ):
            raise ValueError(
                f"ModelConfig: {e} experts need 1 <= experts_per_token <= {e} (got {k}), expert_ffn_dim >= 1 (got {f}) "
                f"and moe_layers distinct indices in [0, {self.num_layers}) in order (got {list(layers)})"
            )

    @property
    def window_fraction(self) -> float:
        """The share of the layers that attend within :attr:`attention_window` (0.0 without one)."""
        return len(self.window_layers) / self.num_layers if self.attention_window is not None else 0.0

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of decoder layer ``layer`` (None: it attends to its whole document)."""
        return self.attention_window if layer in self.window_layers else None

    def _set_adapters(self) -> None:
        """``adapters`` as a tuple of :class:`LoraSpec` (dicts, as ``to_dict`` and JSON give them back, are
        converted), checked against this model's decoder layers."""
        a = self.adapters
        if isinstance(a, str | bytes | Mapping) or not isinstance(a, tuple | list):
            raise ValueError(f"ModelConfig.adapters must be a list of LoRA adapters (LoraSpec), got {a!r}")
        specs = tuple(s if isinstance(s, LoraSpec) else LoraSpec.from_dict(s) for s in a)
        check_adapters(self, specs)
        object.__setattr__(self, "adapters", specs)

    @property
    def head_dim(self) -> int:
        """Size of one attention head: :attr:`head_size`, else dim / num_heads."""
        return self.head_size or self.dim // self.num_heads

    def num_params(self) -> int:
        """Parameter count computed from the shape (equals the built model's), adapters included."""
        if self.hf is not None or self.adapters:
            return sum(math.prod(shape) for _, shape in self.param_shapes())
        kv = self.num_kv_heads * self.head_dim
        attn = 2 * self.dim * self.dim + 2 * self.dim * kv  # wq, wo + wk, wv
        mlp = 3 * self.dim * self.ffn_dim  # w1, w2, w3
        per_layer = attn + mlp + 2 * self.dim  # + attention_norm, ffn_norm
        embed = self.vocab_size * self.dim
        head = 0 if self.tie_embeddings else self.vocab_size * self.dim
        return embed + self.num_layers * per_layer + self.dim + head  # + final norm

    def active_params(self) -> int:
        """Parameters a token computes with: :meth:`num_params` less, in each MoE layer, the experts it is not
        routed to (``num_experts - experts_per_token`` of them). The model holds all of them (:meth:`num_params`)."""
        if not self.num_experts:
            return self.num_params()
        from flexorch.config.hf_moe import expert_params

        idle = (self.num_experts - self.experts_per_token) * expert_params(self)
        return self.num_params() - len(self.moe_layers) * idle

    def param_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """``(name, shape)`` of every parameter in the built model's ``named_parameters`` order: the base model's,
        with each decoder layer's adapter parameters right after that layer's own (``flexorch.config.adapters``)."""
        return with_adapter_shapes(self._base_param_shapes(), self.adapters)

    def _base_param_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        if self.hf is not None:
            from flexorch.config.hf import hf_param_shapes

            return hf_param_shapes(self)
        kv = self.num_kv_heads * self.head_dim
        out: list[tuple[str, tuple[int, ...]]] = [("tok_embeddings.weight", (self.vocab_size, self.dim))]
        for i in range(self.num_layers):
            p = f"layers.{i}."
            out += [
                (p + "attention_norm.weight", (self.dim,)),
                (p + "attention.wq.weight", (self.num_heads * self.head_dim, self.dim)),
                (p + "attention.wk.weight", (kv, self.dim)),
                (p + "attention.wv.weight", (kv, self.dim)),
                (p + "attention.wo.weight", (self.dim, self.num_heads * self.head_dim)),
                (p + "ffn_norm.weight", (self.dim,)),
                (p + "feed_forward.w1.weight", (self.ffn_dim, self.dim)),
                (p + "feed_forward.w2.weight", (self.dim, self.ffn_dim)),
                (p + "feed_forward.w3.weight", (self.ffn_dim, self.dim)),
            ]
        out.append(("norm.weight", (self.dim,)))
        if not self.tie_embeddings:
            out.append(("output.weight", (self.vocab_size, self.dim)))
        return out

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of every field (JSON/TOML friendly)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> ModelConfig:
        """Inverse of :meth:`to_dict`; missing keys take their defaults, unknown keys raise ValueError."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown ModelConfig keys {unknown}; valid keys: {sorted(known)}")
        return cls(**values)


MODEL_PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(),
    "small": ModelConfig(dim=256, num_layers=4, num_heads=8, num_kv_heads=4, ffn_dim=688),
    "llama-7b": ModelConfig(vocab_size=32000, dim=4096, num_layers=32, num_heads=32, num_kv_heads=32, ffn_dim=11008),
}


def model_config(name_or_dict: str | Mapping[str, Any] | ModelConfig) -> ModelConfig:
    """A preset by name, a config from a dict (optionally ``{"preset": name, **overrides}``), or the config."""
    if isinstance(name_or_dict, ModelConfig):
        return name_or_dict
    if isinstance(name_or_dict, str):
        if name_or_dict not in MODEL_PRESETS:
            raise ValueError(f"unknown model preset {name_or_dict!r}; choose one of {sorted(MODEL_PRESETS)}")
        return MODEL_PRESETS[name_or_dict]
    values = dict(name_or_dict)
    base = model_config(values.pop("preset")) if "preset" in values else ModelConfig()
    return ModelConfig.from_dict({**base.to_dict(), **values})
