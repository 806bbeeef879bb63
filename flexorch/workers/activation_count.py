"""What a Llama-shaped decoder keeps for the backward per token in each recompute mode, counted by hand from the
kernels flexorch runs eagerly: the arithmetic the activation meter (``flexorch.workers.activation_memory``) is checked
against, and what a measured ratio between modes is expected to be near.

Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models" (arXiv 2205.05198, Sec. 4.1)
count ``34 s b h + 5 a s^2 b`` bytes per layer without recompute (16-bit activations, dropout masks, a 4h GELU MLP,
attention scores kept) and ``2 s b h`` with full recompute. flexorch's layers differ: no dropout, flash-style
attention (its log-sum-exp instead of the ``s^2`` scores), RMSNorm computed in float32, grouped-query attention and a
SwiGLU MLP. Per token, with ``D`` the hidden size, ``Q = heads x head_dim``, ``K = kv_heads x head_dim``, ``F`` the
MLP width, ``H`` the heads and ``p`` the bytes of an activation (4 float32, 2 bf16), what autograd saves is:

* each RMSNorm: its input as float32 (``4D``: the input itself in float32, its float32 copy in bf16), ``rsqrt`` of the
  mean square (4), the normalised value before the weight (``pD``) and after it (``pD``, the next matmul's input);
* attention: the kernel's q and k after RoPE, v, its output and its float32 log-sum-exp (``p(2Q + 2K) + 4H``);
  RoPE keeps only cos/sin (shared by the layers), the output projection the kernel's output;
* the SwiGLU MLP: ``w1 x``, ``silu(w1 x)``, ``w3 x`` and their product (``4pF``).

So a layer keeps ``8D + p(4D + 2Q + 2K + 4F) + 4H + 8`` without recompute (two norms); with full recompute only its
input (``pD``, :func:`flexorch.workers.recompute.checkpointed`); with selective recompute what is left when the MLP
is recomputed: flexorch's decoder recomputes the MLP with its norm (``4D + p(3D + 2Q + 2K) + 4H + 4``: one norm, and
the MLP's input), a Transformers layer its ``mlp`` only, the norm before it kept (``8D + p(4D + 2Q + 2K) + 4H + 8``).

Beside the layers a step keeps the token ids and labels (int64, 16), the final norm (``4D + 4 + 2pD``, its output the
chunked loss's input) and RoPE's cos/sin: float32 ``(t, head_dim / 2)`` each in flexorch's decoder (``4 head_dim``),
``(t, head_dim)`` in the activations' dtype in a Transformers model (``2p head_dim``; with full recompute they are held
by the recompute's closure, which the meter does not see, so 0 here). For a 1.1B Llama (D 2048, 22 layers, F 5632,
16 heads of 128, 4 KV heads) in bf16: 88,136 bytes per layer without recompute, 4,096 with full recompute: none keeps
about 18x what full keeps (eager kernels; a compiled layer keeps less without recompute, Inductor recomputing cheap
elementwise results).

Not counted (the meter does not count them either): the CPU random-number state each checkpoint keeps (5 KB in host
memory per checkpoint), and the transient of a recompute (one layer's activations, re-made during its backward).
FSDP2 with bf16 compute casts each layer's float inputs, cos/sin among them, to bf16: flexorch's decoder then keeps a
bf16 copy of cos/sin per layer (``2 head_dim`` more per layer, not counted here).
"""

from __future__ import annotations

from flexorch.config.model import ModelConfig

__all__ = ["layer_bytes_per_token", "model_bytes_per_token"]


def _shape(cfg: ModelConfig) -> tuple[int, int, int, int, int]:
    hd = cfg.head_dim
    return cfg.dim, cfg.num_heads * hd, cfg.num_kv_heads * hd, cfg.ffn_dim, cfg.num_heads


def layer_bytes_per_token(cfg: ModelConfig, mode: str, p: int = 4, *, hf: bool = False) -> int:
    """Bytes one decoder layer of ``cfg`` keeps per token for the backward in recompute ``mode``, its activations
    ``p`` bytes each (module docstring); ``hf``: a Transformers layer (its selective recompute keeps the MLP's norm)."""
    d, q, k, f, h = _shape(cfg)
    attention = p * (2 * q + 2 * k) + 4 * h
    if mode == "none":
        return 8 * d + p * (4 * d + 4 * f) + attention + 8
    if mode == "full":
        return p * d
    if mode == "selective":
        return 8 * d + p * 4 * d + attention + 8 if hf else 4 * d + p * 3 * d + attention + 4
    raise ValueError(f"recompute mode must be 'none', 'selective' or 'full', got {mode!r}")


def model_bytes_per_token(cfg: ModelConfig, mode: str, p: int = 4, *, hf: bool = False) -> int:
    """Bytes per token the whole model keeps for the backward of a training step's forward and loss in ``mode``:
    its layers (:func:`layer_bytes_per_token`), ids and labels, the final norm and RoPE's cos/sin."""
    d, hd = cfg.dim, cfg.head_dim
    rope = (0 if mode == "full" else 2 * p * hd) if hf else 4 * hd
    return cfg.num_layers * layer_bytes_per_token(cfg, mode, p, hf=hf) + 16 + 4 * d + 4 + 2 * p * d + rope
