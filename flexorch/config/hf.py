"""A Hugging Face model directory as a :class:`~flexorch.config.model.ModelConfig`, checked without torch.

``[model] hf = "DIR"`` names a local directory as ``save_pretrained`` writes it: ``config.json``, optional
safetensors weights (``model.safetensors``, or shards listed in ``model.safetensors.index.json``) and optional
tokenizer files. Without weights the model is initialised at random from the architecture config. Everything that
can be wrong with the directory is found here, from ``config.json`` and the safetensors headers alone (the header
is 8 bytes of little-endian length, then JSON naming each tensor's dtype and shape), before any worker starts:

- a path that does not exist (a Hub id gets its own message: flexorch never downloads);
- a model that is not a causal LM of a family flexorch runs (``llama``, ``mistral``, ``qwen2``: pre-norm RMSNorm
  decoders with rotary embeddings, grouped-query attention and a SwiGLU MLP, whose attention Transformers lets us
  replace through its ``AttentionInterface``);
- an option flexorch's attention does not compute (attention dropout, a head size other than hidden / heads,
  biases Transformers' config adds; a sliding window shorter than the run's longest document, checked by the run);
- weights missing from the checkpoint or of another shape than the config implies.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

from flexorch.config.errors import ConfigError

__all__ = ["HF_FAMILIES", "hf_model_config", "hf_param_shapes", "hf_weight_files", "read_safetensors_header"]

HF_FAMILIES = ("llama", "mistral", "qwen2")
"""``model_type`` values flexorch trains (their modeling code is used as Transformers ships it)."""

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def hf_param_shapes(
    *, vocab_size: int, dim: int, num_layers: int, num_heads: int, num_kv_heads: int, ffn_dim: int,
    qkv_bias: bool, tie_embeddings: bool,
) -> list[tuple[str, tuple[int, ...]]]:  # fmt: skip
    """``(name, shape)`` of every parameter of a Llama/Mistral/Qwen2 ``...ForCausalLM`` in ``named_parameters``
    order (the names its safetensors files use; ``lm_head.weight`` only when untied). A test checks this list
    against the model Transformers builds for each family."""
    hd = dim // num_heads
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab_size, dim))]
    for i in range(num_layers):
        p = f"model.layers.{i}."
        for proj, rows in (("q", num_heads * hd), ("k", num_kv_heads * hd), ("v", num_kv_heads * hd)):
            out.append((f"{p}self_attn.{proj}_proj.weight", (rows, dim)))
            if qkv_bias:
                out.append((f"{p}self_attn.{proj}_proj.bias", (rows,)))
        out += [
            (p + "self_attn.o_proj.weight", (dim, num_heads * hd)),
            (p + "mlp.gate_proj.weight", (ffn_dim, dim)),
            (p + "mlp.up_proj.weight", (ffn_dim, dim)),
            (p + "mlp.down_proj.weight", (dim, ffn_dim)),
            (p + "input_layernorm.weight", (dim,)),
            (p + "post_attention_layernorm.weight", (dim,)),
        ]
    out.append(("model.norm.weight", (dim,)))
    if not tie_embeddings:
        out.append(("lm_head.weight", (vocab_size, dim)))
    return out


def _where_is(path: str) -> Path:
    if not isinstance(path, str) or not path:
        raise ConfigError(f"[model] hf must be the path of a local model directory, got {path!r}")
    d = Path(path).expanduser()
    if d.exists():
        if not d.is_dir():
            raise ConfigError(f"[model] hf = {path!r} is a file; give the directory that holds config.json")
        return d.resolve()
    if _HUB_ID.match(path) and not path.startswith((".", "~")):
        raise ConfigError(
            f"[model] hf = {path!r} is not a local directory; it looks like a Hugging Face Hub id, and flexorch "
            f"never downloads. Fetch it first (`hf download {path} --local-dir models/{path.split('/')[-1]}`) and "
            "set hf to that directory"
        )
    raise ConfigError(f"[model] hf: directory {path!r} does not exist (relative paths are from {Path.cwd()})")


def _read_config(d: Path) -> dict:
    f = d / "config.json"
    if not f.is_file():
        raise ConfigError(f"[model] hf: {d} has no config.json; give a directory that save_pretrained wrote")
    try:
        cfg = json.loads(f.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"[model] hf: {f} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"[model] hf: {f} must hold a JSON object, got {type(cfg).__name__}")
    return cfg


def _check_family(cfg: dict, d: Path) -> str:
    family = cfg.get("model_type")
    arches = cfg.get("architectures") or []
    not_lm = [a for a in arches if not str(a).endswith("ForCausalLM")]
    if arches and len(not_lm) == len(arches):
        raise ConfigError(
            f"[model] hf: {d} holds a {', '.join(map(str, arches))}, not a causal language model "
            f"(...ForCausalLM); flexorch trains next-token prediction with {', '.join(HF_FAMILIES)} models"
        )
    if family not in HF_FAMILIES:
        raise ConfigError(
            f"[model] hf: {d} has model_type {family!r}; flexorch trains the {', '.join(HF_FAMILIES)} families "
            "(their attention is replaced through Transformers' AttentionInterface, their code is not forked)"
        )
    return family


def _int(cfg: dict, key: str, d: Path, default=None) -> int:
    v = cfg.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ConfigError(f"[model] hf: {d}/config.json: {key} must be an integer >= 1, got {v!r}")
    return v


def _window(cfg: dict, family: str, d: Path) -> int | None:
    """The sliding attention window (tokens) the model uses, or None. flexorch's attention is full causal attention
    within each document, the same as a window no shorter than the longest document: the run checks
    ``[data] max_context`` against it (``TrainConfig``)."""
    window = cfg.get("sliding_window")
    if window is None or (family == "qwen2" and not cfg.get("use_sliding_window")):
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ConfigError(f"[model] hf: {d}/config.json: sliding_window must be an integer or null, got {window!r}")
    return window


def _check_unsupported(cfg: dict, family: str, d: Path, dim: int, heads: int) -> None:
    where = f"[model] hf: {d}/config.json"
    if cfg.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{where}: hidden_act {cfg['hidden_act']!r}; flexorch's cost model and tests cover silu")
    if float(cfg.get("attention_dropout", 0.0) or 0.0) != 0.0:
        raise ConfigError(f"{where}: attention_dropout {cfg['attention_dropout']}; flexorch's attention has no "
                          "dropout: set it to 0.0")  # fmt: skip
    head_dim = cfg.get("head_dim")
    if head_dim is not None and head_dim != dim // heads:
        raise ConfigError(
            f"{where}: head_dim {head_dim} differs from hidden_size / num_attention_heads = {dim // heads}; "
            "flexorch's cost model and sharding assume head_dim = hidden / heads"
        )
    if family != "qwen2" and (cfg.get("attention_bias") or cfg.get("mlp_bias")):
        raise ConfigError(f"{where}: attention_bias / mlp_bias are not supported; set them to false")


def hf_weight_files(d: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (empty when the directory has no weights)."""
    index = d / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ConfigError(f"[model] hf: {index} is not a safetensors index (no weight_map): {e}") from None
        return {name: d / file for name, file in weight_map.items()}
    single = d / "model.safetensors"
    if single.is_file():
        return dict.fromkeys(read_safetensors_header(single), single)
    if any(d.glob("*.bin")) or any(d.glob("*.pt")):
        raise ConfigError(
            f"[model] hf: {d} holds PyTorch pickle weights (*.bin); flexorch reads safetensors only (they load "
            "tensor by tensor and run no code): re-save with save_pretrained(..., safe_serialization=True)"
        )
    return {}


def read_safetensors_header(path: Path) -> dict[str, dict]:
    """``{tensor name: {"dtype", "shape", "data_offsets"}}`` from a safetensors file's header (no tensor data)."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > 100_000_000:
                raise ValueError(f"header of {n} bytes")
            header = json.loads(f.read(n))
    except (OSError, struct.error, ValueError) as e:
        raise ConfigError(f"[model] hf: {path} is not a readable safetensors file: {e}") from None
    header.pop("__metadata__", None)
    return header


def _check_weights(d: Path, files: dict[str, Path], shapes: list) -> None:
    headers: dict[Path, dict] = {}
    missing, wrong = [], []
    for name, shape in shapes:
        if name not in files:
            missing.append(name)
            continue
        f = files[name]
        if f not in headers:
            if not f.is_file():
                raise ConfigError(f"[model] hf: the safetensors index of {d} names {f.name}, which is missing")
            headers[f] = read_safetensors_header(f)
        entry = headers[f].get(name)
        if entry is None:
            missing.append(name)
        elif tuple(entry["shape"]) != tuple(shape):
            wrong.append(f"{name} is {tuple(entry['shape'])}, the config implies {tuple(shape)}")
    if missing or wrong:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing (first: {', '.join(missing[:3])})")
        if wrong:
            parts.append(f"{len(wrong)} of the wrong shape ({'; '.join(wrong[:3])})")
        raise ConfigError(
            f"[model] hf: the weights in {d} do not match its config.json: {' and '.join(parts)}. Re-save the "
            "model with save_pretrained, or remove the weights to start from a random initialisation"
        )


def hf_model_config(path: str) -> dict:
    """The :class:`~flexorch.config.model.ModelConfig` fields of the model in directory ``path`` (checked; see the
    module docstring): shape, ``hf`` (the absolute directory), ``family``, ``qkv_bias``, ``hf_weights``."""
    d = _where_is(path)
    cfg = _read_config(d)
    family = _check_family(cfg, d)
    dim = _int(cfg, "hidden_size", d)
    heads = _int(cfg, "num_attention_heads", d)
    if dim % heads:
        raise ConfigError(f"[model] hf: {d}/config.json: hidden_size {dim} is not divisible by {heads} heads")
    _check_unsupported(cfg, family, d, dim, heads)
    rope = cfg.get("rope_parameters") or {}
    theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0) if isinstance(rope, dict) else 10000.0)
    fields = {
        "vocab_size": _int(cfg, "vocab_size", d),
        "dim": dim,
        "num_layers": _int(cfg, "num_hidden_layers", d),
        "num_heads": heads,
        "num_kv_heads": _int(cfg, "num_key_value_heads", d, heads),
        "ffn_dim": _int(cfg, "intermediate_size", d),
        "rope_theta": float(theta),
        "norm_eps": float(cfg.get("rms_norm_eps", 1e-6)),
        "init_std": float(cfg.get("initializer_range", 0.02)),
        "tie_embeddings": bool(cfg.get("tie_word_embeddings", False)),
        "hf": str(d),
        "family": family,
        "attention_window": _window(cfg, family, d),
        "qkv_bias": family == "qwen2",
    }
    files = hf_weight_files(d)
    if files:
        keys = ("vocab_size", "dim", "num_layers", "num_heads", "num_kv_heads", "ffn_dim", "qkv_bias")
        shapes = hf_param_shapes(**{k: fields[k] for k in keys}, tie_embeddings=fields["tie_embeddings"])
        _check_weights(d, files, shapes)
    fields["hf_weights"] = bool(files)
    return fields
