"""The mixture-of-experts families (Qwen3-MoE, Mixtral, OLMoE, GPT-OSS) as read from ``config.json``, without torch.

Transformers 5 stores a layer's experts as two 3-D parameters, ``mlp.experts.gate_up_proj (experts, 2 ffn, hidden)``
and ``mlp.experts.down_proj (experts, hidden, ffn)``, beside the router ``mlp.gate.weight (experts, hidden)``. Each
token is routed to its ``num_experts_per_tok`` (k) highest-probability experts (a softmax over the router's logits),
whose outputs are summed with those probabilities as weights. Routing is per token, so every plan (any SP kind,
any shard) computes the same thing; with FSDP2 the 3-D parameters are sharded along the experts dimension (whole
experts per rank where the count divides).

What a token costs and what a model holds differ: :func:`expert_params` of the k routed experts run per token (the
compute the planner's calibration measures as the model runs), all of them are held (what the memory budget
counts, from ``ModelConfig.param_shapes``).

The router's load-balancing loss (Switch Transformer, Fedus et al. 2021, arXiv 2101.03961, eqs. 4-6; Transformers'
``load_balancing_loss_func``) trains when the config sets ``output_router_logits``; its weight is
``router_aux_loss_coef`` (``flexorch.workers.router_loss`` computes it over the whole global batch).
"""

from __future__ import annotations

from dataclasses import dataclass

from flexorch.config.errors import ConfigError

__all__ = ["MOE_LAYOUTS", "MoeLayout", "expert_params", "moe_fields", "moe_mlp_shapes"]


@dataclass(frozen=True)
class MoeLayout:
    """Where a family keeps its experts' sizes and in which order its MoE block registers its parameters."""

    expert_ffn_key: str
    """The config key of one expert's intermediate size."""
    router_first: bool
    """The router (``mlp.gate``) is registered before the experts (Mixtral, OLMoE); False: after (Qwen3-MoE)."""
    sparse_layers: bool = False
    """Some layers may keep a dense MLP (Qwen3-MoE's ``mlp_only_layers`` and ``decoder_sparse_step``)."""
    router: str = "gate"
    """The router's module name in the MLP (``mlp.gate``; GPT-OSS: ``mlp.router``)."""
    biased: bool = False
    """The router and the experts have biases, and the experts' weights are stored ``(experts, in, out)`` (GPT-OSS)."""


MOE_LAYOUTS: dict[str, MoeLayout] = {
    "qwen3_moe": MoeLayout("moe_intermediate_size", router_first=False, sparse_layers=True),
    "mixtral": MoeLayout("intermediate_size", router_first=True),
    "olmoe": MoeLayout("intermediate_size", router_first=True),
    "gpt_oss": MoeLayout("intermediate_size", router_first=True, router="router", biased=True),
}
"""The MoE families flexorch trains (their blocks run as Transformers ships them, experts replicated or sharded)."""


def _positive(cfg: dict, where: str, *keys: str) -> int:
    for key in keys:
        if key in cfg:
            v = cfg[key]
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"{where}: {key} must be an integer >= 1, got {v!r}")
            return v
    raise ConfigError(f"{where}: a mixture-of-experts config needs {' or '.join(keys)}")


def _moe_layers(cfg: dict, family: str, layers: int, where: str) -> tuple[int, ...]:
    """The layers whose MLP is an MoE block, as Transformers' decoder layer decides: all of them, except (Qwen3-MoE)
    the layers in ``mlp_only_layers`` and those off the ``decoder_sparse_step`` stride."""
    if not MOE_LAYOUTS[family].sparse_layers:
        return tuple(range(layers))
    dense = cfg.get("mlp_only_layers") or []
    step = cfg.get("decoder_sparse_step", 1)
    if not isinstance(dense, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in dense):
        raise ConfigError(f"{where}: mlp_only_layers must be a list of layer indices, got {dense!r}")
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ConfigError(f"{where}: decoder_sparse_step must be an integer >= 1, got {step!r}")
    return tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0)


def moe_fields(cfg: dict, family: str, layers: int, where: str) -> dict:
    """The :class:`~flexorch.config.model.ModelConfig` fields of an MoE family's config: ``num_experts``,
    ``experts_per_token``, ``expert_ffn_dim``, ``moe_layers`` and ``router_aux_coef`` (0.0 when the config does
    not train the router loss: ``output_router_logits`` false, Transformers' default)."""
    lay = MOE_LAYOUTS[family]
    experts = _positive(cfg, where, "num_local_experts", "num_experts")
    k = _positive(cfg, where, "num_experts_per_tok")
    if k > experts:
        raise ConfigError(f"{where}: num_experts_per_tok {k} is more than the {experts} experts")
    jitter = float(cfg.get("router_jitter_noise", 0.0) or 0.0)
    if jitter:
        raise ConfigError(
            f"{where}: router_jitter_noise {jitter}: the router's input is multiplied by fresh random noise per token "
            "in training, drawn differently on each shard of each plan, so a step would depend on where it ran; set "
            "router_jitter_noise to 0.0"
        )
    coef = float(cfg.get("router_aux_loss_coef", 0.0) or 0.0) if cfg.get("output_router_logits") else 0.0
    if coef < 0:
        raise ConfigError(f"{where}: router_aux_loss_coef must be >= 0, got {coef}")
    return {
        "num_experts": experts,
        "experts_per_token": k,
        "expert_ffn_dim": _positive(cfg, where, lay.expert_ffn_key),
        "moe_layers": _moe_layers(cfg, family, layers, where),
        "router_aux_coef": coef,
    }


def moe_mlp_shapes(m, prefix: str) -> list[tuple[str, tuple[int, ...]]]:
    """``(name, shape)`` of one MoE block's parameters (layer ``prefix``, e.g. ``model.layers.3.``) in
    ``named_parameters`` order; ``m``: a ModelConfig-like with ``family``, ``dim``, ``num_experts``,
    ``expert_ffn_dim``."""
    e, f, dim = m.num_experts, m.expert_ffn_dim, m.dim
    lay = MOE_LAYOUTS[m.family]
    r, x = f"{prefix}mlp.{lay.router}.", prefix + "mlp.experts."
    if lay.biased:  # GPT-OSS: (experts, in, out) weights, each with a bias
        return [(r + "weight", (e, dim)), (r + "bias", (e,)),
                (x + "gate_up_proj", (e, dim, 2 * f)), (x + "gate_up_proj_bias", (e, 2 * f)),
                (x + "down_proj", (e, f, dim)), (x + "down_proj_bias", (e, dim))]  # fmt: skip
    router = [(r + "weight", (e, dim))]
    experts = [(x + "gate_up_proj", (e, 2 * f, dim)), (x + "down_proj", (e, dim, f))]
    return router + experts if lay.router_first else experts + router


def expert_params(m) -> int:
    """Parameters of one expert (its gated MLP: gate, up and down projections, and GPT-OSS's biases)."""
    biases = 2 * m.expert_ffn_dim + m.dim if MOE_LAYOUTS[m.family].biased else 0
    return 3 * m.dim * m.expert_ffn_dim + biases
