"""Hybrid (2-D) sequence parallelism: Ulysses inside a node x zigzag ring attention across nodes, exact.

USP (Fang & Zhao, arXiv 2405.07719, Sec. 3: "Unified Sequence Parallelism", yunchang's ``LongContextAttention``) and
Megatron-Core's hierarchical context parallel (``cp_comm_type="a2a+p2p"`` with ``hierarchical_context_parallel_sizes
= [a2a size, p2p size]``: all-to-all inside, p2p across) run a group of degree ``d = u x r`` as ``r`` ring positions
of ``u`` Ulysses ranks each. Group rank ``g = j * u + i`` is Ulysses offset ``i`` of ring position ``j``: its Ulysses
sub-group is its block ``ranks[j*u:(j+1)*u]`` (consecutive ranks, inside one node), its ring sub-group the ranks at
the same offset of every block, ``ranks[i::u]`` (``flexorch.work.step.hybrid_sub_groups``).

Layout (``sharding.hybrid_layout``): the documents are laid out zigzag over the ``r`` ring positions (position ``j``
holds chunks ``j`` and ``2r-1-j`` of every document, padded to a multiple of ``2r``), and each position's ``t``
tokens are split contiguously over its ``u`` ranks (``t/u`` each). Forward, on every rank:

1. all-to-all inside the block (:func:`~.ulysses.ulysses_around`): ``(t/u, h, hd) -> (t, h/u, hd)``: the rank now
   holds its position's whole zigzag shard, for head slice ``i``;
2. zigzag ring attention (:func:`~.ring.zigzag_ring_attn`) over the ring sub-group: its ``r`` ranks hold the same
   head slice ``i``, one ring position each, which is exactly a zigzag ring of degree ``r`` on ``h/u`` heads;
3. the all-to-all back: ``(t, h/u, hd) -> (t/u, h, hd)``.

Backward is autograd through the three (an all-to-all's backward is the reverse all-to-all, the ring's its own
ring backward). GQA: when ``u`` does not divide ``h_kv`` (``u`` may exceed it), K/V heads are repeated to
``lcm(h_kv, u)`` before the all-to-all (:func:`~.ulysses.spread_kv_heads`) and their gradients summed back by
autograd, so each head slice carries the KV heads its query heads read; the ring then moves ``lcm(h_kv, u) / u``
KV heads per rank.

A sliding window flows through: the all-to-all keeps every token's place in its document, and the ring skips and
masks its blocks as a zigzag ring of degree ``r`` does (:mod:`~.ring_plan`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from flexorch.workers.attention.kernels import check_sinks, check_varlen_args, check_window, resolve_backend
from flexorch.workers.attention.ring import zigzag_blocks, zigzag_ring_attn
from flexorch.workers.attention.ulysses import check_head_degree, head_shard, ulysses_around

__all__ = ["hybrid_attn_varlen_func"]


def hybrid_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int | None,
    ulysses_group: dist.ProcessGroup,
    ring_group: dist.ProcessGroup,
    *,
    softmax_scale: float | None = None,
    causal: bool = True,
    return_lse: bool = False,
    backend: str | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact attention over a packed batch sharded in the hybrid layout over ``u x r`` ranks.

    Args:
        q: ``(t/u, h, hd)`` local queries (``sharding.hybrid_layout`` of this rank's group rank).
        k, v: ``(t/u, h_kv, hd)`` local keys and values, ``h % h_kv == 0`` (GQA, any ``h_kv``).
        cu_seqlens: ``(n + 1,)`` boundaries of the *global* padded batch (``Layout.cu_seqlens``), every document a
            multiple of ``2 * r`` tokens, same on all ranks.
        max_seqlen: longest global document (or None to derive it).
        ulysses_group: this rank's block of ``u`` ranks (group rank = Ulysses offset); ``h`` divisible by ``u``.
        ring_group: this rank's ring of ``r`` ranks, one per ring position (group rank = ring position).
        softmax_scale: defaults to ``hd ** -0.5``.
        causal: must be True (the ring is zigzag: ``zigzag_ring_attn_varlen_func``).
        return_lse: also return the local log-sum-exp ``(h, t/u)`` (float32; float64 for fp64 inputs).
        backend: kernel backend (``flexorch.workers.attention.kernels``), default chosen by device.
        window: a sliding window of that many keys (query ``i`` sees keys ``i - window < j <= i`` of its document,
            Transformers' ``sliding_window``).
        sinks: ``(h,)`` a learned logit per head in every row's softmax (GPT-OSS; ``kernels.with_sinks``).

    Returns:
        ``(t/u, h, hd)`` output, or ``(out, lse)``.
    """
    u, r = dist.get_world_size(ulysses_group), dist.get_world_size(ring_group)
    where = "hybrid_attn_varlen_func"
    # Every check before the first collective: bad input fails the same way on every rank of both sub-groups.
    seqlens = check_varlen_args(q, k, v, cu_seqlens, max_seqlen, u * r, where=where)
    check_window(window, causal, where=where)
    backend = resolve_backend(backend, q, window=window)
    if not causal:
        raise ValueError(f"{where} supports causal=True only (its ring is zigzag)")
    check_head_degree(q.shape[1], u, where=where)
    blocks = zigzag_blocks(seqlens, r, q.device, where=f"{where} (ring degree {r})", layout="hybrid_layout")
    scale = softmax_scale if softmax_scale is not None else q.shape[2] ** -0.5
    check_sinks(sinks, q, where=where)
    mine = head_shard(sinks, ulysses_group)

    def ring(q_h, k_h, v_h):
        # q_h (t, h/u, hd), k_h/v_h (t, h_kv'/u, hd): this ring position's zigzag shard of head slice i
        return zigzag_ring_attn(q_h, k_h, v_h, blocks, ring_group, scale, backend, window, mine)  # (t, h/u, hd), lse

    return ulysses_around(q, k, v, ulysses_group, ring, return_lse=return_lse, where=where)
