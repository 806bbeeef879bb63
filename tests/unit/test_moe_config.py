"""Mixture-of-experts configs (``flexorch.config.hf_moe``): which layers are MoE, the parameters a token computes
with against those the model holds (counted on the model Transformers builds), and the checks' messages."""

from __future__ import annotations

import pytest

from flexorch.config import ModelConfig
from flexorch.config.errors import ConfigError
from flexorch.config.hf import hf_model_config

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

SHAPE = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 4, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 96}  # fmt: skip


def _cfg(tmp_path, family, **options) -> tuple[ModelConfig, object]:
    conf = transformers.AutoConfig.for_model(family, **{**SHAPE, **options})
    conf.save_pretrained(tmp_path / family)
    with torch.device("meta"):
        lm = transformers.AutoModelForCausalLM.from_config(conf)
    return ModelConfig.from_dict(hf_model_config(str(tmp_path / family))), lm


@pytest.mark.parametrize(
    "family,options,layers",
    [("qwen3_moe", {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                    "decoder_sparse_step": 2, "mlp_only_layers": [3]}, (1,)),
     ("qwen3_moe", {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16}, (0, 1, 2, 3)),
     ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 1}, (0, 1, 2, 3)),
     ("olmoe", {"num_experts": 6, "num_experts_per_tok": 3, "pad_token_id": None}, (0, 1, 2, 3)),
     ("gpt_oss", {"num_local_experts": 4, "num_experts_per_tok": 2, "head_dim": 8}, (0, 1, 2, 3))],
)  # fmt: skip
def test_moe_layers_and_active_parameters_are_the_models(tmp_path, family, options, layers):
    cfg, lm = _cfg(tmp_path, family, **options)
    assert cfg.moe_layers == layers
    assert cfg.param_shapes() == [(n, tuple(p.shape)) for n, p in lm.named_parameters()]
    held = sum(p.numel() for p in lm.parameters())
    idle = 0  # the experts a token is not routed to, counted on Transformers' own modules
    for i, layer in enumerate(lm.model.layers):
        experts = getattr(layer.mlp, "experts", None)
        assert (experts is not None) == (i in layers)
        if experts is not None:
            per_expert = sum(p[0].numel() for p in experts.parameters())
            idle += (cfg.num_experts - cfg.experts_per_token) * per_expert
    assert cfg.num_params() == held
    assert cfg.active_params() == held - idle < held
    dense = ModelConfig(dim=32, num_heads=4)
    assert dense.active_params() == dense.num_params()


def test_the_router_loss_follows_output_router_logits(tmp_path):
    off, _ = _cfg(tmp_path, "mixtral", num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.02)
    assert off.router_aux_coef == 0.0  # Transformers' default: output_router_logits false, no router loss
    on, _ = _cfg(tmp_path, "olmoe", num_experts=4, num_experts_per_tok=2, output_router_logits=True,
                 router_aux_loss_coef=0.02, pad_token_id=None)  # fmt: skip
    assert on.router_aux_coef == 0.02
    again = ModelConfig.from_dict(on.to_dict())  # a checkpoint's config.json round trip
    assert (again.moe_layers, again.router_aux_coef) == (on.moe_layers, 0.02)


def test_moe_fields_are_checked_with_what_to_change(tmp_path):
    with pytest.raises(ValueError, match="flexorch's own decoder is dense"):
        ModelConfig(num_experts=4, experts_per_token=2, expert_ffn_dim=8, moe_layers=(0,))
    with pytest.raises(ValueError, match="need num_experts"):
        ModelConfig(router_aux_coef=0.1)
    cfg, _ = _cfg(tmp_path, "mixtral", num_local_experts=4, num_experts_per_tok=2)
    fields = cfg.to_dict()
    with pytest.raises(ValueError, match=r"1 <= experts_per_token <= 4 \(got 5\)"):
        ModelConfig.from_dict({**fields, "experts_per_token": 5})
    with pytest.raises(ValueError, match=r"moe_layers distinct indices in \[0, 4\)"):
        ModelConfig.from_dict({**fields, "moe_layers": [0, 4]})
    conf = transformers.AutoConfig.for_model(
        "qwen3_moe", **SHAPE, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=0
    )
    conf.save_pretrained(tmp_path / "step0")  # Transformers itself would divide by zero building it
    with pytest.raises(ConfigError, match="decoder_sparse_step must be an integer >= 1, got 0"):
        hf_model_config(str(tmp_path / "step0"))


def test_lora_targets_of_an_moe_model_are_its_attention_projections(tmp_path):
    """The router (``mlp.gate``) is not an nn.Linear and the experts are 3-D parameters: neither is offered; a
    Qwen3-MoE dense layer's MLP is not either, since not every layer has one."""
    from flexorch.config.adapters import target_modules

    cfg, _ = _cfg(tmp_path, "qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                  mlp_only_layers=[0])  # fmt: skip
    assert target_modules(cfg) == ("q_proj", "k_proj", "v_proj", "o_proj")


def test_the_start_line_gives_the_active_parameters_of_an_moe_model():
    from flexorch.cli.train_console import _active

    assert _active({"model_params": 3_000_000, "model_active_params": 1_200_000}) == " (1.20M active per token)"
    assert _active({"model_params": 3_000_000, "model_active_params": 3_000_000}) == ""
