"""Per-task LoRA adapters on the shared decoder layers: what each adapter is, checked without torch.

A task of a multi-task run (``[[tasks]]``, Spindle, arXiv 2409.03365) can own a LoRA adapter (Hu et al., arXiv
2106.09685, eq. 3): each chosen linear map ``h = W0 x`` of every decoder layer becomes ``h = W0 x + (alpha / r) B A x``
with ``A (r, in)`` and ``B (out, r)``; ``scale = alpha / r`` is PEFT's default (``LoraConfig(use_rslora=False)``).
The data plane builds them (``flexorch.workers.lora``). Adapters are part of the model's shape: their parameters are
in :meth:`~flexorch.config.model.ModelConfig.param_shapes`, named ``<layer>.lora.<task>.<target>.A`` / ``.B`` and
listed right after their layer's own parameters (the order ``named_parameters`` gives, the ``lora`` module being
registered last in each layer).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any, Protocol

__all__ = [
    "OWN_TARGETS",
    "LoraSpec",
    "adapter_shapes",
    "check_adapters",
    "check_targets",
    "target_modules",
    "with_adapter_shapes",
]

OWN_TARGETS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")
"""The linear maps of a decoder layer of flexorch's own decoder (``flexorch.workers.model.Block``)."""


class ModelShape(Protocol):
    """What the adapters read of a model's configuration (:class:`~flexorch.config.model.ModelConfig`, which builds
    its adapters with this module, so this module cannot import it)."""

    hf: str | None
    family: str
    vocab_size: int
    dim: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_dim: int
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    tie_embeddings: bool


_LAYER = re.compile(r"^(.*layers\.\d+)\.")


@dataclass(frozen=True)
class LoraSpec:
    """One task's adapter; validated on construction (the error names the field, its value and what is allowed)."""

    task: str
    """The task's name (``[[tasks]] name``): a Python identifier, so it can key a module."""
    rank: int
    """r, the inner dimension of ``B A``; >= 1."""
    alpha: float
    """LoRA's alpha; the update is scaled by ``alpha / rank`` (PEFT's default, not rsLoRA); > 0."""
    targets: tuple[str, ...]
    """Leaf names of the ``nn.Linear`` modules inside every decoder layer that get the adapter (e.g. ``("wq", "wv")``
    or ``("q_proj", "v_proj")``); non-empty, no name twice."""
    init_b_std: float = 0.0
    """B's initial values ~ N(0, init_b_std); 0 (the default): zeros, as PEFT starts, so the adapted model starts as
    the base. Tests set it > 0: with B = 0 the first step's gradient of A is exactly 0."""

    def __post_init__(self) -> None:
        where = f"LoraSpec(task={self.task!r})"
        if not isinstance(self.task, str) or not self.task.isidentifier():
            raise ValueError(
                f"LoraSpec.task must be a name like 'chat' or 'code_review' (a Python identifier), got {self.task!r}"
            )
        r = self.rank
        if isinstance(r, bool) or not isinstance(r, int) or r < 1:
            raise ValueError(f"{where}: rank must be an integer >= 1, got {r!r}")
        a = self.alpha
        if isinstance(a, bool) or not isinstance(a, int | float) or not 0 < a < math.inf:
            raise ValueError(f"{where}: alpha must be a finite number > 0, got {a!r}")
        object.__setattr__(self, "alpha", float(a))
        t = self.targets
        if isinstance(t, str) or not isinstance(t, tuple | list) or not t or not all(isinstance(x, str) for x in t):
            raise ValueError(
                f"{where}: targets must be a non-empty list of module names (e.g. ['wq', 'wv']), got {t!r}"
            )
        twice = sorted({x for x in t if list(t).count(x) > 1})
        if twice:
            raise ValueError(f"{where}: targets {list(t)} name {twice} more than once; list each module once")
        object.__setattr__(self, "targets", tuple(t))
        s = self.init_b_std
        if isinstance(s, bool) or not isinstance(s, int | float) or not 0 <= s < math.inf:
            raise ValueError(f"{where}: init_b_std must be a finite number >= 0 (0: B starts at zero), got {s!r}")
        object.__setattr__(self, "init_b_std", float(s))

    @property
    def scale(self) -> float:
        """``alpha / rank``, the factor of ``B A x`` (Hu et al. §4.1; PEFT's ``scaling``)."""
        return self.alpha / self.rank

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of every field (JSON/TOML friendly)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> LoraSpec:
        """Inverse of :meth:`to_dict` (lists for tuples, as JSON gives them back); unknown keys raise ValueError."""
        if not isinstance(values, Mapping):
            raise ValueError(f"a LoRA adapter must be a table of {[f.name for f in fields(cls)]}, got {values!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown LoraSpec keys {unknown}; valid keys: {sorted(known)}")
        missing = sorted(f.name for f in fields(cls) if f.name not in values and f.name != "init_b_std")
        if missing:
            raise ValueError(f"LoraSpec {dict(values)!r} lacks {missing}")
        return cls(**values)


def _layer_linears(shapes) -> dict[str, dict[str, tuple[int, int]]]:
    """Layer prefix (``layers.3`` / ``model.layers.3``) -> {leaf name: (out, in)} of its 2-D ``.weight`` entries."""
    out: dict[str, dict[str, tuple[int, int]]] = {}
    for name, shape in shapes:
        m = _LAYER.match(name)
        if m is None or ".lora." in name:
            continue
        layer = out.setdefault(m.group(1), {})
        parts = name.split(".")
        if parts[-3] == "mlp" and parts[-2] in ("gate", "router"):  # an MoE router (its own module, not nn.Linear)
            continue
        if parts[-1] == "weight" and len(shape) == 2:
            layer.setdefault(parts[-2], (int(shape[0]), int(shape[1])))
    return out


def target_modules(model_cfg: ModelShape) -> tuple[str, ...]:
    """The leaf names a :class:`LoraSpec` may target on this model, in the layer's order.

    Our decoder: :data:`OWN_TARGETS`. A Hugging Face model: the leaf names of the linear maps every decoder layer
    has, in layer 0's order, from :func:`flexorch.config.hf.hf_param_shapes` (the 2-D ``.weight`` parameters of a
    decoder layer of each family are exactly its ``nn.Linear`` modules: q/k/v/o_proj, gate/up/down_proj, an MoE
    router aside; an MoE layer's experts are 3-D parameters, not linear maps, so its MLP takes no adapter;
    ``tests/unit/test_lora.py`` checks this against the module Transformers builds). No torch: the run file is
    checked before any worker starts."""
    if model_cfg.hf is None:
        return OWN_TARGETS
    from flexorch.config.hf import hf_param_shapes

    layers = list(_layer_linears(hf_param_shapes(model_cfg)).values())
    return tuple(n for n in (layers[0] if layers else {}) if all(n in layer for layer in layers))


def check_adapters(model_cfg: ModelShape, specs) -> None:
    """Raise ValueError, saying what to change, on adapters this model cannot hold: two for one task, or a target
    that is not a linear map of its decoder layers."""
    names = [s.task for s in specs]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(
            f"LoRA adapters: task {twice[0]!r} has more than one adapter; give each task one "
            "(one [[tasks]] table per task name)"
        )
    have = target_modules(model_cfg)
    for s in specs:
        check_targets(s, have)


def check_targets(spec: LoraSpec, have) -> None:
    """Raise ValueError unless every target of ``spec`` is one of ``have``, the leaf names of a decoder layer's linear
    maps (in order: the error lists them). The config checks against the parameter list, the built model against its
    modules."""
    unknown = [t for t in spec.targets if t not in have]
    if unknown:
        raise ValueError(
            f"task {spec.task!r}: unknown LoRA target module {unknown[0]!r}; this model's decoder layers have "
            f"{', '.join(have)} (set [[tasks]] lora_targets to some of them)"
        )


def adapter_shapes(layer: str, linears: Mapping[str, tuple[int, int]], specs) -> list[tuple[str, tuple[int, int]]]:
    """``(name, shape)`` of the adapter parameters of one decoder layer (prefix ``layer``, its linear maps
    ``{leaf: (out, in)}``), in ``named_parameters`` order: task by task as ``specs`` lists them, target by target as
    each spec lists them, A ``(rank, in)`` then B ``(out, rank)``."""
    out = []
    for s in specs:
        for t in s.targets:
            rows, cols = linears[t]
            out += [(f"{layer}.lora.{s.task}.{t}.A", (s.rank, cols)), (f"{layer}.lora.{s.task}.{t}.B", (rows, s.rank))]
    return out


def with_adapter_shapes(shapes: list, specs) -> list[tuple[str, tuple[int, ...]]]:
    """The base model's ``(name, shape)`` list with each decoder layer's adapter parameters inserted right after
    that layer's last parameter (where the built model's ``named_parameters`` has them)."""
    if not specs:
        return list(shapes)
    linears = _layer_linears(shapes)
    last = {}
    for i, (name, _) in enumerate(shapes):
        m = _LAYER.match(name)
        if m is not None:
            last[m.group(1)] = i
    after = {i: layer for layer, i in last.items()}
    out = []
    for i, entry in enumerate(shapes):
        out.append(entry)
        if i in after:
            out += adapter_shapes(after[i], linears[after[i]], specs)
    return out
