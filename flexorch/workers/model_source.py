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


def initial_parameters(cfg: ModelConfig, seed: int, shapes):
    """Yield ``(name, float32 CPU tensor)`` of each parameter's initial value, in the order of ``shapes``."""
    if cfg.hf is None:
        return own.initial_parameters(cfg, seed, shapes)
    from flexorch.workers.hf_model import hf_initial_parameters

    return hf_initial_parameters(cfg, seed, shapes)


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
