"""Attention of one pipeline unit whose pieces are segments of longer sequences (Seq1F1B, arXiv 2406.03488, §3.1).

A unit holds pieces: tokens [start, end) of some sequences. A piece attends causally to its own tokens and fully to
the K/V cache of its sequence's earlier tokens [0, start) (the *prefix*, computed by earlier segments). That is two
blocks of one softmax, merged exactly with their log-sum-exps
(``flexorch.workers.attention.merge.merge_attn_outputs``, as in ring attention):

    out, lse = causal(q, k, v)                         per piece, equal lengths (top-left = bottom-right)
    out_p, lse_p = full(q[rows], k_prefix, v_prefix)    the rows of pieces with a prefix, against their prefix
    out[rows], lse[rows] = merge(out[rows], lse[rows], out_p, lse_p)

The backward (FlashAttention-2's, with the merged ``out``/``lse``) gives dq from both blocks, dk/dv of the piece,
and dk/dv of the prefix: the gradient that flows back to the earlier segments that produced that cache. The
pipeline runs segment j's backward before segment j-1's so that j-1 receives it (``flexorch.solver.pipeline.schedule``).

Shapes (flash-attn varlen convention): q ``(t, h, hd)``, k/v ``(t, h_kv, hd)``, k_prefix/v_prefix
``(t_prefix, h_kv, hd)`` = the prefixes of the pieces with ``prefix_len > 0``, concatenated in piece order.

With a sliding window of ``w`` keys (query ``i`` sees ``i - w < j <= i``) the piece's own block takes the window, and
only the first ``w - 1`` rows of a piece reach into its prefix, and only its last ``w - 1`` keys: the prefix block is
those rows against those keys, with the kernels' ``shift`` (the rows start ``min(prefix, w - 1)`` positions after
those keys) so the window's edge is masked; the other prefix keys get a zero gradient.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from flexorch.workers.attention.kernels import Seqlens, acc_dtype, attn_backward, attn_forward, check_window
from flexorch.workers.attention.merge import merge_attn_outputs

__all__ = ["segment_attn_func"]


def _seqlens(lengths: list[int]) -> Seqlens:
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    return Seqlens(tuple(offsets))


class _Prefix(NamedTuple):
    """The prefix block: the unit's query ``rows`` against ``k_prefix[keys]``, with its mask."""

    rows: torch.Tensor
    keys: torch.Tensor | slice
    cu_rows: Seqlens
    cu_keys: Seqlens
    window: int | None
    shift: tuple[int, ...] | None

    def kw(self) -> dict:
        return {"causal": self.window is not None, "window": self.window, "shift": self.shift}


class _SegmentAttn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, k_pre, v_pre, cu, window, pre: _Prefix, scale, backend):
        kw = {"softmax_scale": scale, "backend": backend}
        out, lse = attn_forward(q, k, v, cu, cu, causal=True, window=window, **kw)
        out, lse = out.to(acc_dtype(q.dtype)), lse.clone()
        rows = pre.rows
        if rows.numel():
            blk_out, blk_lse = attn_forward(
                q[rows], k_pre[pre.keys], v_pre[pre.keys], pre.cu_rows, pre.cu_keys, **pre.kw(), **kw
            )
            out[rows], lse[:, rows] = merge_attn_outputs(out[rows], lse[:, rows], blk_out, blk_lse)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, k_pre, v_pre, out, lse)
        ctx.args = (cu, window, pre, kw)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, k_pre, v_pre, out, lse = ctx.saved_tensors
        cu, window, pre, kw = ctx.args
        dout = dout.contiguous()
        dq, dk, dv = attn_backward(dout, q, k, v, out, lse, cu, cu, causal=True, window=window, **kw)
        dk_pre = torch.zeros_like(k_pre)
        dv_pre = torch.zeros_like(v_pre)
        rows = pre.rows
        if rows.numel():
            lse_r = lse[:, rows].contiguous()
            dq_r, dk_pre[pre.keys], dv_pre[pre.keys] = attn_backward(
                dout[rows], q[rows], k_pre[pre.keys], v_pre[pre.keys], out[rows], lse_r, pre.cu_rows, pre.cu_keys,
                **pre.kw(), **kw,
            )  # fmt: skip
            dq = dq.clone()
            dq[rows] += dq_r.to(dq.dtype)
        return dq, dk, dv, dk_pre, dv_pre, None, None, None, None, None


def _prefix(piece_lens: list[int], prefix_lens: list[int], window: int | None) -> _Prefix:
    """Which rows meet which prefix keys: every row of a piece with a prefix and its whole prefix (no window, or one
    that reaches every prefix key from every row), else the first ``w - 1`` rows and the last ``w - 1`` keys."""
    starts, pre_starts = [0], [0]
    for n, p in zip(piece_lens, prefix_lens, strict=True):
        starts.append(starts[-1] + n)
        pre_starts.append(pre_starts[-1] + p)
    with_prefix = [i for i, p in enumerate(prefix_lens) if p > 0]
    if window is not None and all(prefix_lens[i] + piece_lens[i] <= window for i in with_prefix):
        window = None  # every row's window holds its whole prefix
    if window is None:
        rows = [(starts[i], starts[i + 1]) for i in with_prefix]
        keys, shift = slice(None), None
        cu_keys = _seqlens([prefix_lens[i] for i in with_prefix])
    else:
        with_prefix = [i for i in with_prefix if window > 1]  # a window of 1 is the token alone
        rows = [(starts[i], starts[i] + min(piece_lens[i], window - 1)) for i in with_prefix]
        spans = [(pre_starts[i + 1] - min(prefix_lens[i], window - 1), pre_starts[i + 1]) for i in with_prefix]
        keys = torch.cat([torch.arange(a, b) for a, b in spans]) if spans else torch.empty(0, dtype=torch.long)
        shift = tuple(min(prefix_lens[i], window - 1) for i in with_prefix)  # rows start that far after the keys
        cu_keys = _seqlens([b - a for a, b in spans])
    row_index = torch.cat([torch.arange(a, b) for a, b in rows]) if rows else torch.empty(0, dtype=torch.long)
    return _Prefix(row_index, keys, _seqlens([b - a for a, b in rows]), cu_keys, window, shift)


def segment_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    piece_lens: list[int],
    prefix_lens: list[int],
    k_prefix: torch.Tensor,
    v_prefix: torch.Tensor,
    softmax_scale: float | None = None,
    backend: str | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Causal attention of the unit's pieces, each also attending to its prefix cache; returns ``(t, h, hd)``.

    ``piece_lens[i]`` tokens of piece i are packed in q/k/v in order; ``prefix_lens[i]`` is its prefix length (0: a
    whole sequence or a first segment). Gradients flow to q, k, v and to ``k_prefix``/``v_prefix``. ``window``: a
    sliding window of that many keys (query ``i`` sees keys ``i - window < j <= i`` of its sequence)."""
    check_window(window, True, where="segment_attn_func")
    if len(piece_lens) != len(prefix_lens):
        raise ValueError(f"{len(piece_lens)} pieces but {len(prefix_lens)} prefix lengths")
    if any(n < 1 for n in piece_lens) or any(p < 0 for p in prefix_lens):
        raise ValueError(f"piece lengths must be >= 1 and prefix lengths >= 0, got {piece_lens}, {prefix_lens}")
    if sum(piece_lens) != q.shape[0] or k.shape[0] != q.shape[0]:
        raise ValueError(f"pieces hold {sum(piece_lens)} tokens, q has {q.shape[0]} and k {k.shape[0]}")
    if sum(prefix_lens) != k_prefix.shape[0] or v_prefix.shape[0] != k_prefix.shape[0]:
        raise ValueError(f"prefixes hold {sum(prefix_lens)} tokens, k_prefix has {k_prefix.shape[0]}")
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    pre = _prefix(piece_lens, prefix_lens, window)
    return _SegmentAttn.apply(q, k, v, k_prefix, v_prefix, _seqlens(piece_lens), window, pre, scale, backend)
