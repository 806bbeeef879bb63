"""Which model a run trains: flexorch's own decoder (``flexorch.workers.model``) or a Hugging Face causal LM
(``flexorch.workers.hf_model``, when ``ModelConfig.hf`` names a directory). Both take ``(input_ids, position_ids,
attn)`` and return logits, expose their decoder layers as ``layers`` and are initialised from a stream of whole
parameters in ``ModelConfig.param_shapes`` order, so the step, FSDP sharding, re-sharding and checkpoints treat them
alike. Transformers is imported only for an HF model."""

from __future__ import annotations

import torch
from torch import nn

from flexorch.config.model import ModelConfig
from flexorch.workers import model as own

__all__ = ["build_model", "initial_parameters", "meta_model", "set_activation_checkpointing"]


def meta_model(cfg: ModelConfig) -> nn.Module:
    """The model on the meta device (no memory)."""
    if cfg.hf is None:
        with torch.device("meta"):
            return own.Decoder(cfg)
    from flexorch.workers.hf_model import meta_hf_decoder

    return meta_hf_decoder(cfg)


def initial_parameters(cfg: ModelConfig, seed: int, shapes, rows=None):
    """Yield ``(name, float32 CPU tensor)`` of each parameter's initial value, in the order of ``shapes``.

    ``rows(name) -> (start, stop) | None`` (a sharded worker): yield only those rows of each parameter, and skip
    the parameters it maps to None. Weights from a checkpoint are then read only for those rows; generated values
    are still drawn whole (the generator's stream), so they do not depend on the sharding."""
    if cfg.hf is not None and cfg.hf_weights:
        from flexorch.workers.hf_model import hf_weights

        yield from hf_weights(cfg, shapes, rows, seed=seed)
        return
    if cfg.hf is None:
        values = own.initial_parameters(cfg, seed, shapes)
    else:
        from flexorch.workers.hf_model import hf_random_init

        values = hf_random_init(cfg, seed, shapes)
    for name, full in values:
        span = rows(name) if rows is not None else (0, full.shape[0])
        if span is not None:
            yield name, full[span[0] : span[1]]


def build_model(cfg: ModelConfig, seed: int, *, device: torch.device | str | None = None) -> nn.Module:
    """The whole model with its initial parameters: the same ``(cfg, seed)`` gives bitwise-equal weights anywhere."""
    if cfg.hf is None:
        return own.init_model(cfg, seed, device=device)
    model = meta_model(cfg).to_empty(device=device or "cpu")
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in initial_parameters(cfg, seed, cfg.param_shapes()):
            params[name].copy_(value)
    return model


def set_activation_checkpointing(model: nn.Module, mode: str) -> None:
    """Recompute mode of every decoder layer: 'none', 'full' or (our decoder) 'selective'."""
    if hasattr(model, "set_recompute"):
        model.set_recompute(mode)
    else:
        own.set_activation_checkpointing(model, mode)
