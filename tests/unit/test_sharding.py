"""Per-rank layouts are pure functions: checked by looping over every rank in one process."""

from __future__ import annotations

import random

import pytest
import torch

from flexorch.workers.attention.kernels import Seqlens
from flexorch.workers.attention.ring import zigzag_blocks
from flexorch.workers.attention.sharding import (
    check_cu_seqlens,
    contiguous_layout,
    shard_contiguous,
    shard_zigzag,
    unshard_contiguous,
    unshard_zigzag,
    zigzag_layout,
)

_rng = random.Random(0)
MIXES = {
    "one": [1],
    "single_doc": [37],
    "random": [1] + [_rng.randint(1, 40) for _ in range(9)],
    "tiny": [_rng.randint(1, 3) for _ in range(30)],
    "aligned": [8, 16, 24],
}


def offsets_of(lengths):
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def positions_in_doc(offsets):
    return torch.cat([torch.arange(b - a) for a, b in zip(offsets[:-1], offsets[1:], strict=True)])


@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("d", [1, 2, 3, 4])
@pytest.mark.parametrize("kind", ["contiguous", "zigzag"])
def test_layout_round_trip_and_metadata(kind, d, mix):
    offsets = offsets_of(MIXES[mix])
    total = offsets[-1]
    tokens = torch.randn(total, 3, 2)
    shard_fn, unshard_fn = (
        (shard_contiguous, unshard_contiguous) if kind == "contiguous" else (shard_zigzag, unshard_zigzag)
    )
    shards = [shard_fn(tokens, torch.tensor(offsets), r, d) for r in range(d)]
    locals_, layouts = zip(*shards, strict=True)
    # Every rank holds the same number of tokens and the same global (padded) boundaries.
    assert len({x.shape[0] for x in locals_}) == 1
    assert all(torch.equal(lay.cu_seqlens, layouts[0].cu_seqlens) for lay in layouts)
    padded = layouts[0].cu_seqlens.tolist()
    assert padded[-1] == d * locals_[0].shape[0]
    # Real tokens: each original token exactly once; padding is zero and masked.
    real = torch.cat([lay.index[lay.loss_mask] for lay in layouts])
    assert torch.equal(real.sort().values, torch.arange(total))
    for x, lay in zip(locals_, layouts, strict=True):
        assert torch.equal(x[lay.loss_mask], tokens[lay.index[lay.loss_mask]])
        assert torch.count_nonzero(x[~lay.loss_mask]) == 0
        # RoPE positions are positions inside the document in the unsharded sequence.
        assert torch.equal(lay.position_ids[lay.loss_mask], positions_in_doc(offsets)[lay.index[lay.loss_mask]])
        assert lay.local_cu_seqlens[0] == 0 and lay.local_cu_seqlens[-1] == x.shape[0]
        assert lay.max_seqlen == max(b - a for a, b in zip(padded[:-1], padded[1:], strict=True))
    assert torch.equal(unshard_fn(list(locals_), offsets), tokens)


@pytest.mark.parametrize("d", [1, 2, 4])
def test_contiguous_pieces_are_consecutive(d):
    offsets = offsets_of(MIXES["random"])
    layouts = [contiguous_layout(offsets, r, d) for r in range(d)]
    total = offsets[-1]
    padded_total = layouts[0].cu_seqlens[-1].item()
    assert padded_total - total == -total % d
    # Concatenating the ranks' pieces in rank order gives the batch followed by its padding.
    index = torch.cat([lay.index for lay in layouts])
    assert torch.equal(index[:total], torch.arange(total)) and (index[total:] == -1).all()
    # The padding is one extra document (nobody attends to it) when the batch is not divisible by d.
    assert layouts[0].cu_seqlens.tolist()[: len(offsets)] == offsets


@pytest.mark.parametrize("d", [1, 2, 3, 4])
def test_zigzag_rank_holds_chunks_r_and_2d_minus_1_minus_r(d):
    offsets = offsets_of(MIXES["random"])
    layouts = [zigzag_layout(offsets, r, d) for r in range(d)]
    padded = layouts[0].cu_seqlens.tolist()
    assert all(
        (b - a) % (2 * d) == 0 and b - a - (2 * d) < ob - oa
        for a, b, oa, ob in zip(padded[:-1], padded[1:], offsets[:-1], offsets[1:], strict=True)
    )
    for r, lay in enumerate(layouts):
        assert lay.local_cu_seqlens.tolist() == [x // d for x in padded]
        for i in range(len(offsets) - 1):
            c = (padded[i + 1] - padded[i]) // (2 * d)
            a = lay.local_cu_seqlens[i].item()
            pos = lay.position_ids[a : a + 2 * c]
            want = torch.cat([torch.arange(r * c, (r + 1) * c), torch.arange((2 * d - 1 - r) * c, (2 * d - r) * c)])
            assert torch.equal(pos, want), (r, i)


@pytest.mark.parametrize("d", [2, 4])
def test_zigzag_balances_causal_work(d):
    # Causal (query, key) pairs per rank: zigzag gives every rank the same count for aligned documents.
    offsets = offsets_of([16 * d, 8 * d, 2 * d])
    work = []
    for r in range(d):
        lay = zigzag_layout(offsets, r, d)
        work.append(int((lay.position_ids + 1).sum()))  # a query at position p sees p + 1 keys
    assert len(set(work)) == 1, work
    contiguous = [int((contiguous_layout([0, 16 * d], r, d).position_ids + 1).sum()) for r in range(d)]
    assert contiguous[-1] > 2 * contiguous[0]  # the imbalance that zigzag removes


@pytest.mark.parametrize("d", [1, 2, 4])
def test_zigzag_blocks_match_layout(d):
    offsets = offsets_of(MIXES["random"])
    for r in range(d):
        lay = zigzag_layout(offsets, r, d)
        blocks = zigzag_blocks(Seqlens(tuple(lay.cu_seqlens.tolist())), d)
        padded = lay.cu_seqlens.tolist()
        chunk = torch.repeat_interleave(
            torch.tensor([(b - a) // (2 * d) for a, b in zip(padded[:-1], padded[1:], strict=True)]),
            torch.tensor([(b - a) // d for a, b in zip(padded[:-1], padded[1:], strict=True)]),
        )
        is_front = lay.position_ids < (r + 1) * chunk
        assert torch.equal(torch.arange(len(is_front))[blocks.front], torch.nonzero(is_front).flatten())
        assert torch.equal(torch.arange(len(is_front))[blocks.back], torch.nonzero(~is_front).flatten())
        assert blocks.half.offsets == tuple(x // (2 * d) for x in padded)


def test_zigzag_blocks_reject_unaligned_documents():
    with pytest.raises(ValueError, match="document 1 has 6 tokens, not a multiple of 2 \\* degree = 4"):
        zigzag_blocks(Seqlens((0, 4, 10)), 2)


@pytest.mark.parametrize(
    ("cu", "total", "match"),
    [
        ([0, 3, 3, 5], 5, "strictly increasing"),
        ([0, 4, 2], 2, "strictly increasing"),
        ([1, 4], 4, "start at 0"),
        ([0], 0, "at least one document"),
        ([0, 4, 9], 8, "ends at 9 but the packed batch holds 8 tokens"),
        (torch.tensor([[0, 4]]), None, "1-D integer tensor"),
        (torch.tensor([0.0, 4.0]), None, "1-D integer tensor"),
    ],
)
def test_bad_cu_seqlens(cu, total, match):
    with pytest.raises(ValueError, match=match):
        check_cu_seqlens(cu, total)


def test_bad_rank_and_mismatched_tokens():
    with pytest.raises(ValueError, match="rank=2 world_size=2"):
        zigzag_layout([0, 4], 2, 2)
    with pytest.raises(ValueError, match="ends at 4 but the packed batch holds 5 tokens"):
        shard_contiguous(torch.zeros(5), [0, 4], 0, 2)
    assert unshard_zigzag([torch.ones(4), torch.ones(4)], [0, 6]).shape == (6,)
    with pytest.raises(ValueError, match="shard has 3 tokens, its layout 4"):
        unshard_zigzag([torch.zeros(3), torch.zeros(3)], [0, 6])
