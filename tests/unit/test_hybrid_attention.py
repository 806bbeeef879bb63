"""Hybrid sequence parallelism (Ulysses over u ranks x zigzag ring over r) is exact.

Real processes, real gloo: one pool of 6 spawned processes per module. The hybrid groups are ranks 2..5 (u = r = 2,
not aligned to their degree) while ranks 0, 1 are not members and run a degree-2 group of their own at the same time,
and ranks 0..3 (aligned). Each case compares output, LSE and the q/k/v gradients with the float64 dense reference of
``test_sp_attention`` (itself checked against torch's SDPA in ``test_attention_dtypes``) at fp64, rtol = atol =
1e-10; the model-level case compares a whole decoder's loss and gradients on a hybrid group with a Ulysses group and
one device. The multi-process tests are ``slow`` (as in ``test_sp_attention``); the layout and sub-group tests are
pure.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from flexorch.work.step import GroupWork, StepWork, hybrid_sub_groups, sp_rank_sets
from flexorch.workers.attention.hybrid import hybrid_attn_varlen_func
from flexorch.workers.attention.sharding import hybrid_layout, shard, unshard, zigzag_layout
from tests._dist_utils import DistPool
from tests.unit.test_sp_attention import MIXES, expected, make_case

TOL = {"rtol": 1e-10, "atol": 1e-10}
# (query heads, KV heads) with u = 2: MHA; GQA with u | h_kv; u > h_kv (KV heads repeated); u < h_kv, u not | h_kv
HEADS = {"mha": (4, 4), "gqa": (4, 2), "u_beyond_kv": (4, 1), "kv3": (6, 3)}
HYBRID_RANKS = ((2, 3, 4, 5), (0, 1, 2, 3))  # unaligned, aligned
U = 2


def _sub_groups(reg, ranks, rank):
    return tuple(reg.group(s) for s in hybrid_sub_groups(ranks, U, rank))


def _check_hybrid(ctx, reg, ranks, mix, heads, seed, dtype=torch.float64, backend=None, tol=TOL, window=None):
    """One hybrid case on ``ranks``: out, LSE, dq, dk, dv against the reference; 1 on members, 0 elsewhere."""
    if ctx.rank not in ranks:
        return 0
    q, k, v, dout, offsets = make_case(seed, MIXES[mix], *HEADS[heads])
    q, k, v, dout = (x.to(dtype).double() for x in (q, k, v, dout))  # the reference sees the rounded inputs
    ref = expected(q, k, v, dout, offsets, True, window)
    layout = hybrid_layout(offsets, ranks.index(ctx.rank), len(ranks), U)
    local = [shard(x, layout).to(dtype).requires_grad_() for x in (q, k, v)]
    ulysses_group, ring_group = _sub_groups(reg, ranks, ctx.rank)
    out, lse = hybrid_attn_varlen_func(
        *local, layout.cu_seqlens, layout.max_seqlen, ulysses_group, ring_group, return_lse=True, backend=backend,
        window=window,
    )  # fmt: skip
    assert out.dtype == dtype
    out.backward(shard(dout, layout).to(dtype))
    real, idx = layout.loss_mask, layout.index[layout.loss_mask]
    msg = f"ranks {ranks} {mix} {heads} {dtype} {backend} window {window}"
    torch.testing.assert_close(out[real].double(), ref[0][idx], **tol, msg=lambda m: f"{msg} out: {m}")
    torch.testing.assert_close(lse[:, real].double(), ref[1][:, idx], **tol, msg=lambda m: f"{msg} lse: {m}")
    for name, x, want in zip("qkv", local, ref[2:], strict=True):
        torch.testing.assert_close(x.grad[real].double(), want[idx], **tol, msg=lambda m, n=name: f"{msg} d{n}: {m}")
        assert torch.count_nonzero(x.grad[~real]) == 0, f"{msg}: gradient on padding in d{name}"
    return 1


def _ring_pair_case(ctx, reg, seed):
    """Ranks 0, 1 (not members of the unaligned hybrid group) run a zigzag ring of their own meanwhile."""
    from flexorch.workers.attention.api import zigzag_ring_attn_varlen_func

    q, k, v, dout, offsets = make_case(seed, MIXES["random"], 4, 2)
    ref = expected(q, k, v, dout, offsets, True)
    layout = zigzag_layout(offsets, ctx.rank, 2)
    local = [shard(x, layout).requires_grad_() for x in (q, k, v)]
    out = zigzag_ring_attn_varlen_func(*local, layout.cu_seqlens, layout.max_seqlen, reg.group((0, 1)))
    out.backward(shard(dout, layout))
    real, idx = layout.loss_mask, layout.index[layout.loss_mask]
    torch.testing.assert_close(out[real], ref[0][idx], **TOL)
    torch.testing.assert_close(local[1].grad[real], ref[3][idx], **TOL)


def _hybrid_sets(*groups):
    return sp_rank_sets([GroupWork(0, ranks, "hybrid", (), ulysses_degree=U) for ranks in groups])


def _parity_job(ctx, cases):
    with ctx.registry() as reg:
        reg.ensure([(0, 1), *_hybrid_sets(*HYBRID_RANKS)])
        done = 0
        for ranks, mix, heads, seed, *rest in cases:
            if ranks == HYBRID_RANKS[0] and ctx.rank in (0, 1):
                _ring_pair_case(ctx, reg, seed)
            done += _check_hybrid(ctx, reg, ranks, mix, heads, seed, *rest)
        return done


@pytest.fixture(scope="module")
def pool():
    p = DistPool(6)
    yield p
    p.close()


@pytest.mark.slow
def test_hybrid_fp64_matches_the_reference(pool):
    # every head shape x every document mix (a length-1 document and lengths not divisible by 2r = 4, one document
    # spanning the batch, 40 tiny documents), alternating the unaligned and the aligned group
    cases = []
    for i, (heads, mix) in enumerate((h, m) for h in HEADS for m in MIXES):
        cases.append((HYBRID_RANKS[i % 2], mix, heads, 10 + i))
    cases.append((HYBRID_RANKS[0], "random", "u_beyond_kv", 50, torch.float64, "math"))  # the device-agnostic kernel
    done = pool.run(_parity_job, cases)
    assert done == [sum(r in c[0] for c in cases) for r in range(6)]


@pytest.mark.slow
def test_hybrid_low_precision_within_dtype_tolerance(pool):
    # fp32 and bf16 accumulate in float32 (the ring's merge, the LSE) and stay within their own tolerance
    tol32, tol16 = {"rtol": 2e-5, "atol": 2e-5}, {"rtol": 6e-2, "atol": 6e-2}
    cases = [
        (HYBRID_RANKS[0], "random", "gqa", 60, torch.float32, None, tol32),
        (HYBRID_RANKS[1], "random", "u_beyond_kv", 61, torch.bfloat16, None, tol16),
    ]
    assert pool.run(_parity_job, cases) == [sum(r in c[0] for c in cases) for r in range(6)]


@pytest.mark.slow
def test_hybrid_sliding_window_fp64(pool):
    # the window flows through the all-to-all into the ring: the 77-token document's ring chunks (20 tokens) lie
    # beyond a window of 5 from 2 chunks on (skipped), one chunk apart at its edge; windows of 1 and 9 too
    cases = [
        (HYBRID_RANKS[0], "one_doc", "gqa", 70, torch.float64, None, TOL, 5),
        (HYBRID_RANKS[1], "random", "u_beyond_kv", 71, torch.float64, None, TOL, 9),
        (HYBRID_RANKS[0], "tiny", "kv3", 72, torch.float64, "math", TOL, 1),
    ]
    assert pool.run(_parity_job, cases) == [sum(r in c[0] for c in cases) for r in range(6)]


def _bad_input_job(ctx):
    """Bad input raises ValueError on every member before any collective; the sub-groups stay usable."""
    ranks = HYBRID_RANKS[1]
    with ctx.registry() as reg:
        reg.ensure(_hybrid_sets(ranks))
        if ctx.rank not in ranks:
            return 0
        groups = _sub_groups(reg, ranks, ctx.rank)
        x = torch.randn(4, 4, 8, dtype=torch.float64)
        bad = [
            ((torch.randn(4, 3, 8), torch.randn(4, 3, 8), torch.randn(4, 3, 8), [0, 16]), {}, "3 query heads"),
            ((x, x, x, [0, 6, 16]), {}, r"document 0 has 6 tokens, not a multiple of 2 \* degree = 4"),
            ((x, x, x, [0, 12]), {}, "ends at 12 but .* 16 tokens"),
            ((x, x, x, [0, 16]), {"causal": False}, "causal=True only"),
            ((x, x, x, [0, 16]), {"window": -2}, "window must be an int >= 1.*got -2"),
        ]
        raised = 0
        for args, kw, pattern in bad:
            try:
                hybrid_attn_varlen_func(*args[:3], torch.tensor(args[3]), None, *groups, **kw)
            except ValueError as e:
                assert re.search(pattern, str(e)), f"{e!r} does not match {pattern!r}"
                raised += 1
        out = hybrid_attn_varlen_func(x, x, x, torch.tensor([0, 16]), None, *groups)
        assert out.shape == x.shape and torch.isfinite(out).all()
        return raised


@pytest.mark.slow
def test_hybrid_bad_input_raises_before_any_collective(pool):
    assert pool.run(_bad_input_job, timeout_s=60) == [5, 5, 5, 5, 0, 0]


# ---- the model: a hybrid group's loss and gradients equal a Ulysses group's and one device's ----


def _model_grads(ctx, reg, work, blocks, cfg):
    """Summed loss and world-summed parameter gradients of ``work`` through ``step_exec.MicroBatches``."""
    import torch.distributed as dist

    from flexorch.config.optim import OptimConfig
    from flexorch.workers.model_source import build_model
    from flexorch.workers.step_context import StepContext
    from flexorch.workers.step_exec import MicroBatches

    model = build_model(cfg, 7)
    params = list(model.parameters())
    mine = (work,) if ctx.rank in work.ranks else ()
    rank_work = StepWork(0, ctx.rank, ctx.world_size, tuple(sp_rank_sets([work])), mine, 10**6)
    step_ctx = StepContext(model, None, None, reg.group, reg.world, OptimConfig(), vocab_size=cfg.vocab_size)
    run = MicroBatches(step_ctx, rank_work, blocks, params, torch.device("cpu"))
    if ctx.rank in work.ranks:
        run.run(work)
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
    stats = torch.cat([flat.double(), run.loss.reshape(1), torch.tensor([float(run.predicted)], dtype=torch.float64)])
    dist.all_reduce(stats, group=reg.world)
    return stats


def _model_job(ctx):
    from flexorch.config.model import ModelConfig
    from flexorch.work.step import DocRef

    cfg = ModelConfig(vocab_size=61, dim=32, num_layers=2, num_heads=4, num_kv_heads=1, ffn_dim=48)  # u > h_kv
    lengths = [10, 1, 23, 5, 8, 3]
    rng = np.random.default_rng(0)
    blocks = {0: rng.integers(0, cfg.vocab_size, sum(lengths)).astype(np.int32)}
    starts = np.cumsum([0, *lengths])
    docs = tuple(DocRef(i, 0, int(starts[i]), n) for i, n in enumerate(lengths))
    ranks = HYBRID_RANKS[0]
    works = {
        "hybrid": GroupWork(0, ranks, "hybrid", docs, ulysses_degree=U),
        "ulysses": GroupWork(0, ranks, "ulysses", docs),
        "one": GroupWork(0, (ctx.rank,), "ulysses", docs),  # every rank alone: the single-device result
    }
    out = {}
    for name, work in works.items():
        with ctx.registry(epoch_offset=len(out)) as reg:
            reg.ensure([ranks, *_hybrid_sets(ranks)])  # the Ulysses group, the hybrid blocks and rings
            out[name] = _model_grads(ctx, reg, work, blocks, cfg)
    one = out["one"] / ctx.world_size  # the world summed 6 identical single-device runs
    assert int(one[-1]) == sum(n - 1 for n in lengths)
    for name in ("hybrid", "ulysses"):
        torch.testing.assert_close(out[name], one, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    return float((out["hybrid"] - out["ulysses"]).abs().max())


@pytest.mark.slow
def test_hybrid_group_trains_like_a_ulysses_group(pool):
    diffs = pool.run(_model_job)
    assert max(diffs) < 1e-5


# ---- pure: the layout and the sub-groups ----


@pytest.mark.parametrize(("u", "r"), [(2, 2), (4, 2), (2, 4), (1, 4), (4, 1)])
def test_hybrid_layout_holds_every_token_once(u, r):
    offsets = [0, 1, 14, 54, 61, 90]
    d = u * r
    layouts = [hybrid_layout(offsets, g, d, u) for g in range(d)]
    x = torch.arange(90.0)
    assert torch.equal(unshard([shard(x, lay) for lay in layouts], layouts, 90), x)
    assert len({lay.index.numel() for lay in layouts}) == 1  # equal shards: what the all-to-all needs
    padded = layouts[0].cu_seqlens.tolist()
    assert all((b - a) % (2 * r) == 0 for a, b in zip(padded[:-1], padded[1:], strict=True))
    for j in range(r):  # ring position j's u pieces, in order, are the zigzag shard of a ring of r
        ring = zigzag_layout(padded, j, r)
        pieces = torch.cat([layouts[j * u + i].position_ids for i in range(u)])
        assert torch.equal(pieces, ring.position_ids)
    for lay in layouts:  # a real token's position is its place in its own (original) document
        idx = lay.index[lay.loss_mask]
        doc = torch.searchsorted(torch.tensor(offsets), idx, right=True) - 1
        assert torch.equal(lay.position_ids[lay.loss_mask], idx - torch.tensor(offsets)[doc])


def test_hybrid_sub_groups_and_rank_sets():
    ranks = (2, 3, 4, 5, 6, 7, 8, 9)
    assert hybrid_sub_groups(ranks, 2, 5) == ((4, 5), (3, 5, 7, 9))
    assert hybrid_sub_groups(ranks, 4, 5) == ((2, 3, 4, 5), (5, 9))
    work = GroupWork(0, ranks, "hybrid", (), ulysses_degree=4)
    # the blocks and rings only: the whole group has no collective of its own
    assert sp_rank_sets([work]) == [(2, 6), (3, 7), (4, 8), (5, 9), (2, 3, 4, 5), (6, 7, 8, 9)]
    with pytest.raises(ValueError, match=r"group \(2, .*, 9\) needs \[\(2, 6\), \(3, 7\)"):
        StepWork(0, 2, 10, (ranks, (2, 3, 4, 5), (4, 8)), (work,), 0)
    assert StepWork(0, 2, 10, tuple(sp_rank_sets([work])), (work,), 0).work == (work,)


def test_step_work_of_a_plan_creates_a_hybrid_groups_blocks_and_rings():
    from flexorch.solver.plan import Group, MicroBatch, Plan
    from flexorch.work.step import DocRef, step_work

    groups = (Group(2, "ring", (0, 1), (2,)), Group(4, "hybrid", (2, 3, 4, 5), (0, 1), ulysses_degree=2))
    plan = Plan(6, (30, 9, 12), (MicroBatch(groups),), tokens_per_device=100, num_heads=4)
    tasks = step_work(plan, [DocRef(i, 0, 0, n) for i, n in enumerate(plan.seq_lengths)], step=0)
    assert {t.rank_sets for t in tasks} == {((0, 1), (2, 3), (2, 4), (3, 5), (4, 5))}
    assert [w.ulysses_degree for w in tasks[3].work] == [2] and tasks[3].work[0].ranks == (2, 3, 4, 5)
