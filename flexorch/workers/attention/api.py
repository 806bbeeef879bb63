"""Public sequence-parallel attention API; names mirror flash-attn's ``flash_attn_varlen_func``.

All functions take a packed batch described by ``cu_seqlens`` (per-document causal attention, documents never
attend to each other) and return ``out`` or ``(out, lse)`` with ``lse`` shaped ``(heads, local_tokens)``
float32 (float64 for fp64 inputs). The sequence-parallel ones take the process group as an argument (a group
of size 1 runs the same code):

* :func:`ulysses_attn_varlen_func`: contiguous shards (``sharding.shard_contiguous``), all-to-all.
* :func:`zigzag_ring_attn_varlen_func`: zigzag shards (``sharding.shard_zigzag``), K/V ring.
* :func:`hybrid_attn_varlen_func`: Ulysses inside blocks of ``u`` ranks x zigzag ring across them
  (``sharding.hybrid_layout``); takes the two sub-groups.
* :func:`varlen_attn_func`: the single-device reference path (same kernels, no communication).

Each takes ``window=w`` for a sliding window (Hugging Face Transformers' ``sliding_window``: a query at position
``i`` of a document attends to the keys ``i - w < j <= i`` of that document, itself included; causal only; None:
the whole causal prefix), and ``sinks=`` for a learned logit per head in every row's softmax (GPT-OSS's attention
sinks: ``kernels.with_sinks``). Bad values raise ValueError before any collective.
"""

from __future__ import annotations

import torch

from flexorch.workers.attention.hybrid import hybrid_attn_varlen_func
from flexorch.workers.attention.kernels import (
    check_sinks,
    check_varlen_args,
    check_window,
    resolve_backend,
    varlen_attn,
)
from flexorch.workers.attention.ring import zigzag_ring_attn_varlen_func
from flexorch.workers.attention.ulysses import ulysses_attn_varlen_func

__all__ = ["hybrid_attn_varlen_func", "ulysses_attn_varlen_func", "varlen_attn_func", "zigzag_ring_attn_varlen_func"]


def varlen_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int | None = None,
    *,
    softmax_scale: float | None = None,
    causal: bool = True,
    return_lse: bool = False,
    backend: str | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Single-device varlen attention: ``q (t, h, hd)``, ``k, v (t, h_kv, hd)`` -> ``(t, h, hd)`` [, lse].
    ``window``: a sliding window of that many keys (needs ``causal``); ``sinks (h,)``: a learned logit per head in
    every row's softmax (GPT-OSS)."""
    seqlens = check_varlen_args(q, k, v, cu_seqlens, max_seqlen, 1, where="varlen_attn_func")
    check_window(window, causal, where="varlen_attn_func")
    check_sinks(sinks, q, where="varlen_attn_func")
    backend = resolve_backend(backend, q, window=window)  # what the kernels cannot run fails here, on every rank
    scale = softmax_scale if softmax_scale is not None else q.shape[2] ** -0.5
    out, lse = varlen_attn(
        q, k, v, seqlens, causal=causal, softmax_scale=scale, backend=backend, window=window, sinks=sinks
    )
    return (out, lse) if return_lse else out
