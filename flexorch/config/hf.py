"""A Hugging Face model directory as a :class:`~flexorch.config.model.ModelConfig`, checked without torch.

``[model] hf = "DIR"`` names a local directory as ``save_pretrained`` writes it: ``config.json``, optional
safetensors weights (``model.safetensors``, or shards listed in ``model.safetensors.index.json``) and optional
tokenizer files. Without weights the model is initialised at random from the architecture config. Everything that
can be wrong with the directory is found here, from ``config.json`` and the safetensors headers alone (the header
is 8 bytes of little-endian length, then JSON naming each tensor's dtype and shape), before any worker starts:

- a path that does not exist (a Hub id gets its own message: flexorch never downloads);
- a model that is not a causal LM of a family flexorch runs (:data:`HF_FAMILIES`: decoders with rotary embeddings
  and grouped-query attention whose attention Transformers lets us replace through its ``AttentionInterface``;
  their layouts are in :data:`FAMILY_LAYOUTS`);
- an option flexorch's attention does not compute (attention dropout, logit soft-capping, bidirectional attention,
  layer kinds other than full and sliding-window attention, RoPE variants whose frequencies depend on the batch);
- weights missing from the checkpoint or of another shape than the config implies.

What differs between families is read from the config, not assumed: the head size (``head_dim``; Qwen3 and Gemma 3
set one other than hidden / heads), biases (``attention_bias``, Llama's ``mlp_bias``, Qwen2's q/k/v biases), q/k
norms (Qwen3, Gemma 3: per head; OLMo 2: over the whole projection), the activation, the RoPE scaling
(``rope_parameters`` / ``rope_scaling``: linear, llama3, YaRN) and which layers use a sliding window
(``layer_types`` with ``sliding_window``; Mistral and Phi-3: every layer).
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from flexorch.config.errors import ConfigError
from flexorch.config.hf_moe import MOE_LAYOUTS, moe_fields, moe_mlp_shapes

__all__ = [
    "FAMILY_LAYOUTS",
    "HF_FAMILIES",
    "REFUSED_FAMILIES",
    "FamilyLayout",
    "hf_model_config",
    "hf_param_shapes",
    "hf_weight_files",
    "read_safetensors_header",
]


@dataclass(frozen=True)
class FamilyLayout:
    """How a family's decoder layer names and shapes its parameters (``named_parameters`` order)."""

    architecture: str
    """Its ``...ForCausalLM`` class (what an export's config.json names)."""
    layer_norms: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm")
    """The layer's norms, after its attention and MLP parameters, in registration order."""
    qk_norm: str | None = None
    """``"head"``: ``q_norm``/``k_norm`` of one head's size (Qwen3, Gemma 3); ``"projection"``: of the whole q and
    k projections (OLMo 2); None: no q/k norms."""
    fused: bool = False
    """One ``qkv_proj`` and one ``gate_up_proj`` (Phi-3), the output projection registered first."""
    bias_key: str | None = "attention_bias"
    """The config key that gives q/k/v/o biases (None: the family has none, or fixed ones: ``qkv_bias``)."""
    qkv_bias: bool = False
    """q/k/v biases always, no o bias (Qwen2)."""
    mlp_bias_key: str | None = None
    """The config key that gives the MLP's biases (Llama's ``mlp_bias``)."""
    activation_key: str = "hidden_act"
    norm_ones: bool = True
    """RMSNorm weights start at 1 (``x * w``); False: at 0 (Gemma's ``x * (1 + w)``)."""
    sinks: bool = False
    """A learned sink logit per head in the attention's softmax (``self_attn.sinks``, GPT-OSS), registered first."""


FAMILY_LAYOUTS: dict[str, FamilyLayout] = {
    "llama": FamilyLayout("LlamaForCausalLM", mlp_bias_key="mlp_bias"),
    "mistral": FamilyLayout("MistralForCausalLM", bias_key=None),
    "qwen2": FamilyLayout("Qwen2ForCausalLM", bias_key=None, qkv_bias=True),
    "qwen3": FamilyLayout("Qwen3ForCausalLM", qk_norm="head"),
    "olmo2": FamilyLayout("Olmo2ForCausalLM", qk_norm="projection",
                          layer_norms=("post_attention_layernorm", "post_feedforward_layernorm")),
    "phi3": FamilyLayout("Phi3ForCausalLM", fused=True, bias_key=None),
    "gemma3_text": FamilyLayout(
        "Gemma3ForCausalLM",
        qk_norm="head",
        layer_norms=("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"),
        activation_key="hidden_activation",
        norm_ones=False,
    ),
    "qwen3_moe": FamilyLayout("Qwen3MoeForCausalLM", qk_norm="head"),
    "mixtral": FamilyLayout("MixtralForCausalLM", bias_key=None),
    "olmoe": FamilyLayout("OlmoeForCausalLM", qk_norm="projection"),
    "gpt_oss": FamilyLayout("GptOssForCausalLM", sinks=True),
}  # fmt: skip
"""Each family flexorch trains and how its decoder layer is laid out; ``tests/unit/test_hf_model.py`` checks every
layout against the model Transformers builds."""

HF_FAMILIES = tuple(FAMILY_LAYOUTS)
"""``model_type`` values flexorch trains (their modeling code is used as Transformers ships it)."""

ACTIVATIONS = ("silu", "swish", "gelu", "gelu_new", "gelu_fast", "gelu_pytorch_tanh", "gelu_python", "relu")
"""Activations of the MLP flexorch accepts (Transformers computes them; the cost model counts the matmuls)."""

ROPE_TYPES = ("default", "linear", "llama3", "yarn")
"""RoPE variants whose frequencies are fixed by the config: every token of a document is rotated the same on every
shard of every plan."""

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def hf_param_shapes(m, num_layers: int | None = None) -> list[tuple[str, tuple[int, ...]]]:
    """``(name, shape)`` of every parameter of the ``...ForCausalLM`` of ``m`` (a :class:`~flexorch.config.model.
    ModelConfig` of an HF model, or anything with its fields: ``family``, ``vocab_size``, ``dim``, ``num_layers``,
    ``num_heads``, ``num_kv_heads``, ``head_dim``, ``ffn_dim``, ``qkv_bias``, ``o_bias``, ``mlp_bias``,
    ``tie_embeddings``) in ``named_parameters`` order (the names its safetensors files use; ``lm_head.weight`` only
    when untied). ``num_layers``: that many layers instead of ``m``'s."""
    lay = FAMILY_LAYOUTS[m.family]
    hd, dim, ffn = m.head_dim, m.dim, m.ffn_dim
    q_rows, kv_rows = m.num_heads * hd, m.num_kv_heads * hd
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (m.vocab_size, dim))]
    for i in range(m.num_layers if num_layers is None else num_layers):
        p = f"model.layers.{i}."
        out += [(p + "self_attn.sinks", (m.num_heads,))] if lay.sinks else []
        if lay.fused:
            out += [
                (p + "self_attn.o_proj.weight", (dim, q_rows)),
                (p + "self_attn.qkv_proj.weight", (q_rows + 2 * kv_rows, dim)),
                (p + "mlp.gate_up_proj.weight", (2 * ffn, dim)),
                (p + "mlp.down_proj.weight", (dim, ffn)),
            ]
        else:
            for proj, rows, cols, bias in (("q", q_rows, dim, m.qkv_bias), ("k", kv_rows, dim, m.qkv_bias),
                                           ("v", kv_rows, dim, m.qkv_bias), ("o", dim, q_rows, m.o_bias)):  # fmt: skip
                out.append((f"{p}self_attn.{proj}_proj.weight", (rows, cols)))
                if bias:
                    out.append((f"{p}self_attn.{proj}_proj.bias", (rows,)))
            if lay.qk_norm is not None:
                q_norm, k_norm = (hd, hd) if lay.qk_norm == "head" else (q_rows, kv_rows)
                out += [(p + "self_attn.q_norm.weight", (q_norm,)), (p + "self_attn.k_norm.weight", (k_norm,))]
            if i in getattr(m, "moe_layers", ()):  # experts and their router (flexorch.config.hf_moe)
                out += moe_mlp_shapes(m, p)
            else:
                for proj, rows, cols in (("gate", ffn, dim), ("up", ffn, dim), ("down", dim, ffn)):
                    out.append((f"{p}mlp.{proj}_proj.weight", (rows, cols)))
                    if m.mlp_bias:
                        out.append((f"{p}mlp.{proj}_proj.bias", (rows,)))
        out += [(p + norm + ".weight", (dim,)) for norm in lay.layer_norms]
    out.append(("model.norm.weight", (dim,)))
    if not m.tie_embeddings:
        out.append(("lm_head.weight", (m.vocab_size, dim)))
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


REFUSED_FAMILIES = {
    "gemma3": "Gemma 3 with its vision tower (Gemma3ForConditionalGeneration); flexorch trains text decoders: use "
    "the text model, model_type gemma3_text (Gemma3ForCausalLM: save its config and weights with save_pretrained)",
    "qwen3_next": "Qwen3-Next mixes linear-attention (Gated DeltaNet) layers with full attention; flexorch's "
    "sequence-parallel attention computes softmax attention only",
}
"""``model_type`` values refused with a reason of their own (the rest: the list of :data:`HF_FAMILIES`)."""


def _check_family(cfg: dict, d: Path) -> str:
    family = cfg.get("model_type")
    if family in REFUSED_FAMILIES:
        raise ConfigError(
            f"[model] hf: {d} has model_type {family!r}: {REFUSED_FAMILIES[family]}. flexorch trains the "
            f"{', '.join(HF_FAMILIES)} families"
        )
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


def _layer_types(cfg: dict, family: str, layers: int, where: str) -> list[str]:
    """Each layer's kind, ``"full_attention"`` or ``"sliding_attention"``, as Transformers' config class derives
    them: ``layer_types`` when the config names them; else Qwen2/Qwen3 slide from layer ``max_window_layers`` on when
    ``use_sliding_window``, Gemma 3 every layer but each ``sliding_window_pattern``-th (6), Mistral and Phi-3 every
    layer when ``sliding_window`` is set."""
    window = cfg.get("sliding_window")
    types = cfg.get("layer_types")
    if types is None:
        if family in ("qwen2", "qwen3", "qwen3_moe"):
            on = bool(cfg.get("use_sliding_window")) and window is not None
            first = cfg.get("max_window_layers", 28)
            types = ["sliding_attention" if on and i >= first else "full_attention" for i in range(layers)]
        elif family == "gemma3_text":
            pattern = cfg.get("sliding_window_pattern", 6)
            types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
        elif family in ("mistral", "phi3", "mixtral") and window is not None:
            types = ["sliding_attention"] * layers
        else:
            types = ["full_attention"] * layers
    if not isinstance(types, list) or len(types) != layers:
        raise ConfigError(f"{where}: layer_types must list one kind per layer ({layers}), got {types!r}")
    other = sorted({t for t in types if t not in ("full_attention", "sliding_attention")}, key=str)
    if other:
        raise ConfigError(
            f"{where}: layer_types has {other[0]!r} layers; flexorch's sequence-parallel attention computes "
            "full_attention and sliding_attention layers only (linear-attention and chunked layers are not supported)"
        )
    if family in ("qwen2", "qwen3", "qwen3_moe") and not cfg.get("use_sliding_window"):
        types = ["full_attention"] * layers  # Transformers sets sliding_window to None then
    return types


def _windows(cfg: dict, family: str, layers: int, where: str) -> tuple[int | None, tuple[int, ...]]:
    """``(window, layers that use it)``: the sliding attention window in tokens (a query attends to the ``window``
    latest keys of its document, itself included, as Transformers' masks do) and the indices of the layers that
    slide; ``(None, ())`` when none does."""
    types = _layer_types(cfg, family, layers, where)
    sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    if not sliding:
        return None, ()
    window = cfg.get("sliding_window")
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ConfigError(
            f"{where}: layers {list(sliding)[:4]} use sliding-window attention but sliding_window is {window!r}; "
            "it must be an integer >= 1"
        )
    return window, sliding


def _rope(cfg: dict, where: str) -> float:
    """The RoPE base of the full-attention layers, after checking every RoPE variant in the config is one whose
    frequencies do not depend on the batch (:data:`ROPE_TYPES`)."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ConfigError(f"{where}: rope_parameters must be an object, got {params!r}")
    per_kind = params if params and all(isinstance(v, dict) for v in params.values()) else {"full_attention": params}
    for kind, p in per_kind.items():
        rope_type = p.get("rope_type", p.get("type", "default"))
        if rope_type in ("dynamic", "longrope"):
            raise ConfigError(
                f"{where}: rope_type {rope_type!r}{'' if kind == 'full_attention' else f' ({kind})'}: its frequencies "
                "change with the longest position in each forward call, so the same document would be rotated "
                "differently depending on what it is packed with and how a plan shards it; flexorch runs "
                f"{', '.join(ROPE_TYPES)} (e.g. Llama 3.1's llama3 or YaRN, which reach long context with fixed "
                "frequencies)"
            )
        if rope_type not in ROPE_TYPES:
            raise ConfigError(
                f"{where}: rope_type {rope_type!r} is not supported; flexorch runs {', '.join(ROPE_TYPES)}"
            )
    main = per_kind.get("full_attention") or next(iter(per_kind.values()))
    return float(cfg.get("rope_theta", main.get("rope_theta", 10000.0)))


def _check_unsupported(cfg: dict, family: str, d: Path) -> None:
    where = f"[model] hf: {d}/config.json"
    lay = FAMILY_LAYOUTS[family]
    act = cfg.get(lay.activation_key, cfg.get("hidden_act", "silu"))
    if act not in ACTIVATIONS:
        raise ConfigError(
            f"{where}: {lay.activation_key} {act!r} is not supported; use one of {', '.join(ACTIVATIONS)}"
        )
    if float(cfg.get("attention_dropout", 0.0) or 0.0) != 0.0:
        raise ConfigError(f"{where}: attention_dropout {cfg['attention_dropout']}; flexorch's attention has no "
                          "dropout: set it to 0.0")  # fmt: skip
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if cfg.get(key) is not None:
            raise ConfigError(
                f"{where}: {key} = {cfg[key]}; flexorch's attention kernels and its fused LM-head loss compute no "
                f"soft-capping: set {key} to null (Gemma 3 trains without it)"
            )
    if cfg.get("use_bidirectional_attention"):
        raise ConfigError(f"{where}: use_bidirectional_attention is set; flexorch trains causal language models only")
    if lay.bias_key is None and (cfg.get("attention_bias") or cfg.get("mlp_bias")):
        raise ConfigError(f"{where}: attention_bias / mlp_bias: a {family} model has no such biases; set them to false")
    if lay.mlp_bias_key is None and cfg.get("mlp_bias"):
        raise ConfigError(f"{where}: mlp_bias: a {family} model's MLP has no biases; set it to false")


def _head_size(cfg: dict, d: Path, dim: int, heads: int) -> int:
    """The config's ``head_dim`` when it differs from hidden / heads (0 otherwise: ModelConfig derives it)."""
    head_dim = cfg.get("head_dim")
    if head_dim is None:
        if dim % heads:
            raise ConfigError(f"[model] hf: {d}/config.json: hidden_size {dim} is not divisible by {heads} heads")
        return 0
    head_dim = _int(cfg, "head_dim", d)
    if head_dim % 2:
        raise ConfigError(f"[model] hf: {d}/config.json: head_dim {head_dim} must be even for RoPE")
    return 0 if heads * head_dim == dim else head_dim


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
    module docstring): shape, ``hf`` (the absolute directory), ``family``, biases, windows, ``hf_weights``."""
    d = _where_is(path)
    cfg = _read_config(d)
    family = _check_family(cfg, d)
    where = f"[model] hf: {d}/config.json"
    dim = _int(cfg, "hidden_size", d)
    heads = _int(cfg, "num_attention_heads", d)
    layers = _int(cfg, "num_hidden_layers", d)
    _check_unsupported(cfg, family, d)
    lay = FAMILY_LAYOUTS[family]
    biased = bool(lay.bias_key and cfg.get(lay.bias_key))
    window, window_layers = _windows(cfg, family, layers, where)
    fields = {
        "vocab_size": _int(cfg, "vocab_size", d),
        "dim": dim,
        "num_layers": layers,
        "num_heads": heads,
        "num_kv_heads": _int(cfg, "num_key_value_heads", d, heads),
        "head_size": _head_size(cfg, d, dim, heads),
        "ffn_dim": _int(cfg, "intermediate_size", d),
        "rope_theta": _rope(cfg, where),
        "norm_eps": float(cfg.get("rms_norm_eps", 1e-6)),
        "init_std": float(cfg.get("initializer_range", 0.02)),
        "tie_embeddings": bool(cfg.get("tie_word_embeddings", family == "gemma3_text")),
        "hf": str(d),
        "family": family,
        "attention_window": window,
        "window_layers": window_layers,
        "qkv_bias": lay.qkv_bias or biased,
        "o_bias": biased,
        "mlp_bias": bool(lay.mlp_bias_key and cfg.get(lay.mlp_bias_key)),
        **(moe_fields(cfg, family, layers, where) if family in MOE_LAYOUTS else {}),
    }
    if fields["num_kv_heads"] > heads or heads % fields["num_kv_heads"]:
        raise ConfigError(
            f"{where}: num_key_value_heads {fields['num_kv_heads']} must divide num_attention_heads {heads}"
        )
    files = hf_weight_files(d)
    if files:
        shape = SimpleNamespace(**fields, head_dim=fields["head_size"] or dim // heads)
        _check_weights(d, files, hf_param_shapes(shape))
    fields["hf_weights"] = bool(files)
    return fields
