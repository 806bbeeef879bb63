"""Ulysses sequence parallelism: all-to-all from sequence shards to head shards, attention, all-to-all back.

DeepSpeed-Ulysses (Jacobs et al., arXiv 2309.14509, Sec. 3): each rank holds a contiguous slice ``s/d`` of the
packed batch with all ``h`` heads; an all-to-all gives each rank the whole sequence for ``h/d`` heads, so
ordinary varlen attention over the global ``cu_seqlens`` is exact; a second all-to-all restores the sequence
sharding. The all-to-all's backward is the reverse all-to-all (yunchang's ``SeqAllToAll4D``).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from flexorch.workers.attention.kernels import check_varlen_args, resolve_backend, varlen_attn

__all__ = ["head_to_seq", "seq_to_head", "ulysses_attn_varlen_func"]


def _a2a_seq_to_head(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    d = dist.get_world_size(group)
    if d == 1:
        return x
    s_local, h, hd = x.shape
    # (s/d, h, hd) -> (s/d, d, h/d, hd) -> (d, s/d, h/d, hd): block j holds head slice j, goes to rank j
    send = x.reshape(s_local, d, h // d, hd).transpose(0, 1).contiguous()
    recv = torch.empty_like(send)
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
    dist.all_to_all_single(recv, send, group=group)
    # recv block j = our tokens, head slice j: (d, s/d, h/d, hd) -> (s/d, d, h/d, hd) -> (s/d, h, hd)
    return recv.transpose(0, 1).reshape(s // d, d * h_local, hd)


class _SeqToHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _a2a_seq_to_head(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _a2a_head_to_seq(grad, ctx.group), None


class _HeadToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _a2a_head_to_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _a2a_seq_to_head(grad, ctx.group), None


def seq_to_head(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Differentiable all-to-all ``(s/d, h, hd) -> (s, h/d, hd)`` over ``group`` (ranks in group order)."""
    return _SeqToHead.apply(x, group)


def head_to_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Differentiable all-to-all ``(s, h/d, hd) -> (s/d, h, hd)``, the inverse of :func:`seq_to_head`."""
    return _HeadToSeq.apply(x, group)


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
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact attention over a packed batch whose tokens are sharded contiguously over ``group``.

    Args:
        q: ``(s/d, h, hd)`` local queries (``sharding.shard_contiguous`` layout, rank = group rank).
        k, v: ``(s/d, h_kv, hd)`` local keys and values, ``h % h_kv == 0`` (GQA).
        cu_seqlens: ``(n + 1,)`` boundaries of the *global* padded batch (``Layout.cu_seqlens``), same on
            all ranks.
        max_seqlen: longest global document (or None to derive it).
        group: the sequence-parallel group of degree ``d``; ``h`` must be divisible by ``d``.
        softmax_scale: defaults to ``hd ** -0.5``.
        causal: causal within each document.
        return_lse: also return the local log-sum-exp ``(h, s/d)`` (float32; float64 for fp64 inputs).
        backend: kernel backend (``flexorch.workers.attention.kernels``), default chosen by device.

    Returns:
        ``(s/d, h, hd)`` output, or ``(out, lse)``.
    """
    d = dist.get_world_size(group)
    where = "ulysses_attn_varlen_func"
    seqlens = check_varlen_args(q, k, v, cu_seqlens, max_seqlen, d, where=where)
    backend = resolve_backend(backend, q)  # a dtype/device the kernels cannot run fails here, on every rank
    h, h_kv, hd = q.shape[1], k.shape[1], q.shape[2]
    if h % d != 0:
        raise ValueError(f"{where}: {h} query heads are not divisible by the sequence-parallel degree {d}")
    if h_kv % d != 0:
        # GQA with KV heads not divisible by d: replicate every KV head lcm(h_kv, d)/h_kv times (h is a
        # multiple of lcm(h_kv, d)); query head j still reads (a copy of) KV head j // (h / h_kv).
        rep = math.lcm(h_kv, d) // h_kv
        k = k.repeat_interleave(rep, dim=1)  # (s/d, h_kv, hd) -> (s/d, lcm(h_kv, d), hd)
        v = v.repeat_interleave(rep, dim=1)
    scale = softmax_scale if softmax_scale is not None else hd**-0.5
    q_h = seq_to_head(q, group)  # (s/d, h, hd) -a2a-> (s, h/d, hd)
    k_h = seq_to_head(k, group)  # (s/d, h_kv', hd) -a2a-> (s, h_kv'/d, hd)
    v_h = seq_to_head(v, group)
    out_h, lse_h = varlen_attn(q_h, k_h, v_h, seqlens, causal=causal, softmax_scale=scale, backend=backend)
    out = head_to_seq(out_h, group)  # (s, h/d, hd) -a2a-> (s/d, h, hd)
    if not return_lse:
        return out
    # (h/d, s) -> (s, h/d, 1) -a2a-> (s/d, h, 1) -> (h, s/d)
    lse = _a2a_head_to_seq(lse_h.t().unsqueeze(-1).contiguous(), group).squeeze(-1).t().contiguous()
    return out, lse
