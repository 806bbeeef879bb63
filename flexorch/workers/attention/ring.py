"""Zigzag ring attention over packed variable-length documents, forward and backward.

Ring Self-Attention (Li et al., arXiv 2105.13120, Sec. 3.2) / Ring Attention (Liu et al., arXiv 2310.01889):
each rank keeps its queries while key/value blocks travel once around the ring; partial outputs are merged
exactly with their log-sum-exp. Zigzag layout and varlen handling follow zhuzilin/ring-flash-attention
(``zigzag_ring_flash_attn_varlen.py``): rank ``r`` holds chunks ``r`` and ``2d-1-r`` of every document
(``flexorch.workers.attention.sharding.zigzag_layout``), so at ring step ``i`` with K/V from ``src = r - i``:

* ``i == 0``: local queries vs local keys, causal (the two chunks are in document order);
* ``src < r``: all local queries vs the *front* chunk of src's keys (its back chunk lies in our future);
* ``src > r``: only our *back* chunk's queries vs all of src's keys (our front chunk precedes both of src's).

Every step after the first costs half a block on every rank: causal work is balanced. The backward runs the
same ring; dK/dV accumulators travel with K/V and reach their owner after one more hop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from flexorch.workers.attention.collective_waits import WAITS
from flexorch.workers.attention.kernels import (
    Seqlens,
    acc_dtype,
    attn_backward,
    attn_forward,
    check_varlen_args,
    resolve_backend,
)
from flexorch.workers.attention.merge import merge_attn_outputs

__all__ = ["ZigzagBlocks", "zigzag_blocks", "zigzag_ring_attn", "zigzag_ring_attn_varlen_func"]

_KV_TAG, _DKV_TAG = 0, 1  # distinct tags so the K/V and dK/dV messages in flight never match each other


@dataclass(frozen=True)
class ZigzagBlocks:
    """Local document boundaries and chunk indices of one rank's zigzag shard."""

    full: Seqlens
    """Local documents (two chunks each): global cu_seqlens // d."""
    half: Seqlens
    """One chunk per document: global cu_seqlens // (2d)."""
    front: torch.Tensor | slice
    """Local token indices of every document's first chunk (chunk r)."""
    back: torch.Tensor | slice
    """Local token indices of every document's second chunk (chunk 2d-1-r)."""


def zigzag_blocks(
    seqlens: Seqlens,
    degree: int,
    device: torch.device | None = None,
    *,
    where: str = "zigzag_ring_attn_varlen_func",
    layout: str = "shard_zigzag",
) -> ZigzagBlocks:
    """Pure: local block structure from the global padded boundaries; ValueError unless 2d-aligned (``where`` and
    ``layout``, the ``sharding`` function that pads, name the caller in the message)."""
    two_d = 2 * degree
    for i, (a, b) in enumerate(zip(seqlens.offsets[:-1], seqlens.offsets[1:], strict=True)):
        if (b - a) % two_d:
            raise ValueError(
                f"{where}: document {i} has {b - a} tokens, not a multiple of 2 * degree"
                f" = {two_d}; pad documents with flexorch.workers.attention.sharding.{layout}"
            )
    full = Seqlens(tuple(x // degree for x in seqlens.offsets))
    half = Seqlens(tuple(x // two_d for x in seqlens.offsets))
    if len(full.offsets) == 2:  # one document: plain slices, no gather
        return ZigzagBlocks(full, half, slice(0, half.total), slice(half.total, full.total))
    chunk = torch.tensor(half.offsets[1:]) - torch.tensor(half.offsets[:-1])  # (n_docs,)
    # Token j of chunk i sits at local position full.offsets[i] + j (front) or + chunk[i] + j (back).
    inner = torch.arange(half.total) - torch.repeat_interleave(torch.tensor(half.offsets[:-1]), chunk)
    front = torch.repeat_interleave(torch.tensor(full.offsets[:-1]), chunk) + inner
    back = front + torch.repeat_interleave(chunk, chunk)
    return ZigzagBlocks(full, half, front.to(device), back.to(device))


class _Ring:
    """Send to the next group rank, receive from the previous one (point-to-point, any backend).

    gloo moves only host memory point-to-point: a CUDA tensor handed to its ``isend`` ends the process from gloo's
    I/O thread (``gloo::IoException ... writev: Bad address``, seen on an H200 with torch 2.11), which no
    ``try`` can catch. On a group without a CUDA backend, CUDA tensors therefore travel through host copies."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.host_only = "nccl" not in str(dist.get_backend(group))
        """True for gloo groups ("gloo", not "cpu:gloo,cuda:nccl"): device tensors are staged on the host."""

    def start(self, x: torch.Tensor, tag: int) -> _InFlight:
        staged = self.host_only and x.device.type != "cpu"
        send = x.cpu() if staged else x
        recv = torch.empty_like(send)
        ops = [
            dist.P2POp(dist.isend, send, group=self.group, tag=tag, group_peer=(self.rank + 1) % self.size),
            dist.P2POp(dist.irecv, recv, group=self.group, tag=tag, group_peer=(self.rank - 1) % self.size),
        ]
        return _InFlight(recv, dist.batch_isend_irecv(ops), x.device if staged else None)


class _InFlight:
    """One ring hop in flight: ``wait()`` returns the received tensor (on the sender's device)."""

    def __init__(self, recv: torch.Tensor, reqs: list, device: torch.device | None) -> None:
        self.recv, self.reqs, self.device = recv, reqs, device

    def wait(self) -> torch.Tensor:
        with WAITS.blocked():  # the partner's hop: a slower partner shows here (``collective_waits``)
            for req in self.reqs:
                req.wait()
        return self.recv if self.device is None else self.recv.to(self.device, non_blocking=False)


def _ring_forward(q, k, v, blocks: ZigzagBlocks, ring: _Ring, scale: float, backend):
    kw = {"softmax_scale": scale, "backend": backend}
    full, half, front, back = blocks.full, blocks.half, blocks.front, blocks.back
    kv = torch.stack([k, v])  # 2 x (t, h_kv, hd) -> (2, t, h_kv, hd): one message per step
    out = lse = None
    for step in range(ring.size):
        if step + 1 < ring.size:
            hop = ring.start(kv, _KV_TAG)
        src = (ring.rank - step) % ring.size
        if step == 0:
            out, lse = attn_forward(q, kv[0], kv[1], full, full, causal=True, **kw)
            out = out.to(acc_dtype(q.dtype))  # merged in the accumulation dtype: fp64 stays fp64
        elif src < ring.rank:
            blk = attn_forward(q, kv[0][front], kv[1][front], full, half, causal=False, **kw)
            out, lse = merge_attn_outputs(out, lse, *blk)
        else:
            blk_out, blk_lse = attn_forward(q[back], kv[0], kv[1], half, full, causal=False, **kw)
            out[back], lse[:, back] = merge_attn_outputs(out[back], lse[:, back], blk_out, blk_lse)
        if step + 1 < ring.size:
            kv = hop.wait()
    return out.to(q.dtype), lse


def _ring_backward(dout, q, k, v, out, lse, blocks: ZigzagBlocks, ring: _Ring, scale: float, backend):
    kw = {"softmax_scale": scale, "backend": backend}
    full, half, front, back = blocks.full, blocks.half, blocks.front, blocks.back
    dout_b, q_b, out_b, lse_b = dout[back], q[back], out[back], lse[:, back].contiguous()
    kv = torch.stack([k, v])  # (2, t, h_kv, hd)
    acc = acc_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dkv = dkv_hop = None
    for step in range(ring.size):
        if step + 1 < ring.size:
            hop = ring.start(kv, _KV_TAG)
        src = (ring.rank - step) % ring.size
        if step == 0:
            dq_i, dk_i, dv_i = attn_backward(dout, q, kv[0], kv[1], out, lse, full, full, causal=True, **kw)
            dq += dq_i
            rows = slice(None)
        elif src < ring.rank:
            dq_i, dk_i, dv_i = attn_backward(
                dout, q, kv[0][front], kv[1][front], out, lse, full, half, causal=False, **kw
            )
            dq += dq_i
            rows = front
        else:
            dq_i, dk_i, dv_i = attn_backward(dout_b, q_b, kv[0], kv[1], out_b, lse_b, half, full, causal=False, **kw)
            dq[back] += dq_i
            rows = slice(None)
        if step == 0:
            dkv = torch.stack([dk_i, dv_i]).to(acc)  # accumulator of our own K/V block
        else:
            dkv = dkv_hop.wait()  # the accumulator of block src arrives from the previous rank
            dkv[0][rows] += dk_i
            dkv[1][rows] += dv_i
        if step + 1 < ring.size:
            kv = hop.wait()
        if ring.size > 1:
            dkv_hop = ring.start(dkv, _DKV_TAG)  # pass it on; after d hops it is back home
    if ring.size > 1:
        dkv = dkv_hop.wait()
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


class _ZigzagRingAttn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, blocks, group, scale, backend):
        ring = _Ring(group)
        out, lse = _ring_forward(q, k, v, blocks, ring, scale, backend)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (blocks, ring, scale, backend)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        return (*_ring_backward(dout, q, k, v, out, lse, *ctx.args), None, None, None, None)


def zigzag_ring_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    blocks: ZigzagBlocks,
    group: dist.ProcessGroup,
    scale: float,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable causal zigzag ring attention on checked inputs: ``(out (t, h, hd), lse (h, t))``.

    ``blocks``: :func:`zigzag_blocks` of the global batch for a ring of ``group``'s size; ``backend`` resolved. The
    validation lives in :func:`zigzag_ring_attn_varlen_func` and in callers that run other collectives first
    (``hybrid``), which must check before any of them."""
    return _ZigzagRingAttn.apply(q, k, v, blocks, group, scale, backend)


def zigzag_ring_attn_varlen_func(
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
    """Exact attention over a packed batch sharded in the zigzag layout over ``group``.

    Args:
        q: ``(t, h, hd)`` local queries (``sharding.shard_zigzag`` layout, rank = group rank).
        k, v: ``(t, h_kv, hd)`` local keys and values, ``h % h_kv == 0`` (GQA: K/V travel with h_kv heads).
        cu_seqlens: ``(n + 1,)`` boundaries of the *global* padded batch (``Layout.cu_seqlens``), every
            document a multiple of ``2 * d`` tokens, same on all ranks.
        max_seqlen: longest global document (or None to derive it).
        group: the ring, in group-rank order.
        softmax_scale: defaults to ``hd ** -0.5``.
        causal: must be True (causal within each document): the zigzag layout exists to balance causal work,
            and its padding is invisible to real tokens only under a causal mask.
        return_lse: also return the local log-sum-exp ``(h, t)`` (float32; float64 for fp64 inputs).
        backend: kernel backend (``flexorch.workers.attention.kernels``), default chosen by device.

    Returns:
        ``(t, h, hd)`` output, or ``(out, lse)``.
    """
    d = dist.get_world_size(group)
    seqlens = check_varlen_args(q, k, v, cu_seqlens, max_seqlen, d, where="zigzag_ring_attn_varlen_func")
    backend = resolve_backend(backend, q)  # a dtype/device the kernels cannot run fails here, on every rank
    if not causal:
        # Non-causal attention would let real queries see every document's padding (and needs no zigzag).
        raise ValueError("zigzag_ring_attn_varlen_func supports causal=True only")
    blocks = zigzag_blocks(seqlens, d, q.device)
    scale = softmax_scale if softmax_scale is not None else q.shape[2] ** -0.5
    out, lse = zigzag_ring_attn(q, k, v, blocks, group, scale, backend)
    return (out, lse) if return_lse else out
