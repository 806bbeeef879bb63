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

Which rows meet which at each step is a :class:`~.ring_plan.RingPlan` (pure, per rank): the three shapes above, or,
with a sliding ``window``, per (query chunk, key chunk) pair and document: skipped outside every window, one
unmasked call where every key is in every window, a masked call with the block's position offset on the window's
edge (:mod:`~.ring_plan`, with how much work a window saves). A skipped block makes no kernel call: its rows'
``out``/``lse`` keep the other blocks' merge and its gradients are zero. The calls run in plan order, forward and
backward; K/V (and dK/dV) still travel the whole ring.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from flexorch.workers.attention.collective_waits import WAITS
from flexorch.workers.attention.kernels import (
    acc_dtype,
    attn_backward,
    attn_forward,
    check_sinks,
    check_varlen_args,
    check_window,
    resolve_backend,
    sink_grad,
    with_sinks,
)
from flexorch.workers.attention.merge import merge_attn_outputs
from flexorch.workers.attention.ring_plan import RingPlan, ZigzagBlocks, ring_plan, zigzag_blocks

__all__ = ["ZigzagBlocks", "zigzag_blocks", "zigzag_ring_attn", "zigzag_ring_attn_varlen_func"]

_KV_TAG, _DKV_TAG = 0, 1  # distinct tags so the K/V and dK/dV messages in flight never match each other


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


def _is_all(rows) -> bool:
    return isinstance(rows, slice) and rows == slice(None)


def _kernel_kw(call, scale, backend) -> dict:
    return dict(causal=call.causal, window=call.window, shift=call.shift, softmax_scale=scale, backend=backend)


def _ring_forward(q, k, v, plan: RingPlan, ring: _Ring, scale: float, backend):
    kv = torch.stack([k, v])  # 2 x (t, h_kv, hd) -> (2, t, h_kv, hd): one message per step
    out = lse = None
    for step, calls in enumerate(plan.steps):
        if step + 1 < ring.size:
            hop = ring.start(kv, _KV_TAG)
        for call in calls:
            rows, keys = call.q_rows, call.k_rows
            blk_out, blk_lse = attn_forward(
                q[rows], kv[0][keys], kv[1][keys], call.cu_q, call.cu_k, **_kernel_kw(call, scale, backend)
            )
            if out is None:  # step 0's first call: every row, causal
                out, lse = blk_out.to(acc_dtype(q.dtype)), blk_lse  # merged in the accumulation dtype
            elif _is_all(rows):
                out, lse = merge_attn_outputs(out, lse, blk_out, blk_lse)
            else:
                out[rows], lse[:, rows] = merge_attn_outputs(out[rows], lse[:, rows], blk_out, blk_lse)
        if step + 1 < ring.size:
            kv = hop.wait()
    return out.to(q.dtype), lse


class _Rows:
    """``dout, q, out, lse`` at one call's query rows; the last rows' gather is reused (the causal plan asks the
    back chunk's at every step with ``src > r``)."""

    def __init__(self, dout, q, out, lse):
        self.full, self.rows, self.taken = (dout, q, out, lse), None, None

    def __call__(self, rows):
        if _is_all(rows):
            return self.full
        if rows is not self.rows:
            dout, q, out, lse = self.full
            self.rows, self.taken = rows, (dout[rows], q[rows], out[rows], lse[:, rows].contiguous())
        return self.taken


def _ring_backward(dout, q, k, v, out, lse, plan: RingPlan, ring: _Ring, scale: float, backend):
    at = _Rows(dout, q, out, lse)
    kv = torch.stack([k, v])  # (2, t, h_kv, hd)
    acc = acc_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dkv = dkv_hop = None
    for step, calls in enumerate(plan.steps):
        if step + 1 < ring.size:
            hop = ring.start(kv, _KV_TAG)
        grads = []
        for call in calls:
            rows, keys = call.q_rows, call.k_rows
            dq_i, dk_i, dv_i = attn_backward(
                *at(rows)[:2], kv[0][keys], kv[1][keys], *at(rows)[2:], call.cu_q, call.cu_k,
                **_kernel_kw(call, scale, backend),
            )  # fmt: skip
            dq[rows] += dq_i
            grads.append((keys, dk_i, dv_i))
        if step == 0:
            dkv = torch.zeros((2, *k.shape), dtype=acc, device=k.device)  # accumulator of our own K/V block
        else:
            dkv = dkv_hop.wait()  # the accumulator of block src arrives from the previous rank
        for keys, dk_i, dv_i in grads:
            dkv[0][keys] += dk_i
            dkv[1][keys] += dv_i
        if step + 1 < ring.size:
            kv = hop.wait()
        if ring.size > 1:
            dkv_hop = ring.start(dkv, _DKV_TAG)  # pass it on; after d hops it is back home
    if ring.size > 1:
        dkv = dkv_hop.wait()
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


class _ZigzagRingAttn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, blocks, group, scale, backend, window, sinks):
        ring = _Ring(group)
        plan = ring_plan(blocks, ring.rank, ring.size, window, q.device)
        out, lse = _ring_forward(q, k, v, plan, ring, scale, backend)
        if sinks is not None:  # GPT-OSS: the merged rows' normalisers take the sinks (kernels.with_sinks)
            out, lse = with_sinks(out, lse, sinks)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.args = (plan, ring, scale, backend)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        dsinks = sink_grad(dout, out, lse, sinks) if sinks is not None and ctx.needs_input_grad[8] else None
        return (*_ring_backward(dout, q, k, v, out, lse, *ctx.args), None, None, None, None, None, dsinks)


def zigzag_ring_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    blocks: ZigzagBlocks,
    group: dist.ProcessGroup,
    scale: float,
    backend: str,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable causal zigzag ring attention on checked inputs: ``(out (t, h, hd), lse (h, t))``; ``sinks
    (h,)``: a learned logit per head in every row's softmax (``kernels.with_sinks``).

    ``blocks``: :func:`zigzag_blocks` of the global batch for a ring of ``group``'s size; ``backend`` resolved;
    ``window``: a checked sliding window or None. The validation lives in :func:`zigzag_ring_attn_varlen_func` and in
    callers that run other collectives first (``hybrid``), which must check before any of them."""
    return _ZigzagRingAttn.apply(q, k, v, blocks, group, scale, backend, window, sinks)


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
    window: int | None = None,
    sinks: torch.Tensor | None = None,
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
        window: a sliding window of that many keys (query ``i`` sees keys ``i - window < j <= i`` of its document,
            Transformers' ``sliding_window``); key blocks outside every window are skipped (:mod:`~.ring_plan`).
        sinks: ``(h,)`` a learned logit per head in every row's softmax (GPT-OSS; ``kernels.with_sinks``).

    Returns:
        ``(t, h, hd)`` output, or ``(out, lse)``.
    """
    d = dist.get_world_size(group)
    where = "zigzag_ring_attn_varlen_func"
    seqlens = check_varlen_args(q, k, v, cu_seqlens, max_seqlen, d, where=where)
    check_window(window, causal, where=where)
    backend = resolve_backend(backend, q, window=window)  # what the kernels cannot run fails here, on every rank
    if not causal:
        # Non-causal attention would let real queries see every document's padding (and needs no zigzag).
        raise ValueError("zigzag_ring_attn_varlen_func supports causal=True only")
    blocks = zigzag_blocks(seqlens, d, q.device)
    scale = softmax_scale if softmax_scale is not None else q.shape[2] ** -0.5
    check_sinks(sinks, q, where=where)
    out, lse = zigzag_ring_attn(q, k, v, blocks, group, scale, backend, window, sinks)
    return (out, lse) if return_lse else out
