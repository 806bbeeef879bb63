"""The model, optimizer and single-process reference; sharded forward/backward parity over real gloo processes.

The parity tests are the invariant of docs/design.md §1 at the model level: sharding a packed batch over a Ulysses
or zigzag-ring group of degree 1, 2 or 4 changes where the work runs, not the loss sum or the gradients
(summed over the group's ranks). Float32 against a float32 single-process reference; observed differences are
float reordering, tolerance ``PARITY_TOL``.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch

from flexorch.config import MODEL_PRESETS, ModelConfig, OptimConfig, model_config
from flexorch.testing.reference import pack_documents, reference_loss_sum, reference_step, reference_train
from flexorch.workers.activation_memory import measure_activation_bytes, saved_tensor_meter
from flexorch.workers.attention.api import ulysses_attn_varlen_func, varlen_attn_func, zigzag_ring_attn_varlen_func
from flexorch.workers.attention.sharding import shard, shard_contiguous, shard_zigzag
from flexorch.workers.model import IGNORE_INDEX, check_token_range, init_model, loss_sum, next_token_labels
from flexorch.workers.optim import build_optimizer, clip_grad_norm_, lr_at
from tests._dist_utils import DistPool

PARITY_TOL = {"rtol": 1e-4, "atol": 1e-5}


def make_docs(seed: int, lengths: list[int], vocab: int = 257) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen) for n in lengths]


def forward_packed(model, docs, position_ids=None):
    """Logits of the packed documents with single-device varlen attention."""
    batch = pack_documents(docs)
    attn = functools.partial(varlen_attn_func, cu_seqlens=batch.cu_seqlens, max_seqlen=batch.max_seqlen)
    pos = batch.position_ids if position_ids is None else position_ids
    return model(batch.tokens, pos, attn), batch


# ---- config ----


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"dim": 0}, "dim must be an integer >= 1, got 0"),
        ({"vocab_size": 2.5}, "vocab_size must be an integer >= 1, got 2.5"),
        ({"num_layers": True}, "num_layers must be an integer >= 1, got True"),
        ({"dim": 66}, "dim=66 is not divisible by num_heads=4"),
        ({"num_kv_heads": 3}, "num_heads=4 is not a multiple of num_kv_heads=3"),
        ({"dim": 12, "num_heads": 4, "num_kv_heads": 4}, "head_dim=3 .* must be even"),
        ({"rope_theta": -1.0}, "rope_theta must be a finite number > 0, got -1.0"),
        ({"norm_eps": 0}, "norm_eps must be a finite number > 0, got 0"),
        ({"init_std": float("inf")}, "init_std must be a finite number > 0, got inf"),
        ({"tie_embeddings": 1}, "tie_embeddings must be a bool, got 1"),
    ],
)
def test_model_config_validation(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        ModelConfig(**kwargs)


def test_model_config_dict_round_trip_and_presets():
    cfg = ModelConfig(dim=128, num_heads=8, tie_embeddings=True)
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.head_dim == 16
    with pytest.raises(ValueError, match=r"unknown ModelConfig keys \['dimm'\]; valid keys: .*'dim'"):
        ModelConfig.from_dict({"dimm": 3})
    with pytest.raises(TypeError):
        ModelConfig(64)  # keyword-only
    assert model_config("tiny") == ModelConfig()
    assert model_config({"preset": "small", "num_layers": 1}) == ModelConfig(
        dim=256, num_layers=1, num_heads=8, num_kv_heads=4, ffn_dim=688
    )
    assert model_config({"dim": 32}) == ModelConfig(dim=32)
    assert model_config(cfg) is cfg
    with pytest.raises(ValueError, match=r"unknown model preset 'huge'; choose one of \['llama-7b', 'small', 'tiny'\]"):
        model_config("huge")
    with pytest.raises(ValueError, match=r"unknown ModelConfig keys \['layers'\]"):
        model_config({"preset": "tiny", "layers": 3})


@pytest.mark.parametrize(
    "cfg",
    [
        MODEL_PRESETS["tiny"],
        MODEL_PRESETS["small"],
        ModelConfig(tie_embeddings=True),
        ModelConfig(num_kv_heads=1, num_layers=3, ffn_dim=100, vocab_size=50),
    ],
)
def test_num_params_equals_built_model(cfg):
    model = init_model(cfg, 0)
    assert cfg.num_params() == sum(p.numel() for p in model.parameters())


def test_llama_7b_preset_parameter_count():
    cfg = MODEL_PRESETS["llama-7b"]  # the config only: 27 GB of float32 weights is not built here
    assert (cfg.vocab_size, cfg.dim, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.ffn_dim) == (
        32000, 4096, 32, 32, 32, 11008
    )  # fmt: skip
    assert cfg.num_params() == 6_738_415_616  # LLaMA-7B's published count (Touvron et al. 2023, "6.7B")


# ---- model ----


def test_init_is_deterministic_and_leaves_global_rng_alone():
    cfg = ModelConfig()
    rng = torch.get_rng_state()
    a, b, c = init_model(cfg, 7), init_model(cfg, 7), init_model(cfg, 8)
    assert torch.equal(torch.get_rng_state(), rng)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert list(sa) == list(sb)
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["layers.0.attention.wq.weight"], sc["layers.0.attention.wq.weight"])
    assert all(torch.equal(v, torch.ones_like(v)) for k, v in sa.items() if "norm" in k)
    # Residual outputs are scaled by 1/sqrt(2 * num_layers) (GPT-2): their std is half of the others' here.
    big = init_model(ModelConfig(dim=256, num_heads=8, num_kv_heads=4, ffn_dim=512), 0).state_dict()
    std = big["layers.0.feed_forward.w1.weight"].std().item()
    assert std == pytest.approx(0.02, rel=0.02)
    assert big["layers.0.feed_forward.w2.weight"].std().item() == pytest.approx(0.02 / 2, rel=0.02)


def test_rope_uses_the_passed_positions():
    model = init_model(ModelConfig(), 0)
    a, b = make_docs(1, [29, 17])
    with torch.no_grad():
        alone, _ = forward_packed(model, [a])
        shifted, batch = forward_packed(model, [b, a])  # a sits at packed offset 17, positions 0..28
        torch.testing.assert_close(shifted[17:], alone, rtol=1e-5, atol=1e-5)
        pos = batch.position_ids
        # RoPE scores depend on position differences only (2104.09864 Sec. 3.2): shifting a whole document's
        # positions keeps its logits (float64 angles keep that true far out) ...
        far = torch.cat([pos[:17], pos[17:] + 100_000])
        torch.testing.assert_close(forward_packed(model, [b, a], far)[0], shifted, rtol=1e-4, atol=1e-4)
        # ... while positions that do not step by one inside a document change them: RoPE reads position_ids.
        for wrong in (torch.zeros_like(pos), 2 * pos, pos.flip(0)):
            logits, _ = forward_packed(model, [b, a], position_ids=wrong)
            assert not torch.allclose(logits[17:], alone, rtol=1e-3, atol=1e-3)


def test_packed_batch_equals_documents_run_alone():
    model = init_model(ModelConfig(), 3)
    docs = make_docs(2, [23, 1, 40])
    embedded = []
    hook = model.tok_embeddings.register_forward_hook(lambda m, i, out: embedded.append(out) or out.retain_grad())
    logits, batch = forward_packed(model, docs)
    hook.remove()
    assert logits.shape == (64, 257) and logits.dtype == torch.float32
    for i, doc in enumerate(docs):
        alone, _ = forward_packed(model, [doc])
        lo, hi = int(batch.cu_seqlens[i]), int(batch.cu_seqlens[i + 1])
        torch.testing.assert_close(logits[lo:hi], alone, rtol=1e-5, atol=1e-5)
    # Block-diagonal causality: the loss of the last document has no gradient on earlier documents' tokens.
    lo = int(batch.cu_seqlens[2])
    loss_sum(logits[lo:], batch.labels[lo:]).backward()
    grad = embedded[0].grad  # (64, dim)
    assert torch.count_nonzero(grad[:lo]) == 0 and torch.count_nonzero(grad[lo:]) > 0


def test_next_token_labels_stop_at_document_boundaries():
    tokens = torch.tensor([10, 11, 12, 20, 30, 31])
    labels = next_token_labels(tokens, torch.tensor([0, 3, 4, 6]))
    assert labels.tolist() == [11, 12, IGNORE_INDEX, IGNORE_INDEX, 31, IGNORE_INDEX]
    assert labels.dtype == torch.int64
    with pytest.raises(ValueError, match="ends at 5 but the packed batch holds 6 tokens"):
        next_token_labels(tokens, torch.tensor([0, 5]))
    batch = pack_documents([np.array([1, 2, 3]), np.array([4]), torch.tensor([5, 6])])
    assert batch.labels.tolist() == [2, 3, -100, -100, 6, -100] and batch.n_predicted == 3
    assert batch.position_ids.tolist() == [0, 1, 2, 0, 0, 1] and batch.cu_seqlens.tolist() == [0, 3, 4, 6]


def test_loss_sum_counts_only_labelled_positions():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 7, generator=gen)
    labels = torch.tensor([1, IGNORE_INDEX, 6, 0, IGNORE_INDEX])
    keep = labels != IGNORE_INDEX
    want = -torch.log_softmax(logits, -1)[keep].gather(1, labels[keep, None]).sum()
    torch.testing.assert_close(loss_sum(logits, labels), want)
    nothing = logits.clone().requires_grad_()
    out = loss_sum(nothing, torch.full((5,), IGNORE_INDEX))
    out.backward()
    assert out.item() == 0.0 and torch.count_nonzero(nothing.grad) == 0


def test_out_of_range_tokens_are_rejected():
    with pytest.raises(ValueError, match=r"token id 257 at position 2 is outside the vocabulary \[0, 257\)"):
        check_token_range(torch.tensor([0, 5, 257, 3]), 257)
    with pytest.raises(ValueError, match=r"token id -1 at position 0 .* \[0, 10\) \(2 of 3 ids out of range\)"):
        check_token_range(torch.tensor([-1, 4, 12]), 10)
    with pytest.raises(ValueError, match="integer tensor"):
        check_token_range(torch.tensor([1.0]), 10)
    check_token_range(torch.tensor([0, 256]), 257)
    model = init_model(ModelConfig(vocab_size=16), 0)
    with pytest.raises(ValueError, match="token id 16 at position 1"):
        forward_packed(model, [torch.tensor([1, 16, 2])])
    with pytest.raises(ValueError, match="step 1, document 0: token id 300 at position 0"):
        reference_train(ModelConfig(), OptimConfig(), [[np.array([1, 2])], [np.array([300, 2])]], 0)


# ---- sharded parity over real gloo processes ----

SP_METHODS = {
    "ulysses": (ulysses_attn_varlen_func, shard_contiguous),
    "ring": (zigzag_ring_attn_varlen_func, shard_zigzag),
}
# Mixes: lengths not divisible by 2d, a length-1 document, one document longer than a shard.
LENGTHS = {"mixed": [37, 1, 64, 5, 23, 12], "long": [3, 97, 2, 30]}


def _check_sharded(ctx, reg, case):
    """Shard a packed batch over the case's group, forward + loss_sum + backward, compare with the reference."""
    ranks, method, cfg_kw, mix, seed = case
    if ctx.rank not in ranks:
        return 0
    import torch.distributed as dist

    attn_fn, shard_fn = SP_METHODS[method]
    cfg = ModelConfig(**cfg_kw)
    batch = pack_documents(make_docs(seed, LENGTHS[mix], cfg.vocab_size))
    ref_model = init_model(cfg, seed)
    ref_attn = functools.partial(varlen_attn_func, cu_seqlens=batch.cu_seqlens, max_seqlen=batch.max_seqlen)
    ref_logits = ref_model(batch.tokens, batch.position_ids, ref_attn)
    ref_loss = loss_sum(ref_logits, batch.labels)
    ref_loss.backward()

    group = reg.group(ranks)
    model = init_model(cfg, seed)
    ids, layout = shard_fn(batch.tokens, batch.cu_seqlens, ranks.index(ctx.rank), len(ranks))
    labels = shard(batch.labels, layout).masked_fill(~layout.loss_mask, IGNORE_INDEX)
    attn = functools.partial(attn_fn, cu_seqlens=layout.cu_seqlens, max_seqlen=layout.max_seqlen, group=group)
    logits = model(ids, layout.position_ids, attn)
    local = loss_sum(logits, labels)
    local.backward()

    msg = f"case {case}, rank {ctx.rank}"
    real = layout.loss_mask
    torch.testing.assert_close(logits[real], ref_logits[layout.index[real]], **PARITY_TOL, msg=lambda m: f"{msg}: {m}")
    names = [n for n, _ in model.named_parameters()]
    flat = torch.cat([local.detach().reshape(1)] + [p.grad.reshape(-1) for p in model.parameters()])
    dist.all_reduce(flat, group=group)  # sum over the group's ranks: loss sum, then every gradient
    torch.testing.assert_close(flat[0], ref_loss.detach(), **PARITY_TOL, msg=lambda m: f"{msg} loss: {m}")
    grads = flat[1:].split([p.numel() for p in model.parameters()])
    ref_params = dict(ref_model.named_parameters())
    for name, g in zip(names, grads, strict=True):
        want = ref_params[name].grad.reshape(-1)
        torch.testing.assert_close(g, want, **PARITY_TOL, msg=lambda m, n=name: f"{msg} grad {n}: {m}")
    return 1


def _sharded_job(ctx, groups, cases):
    torch.manual_seed(1234 + ctx.rank)  # a wrong global-RNG dependency would make ranks disagree
    with ctx.registry() as reg:
        reg.ensure(groups)
        return sum(_check_sharded(ctx, reg, case) for case in cases)


@pytest.fixture(scope="module")
def pool():
    p = DistPool(4)
    yield p
    p.close()


GQA, MHA, GQA1 = {}, {"num_kv_heads": 4}, {"num_kv_heads": 1, "tie_embeddings": True}


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ulysses", "ring"])
def test_sharded_model_matches_reference(pool, method):
    # d=1 on {0} and {3}, d=2 on {0,1} and {2,3} concurrently, then d=4; GQA with 2 KV heads at d=4 makes
    # Ulysses replicate KV heads (flexorch/workers/attention/ulysses.py); 1 KV head also covers tied embeddings.
    groups = [(0,), (3,), (0, 1), (2, 3), (0, 1, 2, 3)]
    cases = [
        ((0,), method, GQA, "mixed", 1),
        ((3,), method, MHA, "long", 2),
        ((0, 1), method, GQA, "mixed", 3),
        ((2, 3), method, MHA, "long", 4),
        ((0, 1), method, GQA1, "long", 5),
        ((2, 3), method, GQA1, "mixed", 6),
        ((0, 1, 2, 3), method, GQA, "mixed", 7),
        ((0, 1, 2, 3), method, MHA, "long", 8),
        ((0, 1, 2, 3), method, GQA1, "long", 9),
    ]
    done = pool.run(_sharded_job, groups, cases)
    assert done == [sum(r in c[0] for c in cases) for r in range(4)]


# ---- optimizer ----


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"lr": 0.0}, "lr must be a finite number > 0, got 0.0"),
        ({"weight_decay": -0.1}, "weight_decay must be >= 0, got -0.1"),
        ({"betas": (0.9, 1.0)}, r"betas must be two numbers in \[0, 1\), got \(0.9, 1.0\)"),
        ({"betas": (0.9,)}, "betas must be two numbers"),
        ({"eps": 0}, "eps must be > 0"),
        ({"warmup_steps": -1}, "warmup_steps must be an integer >= 0, got -1"),
        ({"decay_steps": 0}, "decay_steps must be None or an integer >= 1, got 0"),
        ({"min_lr_ratio": 1.5}, r"min_lr_ratio must be in \[0, 1\], got 1.5"),
        ({"grad_clip": 0.0}, "grad_clip must be None or a number > 0, got 0.0"),
    ],
)
def test_optim_config_validation(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        OptimConfig(**kwargs)


def test_lr_schedule():
    cfg = OptimConfig(lr=1.0, warmup_steps=4, decay_steps=10, min_lr_ratio=0.1)
    assert [lr_at(s, cfg) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(4, cfg) == 1.0
    assert lr_at(9, cfg) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(14, cfg) == pytest.approx(0.1) and lr_at(1000, cfg) == pytest.approx(0.1)
    assert lr_at(50, OptimConfig(lr=2e-3, warmup_steps=0)) == 2e-3
    assert OptimConfig(betas=[0.8, 0.9]).betas == (0.8, 0.9)


def test_build_optimizer_decays_only_matrices():
    model = init_model(ModelConfig(), 0)
    opt, _ = build_optimizer(model, OptimConfig(weight_decay=0.05))
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.05 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() == 2 for p in decay["params"]) and all(p.dim() == 1 for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))
    assert decay["foreach"] is False and not decay["fused"]


def test_clip_grad_norm_returns_the_norm_before_clipping():
    ps = [torch.zeros(3, requires_grad=True), torch.zeros(2, 2, requires_grad=True)]
    ps[0].grad, ps[1].grad = torch.tensor([3.0, 0.0, 0.0]), torch.tensor([[0.0, 4.0], [0.0, 0.0]])
    assert clip_grad_norm_(ps, 1.0) == pytest.approx(5.0)
    torch.testing.assert_close(torch.cat([p.grad.reshape(-1) for p in ps]).norm(), torch.tensor(1.0))


# ---- reference ----

BATCHES = [make_docs(10 + s, [31, 1, 17, 9]) for s in range(3)]


def test_reference_train_is_bitwise_reproducible():
    cfg, ocfg = ModelConfig(), OptimConfig(warmup_steps=2, decay_steps=2)
    losses_a, state_a = reference_train(cfg, ocfg, BATCHES, seed=5)
    losses_b, state_b = reference_train(cfg, ocfg, [[d.numpy() for d in b] for b in BATCHES], seed=5)
    assert len(losses_a) == 3 and all(math.isfinite(x) for x in losses_a)
    assert losses_a == losses_b
    assert list(state_a) == list(state_b) and all(torch.equal(state_a[k], state_b[k]) for k in state_a)
    initial = init_model(cfg, 5).state_dict()
    assert all(not torch.equal(state_a[k], initial[k]) for k in state_a)  # every parameter was trained


def test_reference_step_loss_and_lr_schedule():
    cfg, ocfg = ModelConfig(), OptimConfig(lr=1e-2, warmup_steps=2, decay_steps=3, grad_clip=0.5)
    model = init_model(cfg, 0)
    opt, sched = build_optimizer(model, ocfg)
    for step, docs in enumerate(BATCHES + BATCHES[:2]):
        assert all(g["lr"] == lr_at(step, ocfg) for g in opt.param_groups)  # bitwise: the lr this step uses
        batch = pack_documents(docs)
        with torch.no_grad():
            want = reference_loss_sum(model, batch).item() / batch.n_predicted
        assert batch.n_predicted == 31 + 17 + 9 - 3
        assert reference_step(model, opt, sched, docs, ocfg) == pytest.approx(want, rel=1e-6)
    with pytest.raises(ValueError, match="have no token to predict .length 1, or no target."):
        reference_step(model, opt, sched, [torch.tensor([3]), torch.tensor([4])], ocfg)


# ---- activation memory ----


def test_activation_bytes_grow_linearly_with_tokens():
    model = init_model(ModelConfig(), 0)
    measured = []
    for lengths in ([100, 28, 128], [200, 56, 256]):
        b = pack_documents(make_docs(0, lengths))
        attn = functools.partial(varlen_attn_func, cu_seqlens=b.cu_seqlens, max_seqlen=b.max_seqlen)
        measured.append(measure_activation_bytes(model, b.tokens, b.position_ids, attn))
    assert measured[0] > 256 * 4 * ModelConfig().dim  # at least a few float32 vectors of width dim per token
    assert measured[1] / measured[0] == pytest.approx(2.0, rel=0.1)
    assert all(p.grad is None for p in model.parameters())  # nothing ran backward


def test_saved_tensor_meter_dedupes_storages_and_skips_parameters():
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8, requires_grad=True)
    with saved_tensor_meter([w]) as meter:
        y = x @ w  # saves x and w
        z = (x * 2.0).sum() + (x @ w.t()).sum()  # saves x again (same storage) and w.t() (w's storage)
    assert meter.saved_tensors >= 4
    assert meter.bytes == x.untyped_storage().nbytes()
    del y, z
