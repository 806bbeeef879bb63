"""An MoE model's router load-balancing loss over the global batch (``flexorch.workers.router_loss``), against
Transformers' own ``load_balancing_loss_func`` and its ``output_router_logits`` loss (oracles we did not write):
the value and the gradients are the same however the batch is split into micro-batches and shards."""

from __future__ import annotations

import functools
import importlib

import pytest
import torch

from flexorch.config import ModelConfig
from flexorch.config.hf import hf_model_config
from flexorch.workers.router_loss import RouterBalance, RouterSpec, routing_sums

transformers = pytest.importorskip("transformers")

SHAPE = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 3, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 96,
         "output_router_logits": True, "router_aux_loss_coef": 0.3}  # fmt: skip
MOE = {
    "qwen3_moe": {"num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "mlp_only_layers": [1]},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "olmoe": {"num_experts": 5, "num_experts_per_tok": 3, "pad_token_id": None},
    "gpt_oss": {
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "head_dim": 8,
        "sliding_window": 8,
        "pad_token_id": None,
    },
}
"""Tiny MoE configs that train the router loss (a large coefficient, so its gradient is not lost in the tolerance);
Qwen3-MoE with a dense layer among its MoE layers; GPT-OSS with its sinks and a window on every other layer."""


def _impl(family):
    return "eager" if family == "gpt_oss" else "sdpa"  # GPT-OSS's sinks: Transformers' eager attention only


def _theirs(family):
    return importlib.import_module(f"transformers.models.{family}.modeling_{family}").load_balancing_loss_func


def test_split_sums_give_transformers_loss_and_gradient():
    """Router logits of 3 layers over 40 rows, split at arbitrary rows into 4 parts: the summed counts make the same
    loss as Transformers' function on the whole, and the parts' terms (weighted by the whole's counts) the same
    gradient."""
    spec = RouterSpec(num_experts=5, top_k=2, coef=1.0)
    gen = torch.Generator().manual_seed(0)
    logits = [torch.randn(40, 5, generator=gen, dtype=torch.float64).float().requires_grad_() for _ in range(3)]
    whole = _theirs("mixtral")(tuple(logits), 5, 2)
    (g_whole,) = torch.autograd.grad(whole, [logits[0]])
    cuts = [(0, 7), (7, 8), (8, 31), (31, 40)]
    parts = [[x[a:b] for x in logits] for a, b in cuts]
    # a shard's padding rows (3 of them, random logits) are left out by its mask, as Transformers' attention_mask does
    pad = torch.randn(3, 5, generator=gen)
    parts[1] = [torch.cat([pad, x]) for x in parts[1]]
    real = [None, torch.tensor([False] * 3 + [True]), None, None]
    sums = [routing_sums(p, spec, m) for p, m in zip(parts, real, strict=True)]
    counts = sum(c for c, _, _ in sums)
    probs = sum(p.detach().double() for _, p, _ in sums)
    balance = RouterBalance(spec, counts, probs, sum(r for _, _, r in sums), predicted=1)
    assert balance.rows == 120
    assert balance.aux_loss == pytest.approx(float(whole.detach()), rel=1e-6)
    for p, m in zip(parts, real, strict=True):
        balance.real = m
        balance.add(p)
    (g_parts,) = torch.autograd.grad(balance.take(), [logits[0]])
    torch.testing.assert_close(g_parts, g_whole, rtol=1e-5, atol=1e-8)
    assert balance.take() is None


def _dir(tmp_path, family, **extra):
    conf = transformers.AutoConfig.for_model(family, **{**SHAPE, **MOE[family], **extra})
    d = tmp_path / family
    conf.save_pretrained(d)
    return d


@pytest.mark.parametrize("family", list(MOE))
def test_one_document_equals_transformers_output_router_logits_loss(tmp_path, family):
    """One document, no split: flexorch's cross-entropy plus coef x its router loss is Transformers' own ``loss``
    (labels given, ``output_router_logits``), and its ``aux_loss``."""
    from flexorch.testing.reference import pack_documents
    from flexorch.workers.attention.api import varlen_attn_func
    from flexorch.workers.model_source import build_model

    cfg = ModelConfig.from_dict(hf_model_config(str(_dir(tmp_path, family))))
    assert cfg.router_aux_coef == 0.3 and cfg.num_experts == MOE[family].get("num_experts", 4)
    ours = build_model(cfg, 0)
    conf = transformers.AutoConfig.from_pretrained(cfg.hf)  # its own copy: from_config sets the implementation on it
    ref = transformers.AutoModelForCausalLM.from_config(conf, attn_implementation=_impl(family))
    assert ours.hf_config._attn_implementation == "flexorch"  # ours runs flexorch's attention, the oracle its own
    ref.load_state_dict(ours.state_dict())
    doc = torch.randint(0, 96, (23,), generator=torch.Generator().manual_seed(1))
    out = ref(input_ids=doc[None], labels=doc[None])
    b = pack_documents([doc])
    attn = functools.partial(varlen_attn_func, cu_seqlens=b.cu_seqlens, max_seqlen=b.max_seqlen)
    c, p, r = ours(b.tokens, b.position_ids, attn, routing=torch.ones(23, dtype=torch.bool))
    balance = RouterBalance(RouterSpec(cfg.num_experts, cfg.experts_per_token, 0.3), c, p.double(), r, b.n_predicted)
    assert r == 23 * len(cfg.moe_layers)
    assert balance.aux_loss == pytest.approx(float(out.aux_loss), rel=1e-5)
    ours.router_balance = balance
    ce = ours(b.tokens, b.position_ids, attn, labels=b.labels)
    total = (ce + balance.take()) / b.n_predicted
    assert float(total) == pytest.approx(float(out.loss), rel=1e-5)
    total.backward()
    out.loss.backward()
    theirs = dict(ref.named_parameters())
    for name, q in ours.named_parameters():
        torch.testing.assert_close(q.grad, theirs[name].grad, rtol=1e-4, atol=1e-7, msg=name)


@pytest.mark.parametrize(
    "family,recompute", [("qwen3_moe", "none"), ("mixtral", "full"), ("olmoe", "selective"), ("gpt_oss", "none")]
)
def test_micro_batches_equal_transformers_loss_on_the_whole_batch(tmp_path, family, recompute):
    """Five documents in three micro-batches, counted first, then each micro-batch's loss plus its router term
    backward: the loss and every gradient equal Transformers' model on the whole batch (each document alone, its
    router logits of every document into one ``load_balancing_loss_func``), under each recompute mode."""
    from flexorch.testing.reference import pack_documents
    from flexorch.workers.attention.api import varlen_attn_func
    from flexorch.workers.model import loss_sum
    from flexorch.workers.model_source import build_model, set_activation_checkpointing

    cfg = ModelConfig.from_dict(hf_model_config(str(_dir(tmp_path, family))))
    ours = build_model(cfg, 0)
    set_activation_checkpointing(ours, recompute)
    conf = transformers.AutoConfig.from_pretrained(cfg.hf)  # its own copy: from_config sets the implementation on it
    ref = transformers.AutoModelForCausalLM.from_config(conf, attn_implementation=_impl(family))
    assert ours.hf_config._attn_implementation == "flexorch"  # ours runs flexorch's attention, the oracle its own
    ref.load_state_dict(ours.state_dict())
    gen = torch.Generator().manual_seed(2)
    docs = [torch.randint(0, 96, (n,), generator=gen) for n in (9, 30, 1, 14, 6)]
    whole = pack_documents(docs)
    outs = [ref(input_ids=d[None], output_router_logits=True) for d in docs]
    logits = torch.cat([o.logits[0] for o in outs])
    per_layer = tuple(torch.cat(layer) for layer in zip(*(o.router_logits for o in outs), strict=True))
    aux = _theirs(family)(per_layer, cfg.num_experts, cfg.experts_per_token)
    expected = loss_sum(logits, whole.labels) / whole.n_predicted + 0.3 * aux
    expected.backward()

    batches = [pack_documents(docs[:2]), pack_documents(docs[2:3]), pack_documents(docs[3:])]
    attns = [functools.partial(varlen_attn_func, cu_seqlens=b.cu_seqlens, max_seqlen=b.max_seqlen) for b in batches]
    with torch.no_grad():
        sums = [ours(b.tokens, b.position_ids, a, routing=b.labels > -200) for b, a in zip(batches, attns, strict=True)]
    spec = RouterSpec(cfg.num_experts, cfg.experts_per_token, 0.3)
    counts, probs = sum(s[0] for s in sums), sum(s[1].double() for s in sums)
    ours.router_balance = RouterBalance(spec, counts, probs, sum(s[2] for s in sums), whole.n_predicted)
    assert ours.router_balance.aux_loss == pytest.approx(float(aux), rel=1e-5)
    total = 0.0
    for b, a in zip(batches, attns, strict=True):
        ce = ours(b.tokens, b.position_ids, a, labels=b.labels)
        loss = ce + ours.router_balance.take()
        loss.backward()
        total += float(loss)
    assert total / whole.n_predicted == pytest.approx(float(expected), rel=1e-5)
    theirs = dict(ref.named_parameters())
    for name, q in ours.named_parameters():
        torch.testing.assert_close(q.grad / whole.n_predicted, theirs[name].grad, rtol=1e-4, atol=1e-7, msg=name)


def test_a_model_without_the_router_loss_has_no_routing_pass(tmp_path):
    """``output_router_logits`` false (Transformers' default): the objective is the cross-entropy alone, and the
    step runs no forward-only count (``router_spec`` None)."""
    from flexorch.workers.model_source import build_model

    cfg = ModelConfig.from_dict(hf_model_config(str(_dir(tmp_path, "mixtral", output_router_logits=False))))
    assert cfg.router_aux_coef == 0.0 and cfg.num_experts == 4
    assert build_model(cfg, 0).router_spec is None


@pytest.mark.parametrize("aux", [True, False])
def test_a_calibration_probe_runs_the_routing_count_as_a_step_does(tmp_path, aux):
    """The step of a model that trains its router loss runs a forward-only count before each micro-batch: the
    probes that fit the cost model run it too (one per timed run, and one warm-up), and no other model does."""
    from flexorch.workers.calibrate import Probe, run_probes
    from flexorch.workers.model_source import build_model

    cfg = ModelConfig.from_dict(hf_model_config(str(_dir(tmp_path, "mixtral", output_router_logits=aux))))
    model = build_model(cfg, 0)
    counted = []
    plain = model.forward

    def forward(*args, routing=None, **kwargs):
        counted.append(routing is not None)
        return plain(*args, routing=routing, **kwargs)

    model.forward = forward
    (ms,) = run_probes(model, [Probe(1, "ulysses", (9, 5), repeats=2)], 0, 1, None, None, 96)
    assert ms > 0
    assert counted == ([True, False] * 3 if aux else [False] * 3)
