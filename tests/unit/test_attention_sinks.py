"""GPT-OSS's attention sinks (a learned logit per head in every row's softmax: ``kernels.with_sinks``) are exact
under every SP kind: single device against Transformers' own ``gpt_oss`` eager attention (an oracle we did not
write), and Ulysses, the zigzag ring and hybrid on real gloo processes against a float64 dense reference with the
sink as an extra key of zero value: out, lse, dq, dk, dv and the sinks' gradient (summed over the ranks, as the
step's gradient sync does), with and without a sliding window, within 1e-10."""

from __future__ import annotations

import types

import pytest
import torch

from flexorch.work.step import hybrid_sub_groups
from flexorch.workers.attention.api import (
    hybrid_attn_varlen_func,
    ulysses_attn_varlen_func,
    varlen_attn_func,
    zigzag_ring_attn_varlen_func,
)
from flexorch.workers.attention.sharding import contiguous_layout, hybrid_layout, shard, zigzag_layout
from tests._dist_utils import DistPool
from tests.unit.test_sp_attention import make_case

TOL = {"rtol": 1e-10, "atol": 1e-10}
LENGTHS = [1, 23, 40, 6, 17]
HEADS = {"gqa": (4, 2), "mha": (4, 4)}


def reference(q, k, v, sinks, offsets, window=None):
    """Dense attention over the packed documents, causal (within ``window``), each row's softmax over its keys and
    its head's sink logit (a key whose value is zero); autograd. -> (out (t, h, hd), lse (h, t))."""
    t, h = q.shape[:2]
    lengths = torch.tensor([b - a for a, b in zip(offsets[:-1], offsets[1:], strict=True)])
    doc = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    pos = torch.arange(t)
    allowed = (doc[:, None] == doc[None, :]) & (pos[:, None] >= pos[None, :])
    if window is not None:
        allowed &= pos[:, None] - pos[None, :] < window
    g = h // k.shape[1]
    s = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(g, 1)) * q.shape[2] ** -0.5
    s = torch.cat([s.masked_fill(~allowed, float("-inf")), sinks[:, None, None].expand(h, t, 1)], -1)  # + sink
    p = torch.softmax(s, -1)[..., :-1]  # the sink's column dropped: its value is zero
    return torch.einsum("hqk,khd->qhd", p, v.repeat_interleave(g, 1)), torch.logsumexp(s, -1)


def expected(seed, heads, window):
    q, k, v, dout, offsets = make_case(seed, LENGTHS, *HEADS[heads])
    sinks = torch.randn(q.shape[1], generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, sinks)]
    out, lse = reference(*leaves[:3], leaves[3], offsets, window)
    out.backward(dout)
    return (q, k, v, sinks, dout, offsets), (out.detach(), lse.detach(), *(x.grad for x in leaves))


def test_single_device_sinks_equal_transformers_gpt_oss_eager_attention():
    """One document: ``varlen_attn_func(sinks=)`` is GPT-OSS's own eager attention (its sink column concatenated to
    the scores, dropped after the softmax), forward and backward, sinks' gradient included."""
    gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    q, k, v, dout, _ = make_case(3, [29], 4, 2)
    sinks = torch.randn(4, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    ours = [x.clone().requires_grad_() for x in (q, k, v, sinks)]
    out = varlen_attn_func(*ours[:3], torch.tensor([0, 29]), 29, sinks=ours[3])
    out.backward(dout)
    theirs = [x.clone().requires_grad_() for x in (q, k, v, sinks)]
    module = types.SimpleNamespace(sinks=theirs[3], num_key_value_groups=2, training=False)
    mask = torch.full((29, 29), float("-inf"), dtype=torch.float64).triu(1)[None, None]  # causal, additive
    ref, _ = gpt_oss.eager_attention_forward(
        module, *(x.transpose(0, 1)[None] for x in theirs[:3]), mask, scaling=16**-0.5
    )  # (t, h, hd) -> (1, h, t, hd) in, (1, t, h, hd) out
    ref[0].backward(dout)
    torch.testing.assert_close(out, ref[0], **TOL)
    for a, b, name in zip(ours, theirs, ("q", "k", "v", "sinks"), strict=True):
        torch.testing.assert_close(a.grad, b.grad, **TOL, msg=lambda m, n=name: f"d{n}: {m}")


@pytest.mark.parametrize("window", [None, 7])
def test_single_device_sinks_equal_the_reference_on_packed_documents(window):
    (q, k, v, sinks, dout, offsets), want = expected(11, "gqa", window)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, sinks)]
    out, lse = varlen_attn_func(*leaves[:3], torch.tensor(offsets), None, sinks=leaves[3], return_lse=True,
                                window=window)  # fmt: skip
    out.backward(dout)
    for got, ref in zip((out, lse, *(x.grad for x in leaves)), want, strict=True):
        torch.testing.assert_close(got, ref, **TOL)


def test_sinks_of_the_wrong_shape_are_refused():
    q = torch.randn(8, 4, 16)
    with pytest.raises(ValueError, match=r"one logit per query head \(4,\), got \(2,\)"):
        varlen_attn_func(q, q, q, torch.tensor([0, 8]), None, sinks=torch.zeros(2))


METHODS = {
    "ulysses": (ulysses_attn_varlen_func, contiguous_layout),
    "ring": (zigzag_ring_attn_varlen_func, zigzag_layout),
    "hybrid": (hybrid_attn_varlen_func, None),
}


def _check(ctx, reg, case):
    """This rank's part of one case: out, lse and q/k/v gradients at its tokens checked here; its sinks' gradient
    returned (the test sums the group's). None off the group."""
    method, ranks, heads, window, seed = case
    if ctx.rank not in ranks:
        return None
    (q, k, v, sinks, dout, offsets), want = expected(seed, heads, window)
    rank, d = ranks.index(ctx.rank), len(ranks)
    fn, layout_fn = METHODS[method]
    if method == "hybrid":  # Ulysses over pairs of ranks, a ring across them
        layout = hybrid_layout(offsets, rank, d, 2)
        groups = tuple(reg.group(s) for s in hybrid_sub_groups(ranks, 2, ctx.rank))
    else:
        layout, groups = layout_fn(offsets, rank, d), (reg.group(ranks),)
    local = [shard(x, layout).requires_grad_() for x in (q, k, v)]
    mine = sinks.clone().requires_grad_()
    out, lse = fn(*local, layout.cu_seqlens, layout.max_seqlen, *groups, return_lse=True, window=window, sinks=mine)
    out.backward(shard(dout, layout))
    real, idx = layout.loss_mask, layout.index[layout.loss_mask]
    msg = f"case {case}"
    torch.testing.assert_close(out[real], want[0][idx], **TOL, msg=lambda m: f"{msg} out: {m}")
    torch.testing.assert_close(lse[:, real], want[1][:, idx], **TOL, msg=lambda m: f"{msg} lse: {m}")
    for name, x, ref in zip("qkv", local, want[2:5], strict=True):
        torch.testing.assert_close(x.grad[real], ref[idx], **TOL, msg=lambda m, n=name: f"{msg} d{n}: {m}")
    return mine.grad


def _job(ctx, groups, cases):
    with ctx.registry() as reg:
        reg.ensure(groups)
        return [_check(ctx, reg, case) for case in cases]


@pytest.fixture(scope="module")
def pool():
    p = DistPool(4)
    yield p
    p.close()


@pytest.mark.slow
def test_sinks_are_exact_under_ulysses_ring_and_hybrid(pool):
    four = (0, 1, 2, 3)
    groups = [(0, 1), (2, 3), four, (0, 2), (1, 3)]  # hybrid of 4: Ulysses pairs {0,1}, {2,3}; rings {0,2}, {1,3}
    cases, seed = [], 700
    for method, ranks in (("ulysses", (0, 1)), ("ulysses", four), ("ring", (2, 3)), ("ring", four),
                          ("hybrid", four)):  # fmt: skip
        for heads, window in (("gqa", None), ("mha", 9)):
            seed += 1
            cases.append((method, ranks, heads, window, seed))
    results = pool.run(_job, groups, cases)
    for i, case in enumerate(cases):
        dsinks = sum(results[r][i] for r in case[1])  # the gradient sync sums the ranks' gradients
        torch.testing.assert_close(dsinks, expected(case[4], case[2], case[3])[1][5], **TOL, msg=f"case {case}")
