"""Ulysses sequence parallelism: all-to-all from sequence shards to head shards, attention, all-to-all back.

DeepSpeed-Ulysses (Jacobs et al., arXiv 2309.14509, Sec. 3): each rank holds a contiguous slice ``s/d`` of the
packed batch with all ``h`` heads; an all-to-all gives each rank the whole sequence for ``h/d`` heads, so
ordinary varlen attention over the global ``cu_seqlens`` is exact; a second all-to-all restores the sequence
sharding. The all-to-all's backward is the reverse all-to-all (yunchang's ``SeqAllToAll4D``).
:func:`ulysses_around` is those all-to-alls around any exact attention of a head shard: plain varlen attention here,
a zigzag ring in ``hybrid``. A sliding window needs nothing more: after the all-to-all a rank holds whole documents
(for ``h/d`` heads), so the varlen kernel applies it as on one device.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from flexorch.workers.attention.collective_waits import WAITS
from flexorch.workers.attention.kernels import (
    check_sinks,
    check_varlen_args,
    check_window,
    resolve_backend,
    varlen_attn,
)

__all__ = [
    "InnerAttn",
    "check_head_degree",
    "head_to_seq",
    "lse_head_to_seq",
    "seq_to_head",
    "spread_kv_heads",
    "ulysses_around",
    "ulysses_attn_varlen_func",
]


def _a2a_seq_to_head(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    d = dist.get_world_size(group)
    if d == 1:
        return x
    s_local, h, hd = x.shape
    # (s/d, h, hd) -> (s/d, d, h/d, hd) -> (d, s/d, h/d, hd): block j holds head slice j, goes to rank j
    send = x.reshape(s_local, d, h // d, hd).transpose(0, 1).contiguous()
    recv = torch.empty_like(send)
    with WAITS.blocked():  # every member's block: a slower member shows here (``collective_waits``)
        dist.all_to_all_single(recv, send, group=group)
    # recv block j = tokens of rank j, our head slice: (d, s/d, h/d, hd) -> (s, h/d, hd)
    return recv.reshape(d * s_local, h // d, hd)


def _a2a_head_to_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    d = dist.get_world_size(group)
    if d == 1:
        return x
    s, h_local, hd = x.shape
    # (s, h/d, hd) -> (d, s/d, h/d, hd): block j holds the tokens of rank j, goes to rank j
    send = x.reshape(d, s // d, h_local, hd).contiguous()
    recv = torch.empty_like(send)
    with WAITS.blocked():  # every member's block: a slower member shows here (``collective_waits``)
        dist.all_to_all_single(recv, send, group=group)
    # recv block j = our tokens, head slice j: (d, s/d, h/d, hd) -> (s/d, d, h/d, hd) -> (s/d, h, hd)
    return recv.transpose(0, 1).reshape(s // d, d * h_local, hd)


class _AllToAll(torch.autograd.Function):
    """One of the two all-to-alls; its backward is the other (yunchang's ``SeqAllToAll4D``)."""

    @staticmethod
    def forward(ctx, x, group, to_head: bool):
        ctx.group, ctx.to_head = group, to_head
        return (_a2a_seq_to_head if to_head else _a2a_head_to_seq)(x, group)

    @staticmethod
    def backward(ctx, grad):
        return (_a2a_head_to_seq if ctx.to_head else _a2a_seq_to_head)(grad, ctx.group), None, None


def seq_to_head(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Differentiable all-to-all ``(s/d, h, hd) -> (s, h/d, hd)`` over ``group`` (ranks in group order)."""
    return _AllToAll.apply(x, group, True)


def head_to_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Differentiable all-to-all ``(s, h/d, hd) -> (s/d, h, hd)``, the inverse of :func:`seq_to_head`."""
    return _AllToAll.apply(x, group, False)


def head_shard(x: torch.Tensor | None, group: dist.ProcessGroup) -> torch.Tensor | None:
    """This rank's slice of a per-head tensor ``(h,) -> (h/d,)``: the heads :func:`seq_to_head` gives it (slice
    ``rank``); differentiable, so each head's gradient comes from the rank holding it."""
    if x is None:
        return None
    d = dist.get_world_size(group)
    return x.chunk(d)[dist.get_rank(group)] if d > 1 else x


def check_head_degree(h: int, d: int, *, where: str) -> None:
    """Raise ValueError unless ``h`` query heads split evenly over ``d`` ranks (before any collective runs)."""
    if h % d != 0:
        raise ValueError(f"{where}: {h} query heads are not divisible by the sequence-parallel degree {d}")


def spread_kv_heads(k: torch.Tensor, v: torch.Tensor, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V with a head count divisible by ``d``, so each of ``d`` head shards holds the KV heads its query heads read.

    GQA with ``h_kv % d != 0`` (``d`` may exceed ``h_kv``): every KV head is repeated ``lcm(h_kv, d) / h_kv`` times
    (``h`` is a multiple of ``lcm(h_kv, d)``), so query head ``j`` still reads (a copy of) KV head
    ``j // (h / h_kv)`` and its shard holds that copy; autograd of ``repeat_interleave`` sums the copies' gradients
    back onto the KV head. Unchanged when ``d`` divides ``h_kv``.
    """
    h_kv = k.shape[1]
    if h_kv % d == 0:
        return k, v
    rep = math.lcm(h_kv, d) // h_kv
    # (t, h_kv, hd) -> (t, lcm(h_kv, d), hd): head m of the result is KV head m // rep
    return k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)


def lse_head_to_seq(lse_h: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The log-sum-exp of a head shard back to sequence shards: ``(h/d, s) -> (h, s/d)`` (not differentiable)."""
    # (h/d, s) -> (s, h/d, 1) -a2a-> (s/d, h, 1) -> (h, s/d)
    return _a2a_head_to_seq(lse_h.t().unsqueeze(-1).contiguous(), group).squeeze(-1).t().contiguous()


InnerAttn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""``inner(q (s, h/d, hd), k (s, h_kv'/d, hd), v) -> (out (s, h/d, hd), lse (h/d, s))``: exact attention over the
whole sequence of a head shard."""


def ulysses_around(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup,
    inner: InnerAttn,
    *,
    return_lse: bool,
    where: str,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Ulysses's all-to-alls around ``inner``: sequence shards -> head shards, ``inner`` on the whole sequence of
    ``h/d`` heads, head shards -> sequence shards. ``inner`` is plain varlen attention (Ulysses) or a ring over
    other ranks with the same head shard (``hybrid``). Head counts are checked before any collective runs."""
    d = dist.get_world_size(group)
    check_head_degree(q.shape[1], d, where=where)
    k, v = spread_kv_heads(k, v, d)
    q_h = seq_to_head(q, group)  # (s/d, h, hd) -a2a-> (s, h/d, hd)
    k_h = seq_to_head(k, group)  # (s/d, h_kv', hd) -a2a-> (s, h_kv'/d, hd)
    v_h = seq_to_head(v, group)
    out_h, lse_h = inner(q_h, k_h, v_h)
    out = head_to_seq(out_h, group)  # (s, h/d, hd) -a2a-> (s/d, h, hd)
    return (out, lse_head_to_seq(lse_h, group)) if return_lse else out


def ulysses_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int | None,
    group: dist.ProcessGroup,
    *,
    softmax_scale: float | None = None,
    causal: bool = True,
    return_lse: bool = False,
    backend: str | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact attention over a packed batch whose tokens are sharded contiguously over ``group``.

    Args:
        q: ``(s/d, h, hd)`` local queries (``sharding.shard_contiguous`` layout, rank = group rank).
        k, v: ``(s/d, h_kv, hd)`` local keys and values, ``h % h_kv == 0`` (GQA; ``d`` may exceed ``h_kv``:
            :func:`spread_kv_heads`).
        cu_seqlens: ``(n + 1,)`` boundaries of the *global* padded batch (``Layout.cu_seqlens``), same on
            all ranks.
        max_seqlen: longest global document (or None to derive it).
        group: the sequence-parallel group of degree ``d``; ``h`` must be divisible by ``d``.
        softmax_scale: defaults to ``hd ** -0.5``.
        causal: causal within each document.
        return_lse: also return the local log-sum-exp ``(h, s/d)`` (float32; float64 for fp64 inputs).
        backend: kernel backend (``flexorch.workers.attention.kernels``), default chosen by device.
        window: a sliding window of that many keys (query ``i`` sees keys ``i - window < j <= i`` of its document,
            Transformers' ``sliding_window``); needs ``causal``.
        sinks: ``(h,)`` a learned logit per head in every row's softmax (GPT-OSS; ``kernels.with_sinks``); each
            rank applies its head shard's.

    Returns:
        ``(s/d, h, hd)`` output, or ``(out, lse)``.
    """
    d = dist.get_world_size(group)
    where = "ulysses_attn_varlen_func"
    seqlens = check_varlen_args(q, k, v, cu_seqlens, max_seqlen, d, where=where)
    check_window(window, causal, where=where)
    backend = resolve_backend(backend, q, window=window)  # what the kernels cannot run fails here, on every rank
    scale = softmax_scale if softmax_scale is not None else q.shape[2] ** -0.5
    check_sinks(sinks, q, where=where)
    mine = head_shard(sinks, group)

    def inner(q_h, k_h, v_h):
        # whole documents of h/d heads: (s, h/d, hd) -> (s, h/d, hd), lse (h/d, s)
        kw = {"causal": causal, "softmax_scale": scale, "backend": backend, "window": window, "sinks": mine}
        return varlen_attn(q_h, k_h, v_h, seqlens, **kw)

    return ulysses_around(q, k, v, group, inner, return_lse=return_lse, where=where)
