"""Varlen attention kernels behind one small interface: forward returns the log-sum-exp, backward takes it.

``attn_forward(q, k, v, cu_q, cu_k, ...) -> (out, lse)`` and ``attn_backward(dout, q, k, v, out, lse, ...)``
follow flash-attn's varlen convention: ``q`` is ``(t_q, h, hd)``, ``k``/``v`` are ``(t_k, h_kv, hd)`` with
``h % h_kv == 0`` (GQA: query head ``j`` reads KV head ``j // (h // h_kv)``), ``lse`` is ``(h, t_q)`` in
:func:`acc_dtype` (float32; float64 for fp64 inputs), and document ``i`` of q attends only to document ``i`` of k
(causal: top-left aligned, used only with equal lengths). The backward takes ``out``/``lse`` of the *whole*
attention, not of this block, so that ring attention can sum block gradients (flash-attn backward;
FlashAttention-2, arXiv 2307.08691, Alg. 2).

Sliding window (``window=w``, Hugging Face Transformers' ``sliding_window``: ``masking_utils.sliding_window_overlay``
keeps ``kv_idx > q_idx - sliding_window``): a query at position ``i`` of a document sees the keys at positions
``i - w < j <= i`` of that document, ``w`` keys itself included; it needs ``causal``. A call may say where its
blocks sit inside each document with ``shift``: per document, the position of its first query row minus that of its
first key row (None: 0 for every document, the top-left diagonal). Query row ``a`` and key row ``b`` of document
``i`` are then ``a + shift[i] - b`` positions apart; causal keeps distances ``>= 0``, the window ``< w``. Ring
attention uses it for a K/V block that sits at another offset of the document than its queries (:mod:`~.ring_plan`).
A query row that sees no key of the call gets ``out = 0``, ``lse = -inf`` and no gradient (the merge then ignores
it, :mod:`~.merge`).

Backends, fastest first (:func:`available_backends`), and the dtypes each runs (:data:`DTYPES`; anything else is
refused at the call with the policy in the message, never run at a silently lower precision):

* ``"flash_attn"``: flash-attn's CUDA varlen kernels (optional dependency, imported lazily); fp16, bf16.
* ``"torch_cudnn"``: cuDNN's fused attention for the long documents (one dense call each, :mod:`~.torch_cudnn`), the
  rest on ``torch_flash``; CUDA; fp16, bf16. Faster than ``torch_flash`` on an H200
  (``benchmarks/results/gpu/gpu_profile_h200.md``).
* ``"torch_flash"``: PyTorch's own fused varlen flash kernels (``aten::_flash_attention_forward``/``_backward``,
  :mod:`~.torch_flash`); CUDA without flash-attn; fp16, bf16.
* ``"torch_cpu"``: ``aten._scaled_dot_product_flash_attention_for_cpu`` and its ``_backward`` (both return /
  take the logsumexp) called per document; runs of short documents go into one call with a block-diagonal
  mask. fp16, bf16, fp32, fp64.
* ``"math"``: explicit matmul + logsumexp per document with a hand-written backward; any device, every float
  dtype. The reference, slow (a Python loop over documents): never chosen by default on CUDA.

Which one runs by default on a GPU is measured, not assumed: :mod:`~.choice` times the exact candidates on the
worker's device, dtype and head shape at start and sets it (:func:`set_default_backend`); until then, and where
nothing was measured, flash_attn, else torch_flash.

Windows (:data:`WINDOW_BACKENDS`): flash_attn and torch_flash pass ``(w - 1, 0)`` as the kernels' (left, right)
window, which flash-attn aligns bottom-right (query ``i`` sees keys ``[i + lk - lq - left, i + lk - lq + right]``),
so only blocks whose shift is ``lk - lq`` in every document go to them (all of Ulysses' and the varlen function's,
the ring's diagonal); the others (the ring's window-edge blocks, a pipeline segment's prefix) run on
:data:`OFFSET_BACKENDS` (``math`` on CUDA). torch_cudnn refuses a window: torch's cuDNN attention ops take none.

fp32 and fp64 on CUDA have no fused kernel here: :func:`default_backend` refuses them (train in bf16, ``[sharding]
precision``) unless ``backend="math"`` is asked for. Accumulation (the LSE, ring and merge buffers) is in
:func:`acc_dtype`: float32 for 16- and 32-bit inputs, float64 for fp64, so an fp64 call is fp64-exact end to end.
"""

from __future__ import annotations

import functools

import torch

from flexorch.workers.attention.flash import flash_attn_module, flash_backward, flash_forward
from flexorch.workers.attention.seqlens import Seqlens
from flexorch.workers.attention.sharding import check_cu_seqlens
from flexorch.workers.attention.torch_cpu import acc_dtype, cpu_backward, cpu_forward, math_backward, math_forward
from flexorch.workers.attention.torch_cudnn import torch_cudnn_available, torch_cudnn_backward, torch_cudnn_forward
from flexorch.workers.attention.torch_flash import (
    torch_flash_available,
    torch_flash_backward,
    torch_flash_forward,
    torch_flash_window_available,
)

__all__ = [
    "BACKENDS",
    "DTYPES",
    "OFFSET_BACKENDS",
    "WINDOW_BACKENDS",
    "Seqlens",
    "acc_dtype",
    "attn_backward",
    "attn_forward",
    "available_backends",
    "check_qkv",
    "check_sinks",
    "check_varlen_args",
    "check_window",
    "default_backend",
    "resolve_backend",
    "sink_grad",
    "set_default_backend",
    "varlen_attn",
    "with_sinks",
]

BACKENDS = ("flash_attn", "torch_cudnn", "torch_flash", "torch_cpu", "math")
_HALF = (torch.float16, torch.bfloat16)
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
DTYPES: dict[str, tuple[torch.dtype, ...]] = {
    "flash_attn": _HALF,
    "torch_cudnn": _HALF,
    "torch_flash": _HALF,
    "torch_cpu": _FLOATS,
    "math": _FLOATS,
}
"""The input dtypes each backend runs exactly (to that dtype's tolerance)."""
_DEVICE = {"flash_attn": "cuda", "torch_cudnn": "cuda", "torch_flash": "cuda", "torch_cpu": "cpu"}  # math: any device
WINDOW_BACKENDS = ("flash_attn", "torch_flash", "torch_cpu", "math")
"""The backends that compute a sliding window (``window=``); torch_cudnn does not (torch's cuDNN ops take none)."""
OFFSET_BACKENDS = ("torch_cpu", "math")
"""The backends that take any per-document ``shift``; a block the others cannot align runs on ``math`` instead."""
_FLASH_WINDOW = functools.cache(torch_flash_window_available)  # this torch's flash ops take a window


def check_sinks(sinks, q: torch.Tensor, *, where: str) -> None:
    """Raise ValueError unless ``sinks`` is None or a float tensor of one logit per query head of ``q``."""
    if sinks is None:
        return
    if not isinstance(sinks, torch.Tensor) or not sinks.is_floating_point() or tuple(sinks.shape) != (q.shape[1],):
        got = tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__
        raise ValueError(
            f"{where}: sinks must be a float tensor of one logit per query head ({q.shape[1]},), got {got}"
        )


def check_window(window: int | None, causal: bool, *, where: str) -> None:
    """Raise ValueError unless ``window`` is None or an int >= 1 and the attention is causal (a sliding window is)."""
    if window is None:
        return
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(
            f"{where}: window must be an int >= 1 (query i sees keys i - window < j <= i of its document) or None, "
            f"got {window!r}"
        )
    if not causal:
        raise ValueError(f"{where}: window={window} needs causal=True (a sliding window is causal)")


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, where: str) -> None:
    """Raise ValueError unless q is (t, h, hd) and k, v are (t, h_kv, hd) with h % h_kv == 0."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"{where}: q, k, v must be (tokens, heads, head_dim), got {_shapes(q, k, v)}")
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"{where}: mismatched shapes {_shapes(q, k, v)}")
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"{where}: {q.shape[1]} query heads are not a multiple of {k.shape[1]} KV heads")
    if not (q.dtype == k.dtype == v.dtype) or not (q.device == k.device == v.device):
        raise ValueError(f"{where}: q, k, v must share dtype and device, got {q.dtype}/{k.dtype}/{v.dtype}")


def check_varlen_args(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int | None,
    degree: int,
    *,
    where: str,
) -> Seqlens:
    """Validate the arguments of a ``*_varlen_func`` whose local shard is 1/degree of the batch.

    Depends only on shapes and ``cu_seqlens``, so consistent inputs fail identically on every rank, before any
    collective runs.
    """
    check_qkv(q, k, v, where=where)
    try:
        offsets = check_cu_seqlens(cu_seqlens, q.shape[0] * degree)
    except ValueError as e:
        raise ValueError(f"{where}: {e} (local shard of {q.shape[0]} tokens x degree {degree})") from None
    seqlens = Seqlens(tuple(offsets))
    if max_seqlen is not None and max_seqlen < seqlens.max_seqlen:
        raise ValueError(f"{where}: max_seqlen={max_seqlen} < longest document {seqlens.max_seqlen}")
    return seqlens


def _shapes(*ts: torch.Tensor) -> str:
    return ", ".join(str(tuple(t.shape)) for t in ts)


def _installed(name: str) -> bool:
    if name == "flash_attn":
        return flash_attn_module() is not None and torch.cuda.is_available()
    if name == "torch_flash":
        return torch_flash_available()
    if name == "torch_cudnn":
        return torch_cudnn_available()
    return True


_CHOSEN: dict[tuple[str, torch.dtype], str] = {}
"""The measured default per (device type, dtype): set by :func:`set_default_backend` (``choice.choose_backend``)."""


def set_default_backend(device: torch.device, dtype: torch.dtype, name: str | None) -> None:
    """Make ``name`` the backend :func:`default_backend` returns for ``dtype`` on ``device``'s type in this process
    (None: back to the static preference)."""
    if name is None:
        _CHOSEN.pop((device.type, dtype), None)
        return
    if name not in BACKENDS or dtype not in DTYPES[name] or _DEVICE.get(name, device.type) != device.type:
        fits = available_backends(device, dtype)
        raise ValueError(
            f"[model] attention = {name!r} cannot run {str(dtype).removeprefix('torch.')} on {device.type}: "
            f"here that runs on {fits} (or 'auto', the fastest exact one measured)"
        )
    _CHOSEN[(device.type, dtype)] = name


def available_backends(device: torch.device, dtype: torch.dtype) -> list[str]:
    """The backends that run ``dtype`` on ``device`` here, fastest first (``math``, the reference, last)."""
    return [b for b in BACKENDS if dtype in DTYPES[b] and _DEVICE.get(b, device.type) == device.type and _installed(b)]


def _policy(device: torch.device, dtype: torch.dtype) -> str:
    return (
        f"attention on {device.type} runs "
        + "; ".join(
            f"{b}: {', '.join(str(d).removeprefix('torch.') for d in DTYPES[b])}"
            for b in BACKENDS
            if _DEVICE.get(b, device.type) == device.type
        )
        + f"; got {str(dtype).removeprefix('torch.')}"
    )


def default_backend(device: torch.device, dtype: torch.dtype = torch.float32, *, window: bool = False) -> str:
    """The fastest backend for ``dtype`` on ``device``: flash_attn, else torch_flash on CUDA (fp16/bf16); torch_cpu
    on CPU; math elsewhere. fp32/fp64 on CUDA raise ValueError (no fused kernel; the math path is opt-in).
    ``window``: for a call with a sliding window, one of :data:`WINDOW_BACKENDS` (a measured default that is not one
    is passed over for the static preference, which is)."""
    chosen = _CHOSEN.get((device.type, dtype))
    if chosen is not None and (not window or chosen in WINDOW_BACKENDS):
        return chosen
    if device.type == "cuda":
        if dtype not in _HALF:
            raise ValueError(
                f"{_policy(device, dtype)}. On CUDA attention is fused only in fp16/bf16: train with "
                '`[sharding] precision = "bf16"` (the default on GPU with a sharded mode) or cast q/k/v, or pass '
                "backend='math' for the slow unfused reference"
            )
        if flash_attn_module() is not None:
            return "flash_attn"
        if torch_flash_available():
            return "torch_flash"
        raise ValueError(
            "no fused CUDA attention here: this torch has no aten::_flash_attention_forward and "
            "flash-attn is not installed (pip install flash-attn), or pass backend='math'"
        )
    return "torch_cpu" if device.type == "cpu" else "math"


_FORWARD = {
    "torch_cpu": cpu_forward,
    "math": math_forward,
    "flash_attn": flash_forward,
    "torch_flash": torch_flash_forward,
    "torch_cudnn": torch_cudnn_forward,
}
_BACKWARD = {
    "torch_cpu": cpu_backward,
    "math": math_backward,
    "flash_attn": flash_backward,
    "torch_flash": torch_flash_backward,
    "torch_cudnn": torch_cudnn_backward,
}


def resolve_backend(backend: str | None, q: torch.Tensor, *, window: int | None = None) -> str:
    """The backend that runs ``q``'s device and dtype (``backend``, or :func:`default_backend`) and, given one,
    a sliding ``window``; ValueError with the policy when it cannot. Depends only on ``q``'s device and dtype and on
    the window: called before any collective."""
    name = backend or default_backend(q.device, q.dtype, window=window is not None)
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {BACKENDS}")
    if window is not None and (name not in WINDOW_BACKENDS or name == "torch_flash" and not _FLASH_WINDOW()):
        why = "torch's cuDNN attention ops take none" if name == "torch_cudnn" else "this torch's flash ops take none"
        raise ValueError(
            f"backend {name!r} cannot compute a sliding window (window={window}): {why}; use one of {WINDOW_BACKENDS}"
        )
    want = _DEVICE.get(name)
    if want is not None and q.device.type != want:
        raise ValueError(f"backend {name!r} needs {want.upper()} tensors, got {q.device}")
    if name == "flash_attn" and flash_attn_module() is None:
        raise ValueError("backend 'flash_attn' needs the flash-attn package (pip install flash-attn)")
    if q.dtype not in DTYPES[name]:
        raise ValueError(f"backend {name!r} cannot run {q.dtype}: {_policy(q.device, q.dtype)}")
    return name


def _bottom_right(cu_q: Seqlens, cu_k: Seqlens, shift: tuple[int, ...] | None) -> bool:
    """True when every document's first query row sits ``lk - lq`` positions after its first key row: the causal
    diagonal (and window) where flash-attn's and ATen's kernels put it (bottom-right)."""
    if shift is None:
        return cu_q.offsets == cu_k.offsets  # top-left = bottom-right for equal lengths
    q, k = cu_q.offsets, cu_k.offsets
    return all(shift[i] == (k[i + 1] - k[i]) - (q[i + 1] - q[i]) for i in range(len(q) - 1))


def _kernel(backend, q, cu_q, cu_k, causal, window, shift) -> tuple[str, int | None]:
    """The backend of one call and the window it needs (None where no distance in it reaches the window)."""
    name = resolve_backend(backend, q, window=window)
    if shift is not None and len(shift) != len(cu_q.offsets) - 1:
        raise ValueError(f"shift has {len(shift)} entries for {len(cu_q.offsets) - 1} documents")
    if window is not None and shift is None and cu_q.max_seqlen <= window:
        window = None  # every distance is < max_seqlen <= window: plain causal attention, the fast path
    if causal and name not in OFFSET_BACKENDS and not _bottom_right(cu_q, cu_k, shift):
        name = "math"  # flash-attn / ATen align the diagonal bottom-right only: this block runs where any aligns
    return name, window


def _extra(name: str, window: int | None, shift: tuple[int, ...] | None) -> dict:
    """The keywords a backend function gets beyond the plain call: ``shift`` only where any is taken (elsewhere the
    block is bottom-right aligned, which is the kernel's own), ``window`` where set."""
    extra = {"window": window} if window is not None else {}
    return (extra | {"shift": shift}) if shift is not None and name in OFFSET_BACKENDS else extra


def attn_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: Seqlens,
    cu_k: Seqlens,
    *,
    causal: bool,
    softmax_scale: float,
    backend: str | None = None,
    window: int | None = None,
    shift: tuple[int, ...] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(t_q, h, hd), (t_k, h_kv, hd) x2 -> out (t_q, h, hd), lse (h, t_q) in acc_dtype(q.dtype).

    ``window``: a sliding window (needs ``causal``); ``shift``: per document, the position of its first query row
    minus that of its first key row (None: 0). See the module doc."""
    name, window = _kernel(backend, q, cu_q, cu_k, causal, window, shift)
    return _FORWARD[name](q, k, v, cu_q, cu_k, causal, softmax_scale, **_extra(name, window, shift))


def attn_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_q: Seqlens,
    cu_k: Seqlens,
    *,
    causal: bool,
    softmax_scale: float,
    backend: str | None = None,
    window: int | None = None,
    shift: tuple[int, ...] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of q, k, v for one block given the full attention's ``out`` and ``lse`` (``window``, ``shift``: as
    in :func:`attn_forward`)."""
    name, window = _kernel(backend, q, cu_q, cu_k, causal, window, shift)
    args = (dout, q, k, v, out, lse, cu_q, cu_k, causal, softmax_scale)
    return _BACKWARD[name](*args, **_extra(name, window, shift))


def with_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention whose softmax also holds a learned logit per head (GPT-OSS's ``sinks``: Transformers'
    ``eager_attention_forward`` of ``gpt_oss`` concatenates it to each row's scores and drops its column after the
    softmax): a key with that score and a zero value. ``out (t, h, hd)``, ``lse (h, t)`` of the attention without it
    -> the same with the sink in every row's normaliser: ``lse' = logaddexp(lse, sink)``, ``out' = out * exp(lse -
    lse')``. A standard backward given ``out'`` and ``lse'`` is then the exact gradient of q, k and v
    (``P' = exp(S - lse') = P w``, ``D = rowsum(dO * out')``), so every kernel runs it unchanged; the sinks' own
    gradient is :func:`sink_grad`."""
    lse_s = torch.logaddexp(lse, sinks.detach().to(lse.dtype)[:, None])  # (h, t)
    return out * torch.exp(lse - lse_s).t()[..., None].to(out.dtype), lse_s  # (h, t) -> (t, h, 1)


def sink_grad(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """The gradient of the sinks (h,) from ``dout``, and ``out``/``lse`` as :func:`with_sinks` returned them: with
    ``w = exp(lse_plain - lse)``, ``d out / d sink = -out (1 - w)`` and ``1 - w = exp(sink - lse)``."""
    acc = lse.dtype
    along = (dout.to(acc) * out.to(acc)).sum(-1).t()  # (t, h) -> (h, t)
    return -(along * torch.exp(sinks.detach().to(acc)[:, None] - lse)).sum(1).to(sinks.dtype)


class _VarlenAttn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, seqlens, causal, scale, backend, window, sinks):
        kw = {"causal": causal, "softmax_scale": scale, "backend": backend, "window": window}
        out, lse = attn_forward(q, k, v, seqlens, seqlens, **kw)
        if sinks is not None:
            out, lse = with_sinks(out, lse, sinks)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.args = (seqlens, kw)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        seqlens, kw = ctx.args
        grads = attn_backward(dout, q, k, v, out, lse, seqlens, seqlens, **kw)
        dsinks = sink_grad(dout, out, lse, sinks) if sinks is not None and ctx.needs_input_grad[8] else None
        return (*grads, None, None, None, None, None, dsinks)


def varlen_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seqlens: Seqlens,
    *,
    causal: bool,
    softmax_scale: float,
    backend: str | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable single-device varlen attention (same documents for q and k): returns (out, lse).
    ``window``: a sliding window of that many keys (needs ``causal``); ``sinks (h,)``: a learned logit per head in
    every row's softmax (:func:`with_sinks`), differentiable."""
    return _VarlenAttn.apply(q, k, v, seqlens, causal, softmax_scale, backend, window, sinks)
