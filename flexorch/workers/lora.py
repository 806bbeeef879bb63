"""Per-task LoRA adapters inside the decoder layers, one task active at a time.

LoRA (Hu et al., arXiv 2106.09685, eq. 3): a linear map ``h = W0 x`` of a decoder layer becomes
``h = W0 x + scale * B (A x)``, ``A (rank, in)``, ``B (out, rank)``, ``scale = alpha / rank`` (PEFT's ``LoraLayer``
with ``lora_dropout = 0``: ``result + lora_B(lora_A(x)) * scaling``). Several tasks share the base model, each with
its own adapter (:class:`~flexorch.config.adapters.LoraSpec`); the step runs one SP group's tokens, all of one task,
after :func:`set_active_task`.

Where the parameters live: each decoder layer gets a submodule ``lora`` (:class:`LayerAdapters`, keyed by task,
then by target leaf name, each a :class:`LoraWeights` with ``A`` and ``B``), so the names are
``layers.3.lora.chat.wq.A`` (ours) and ``model.layers.3.lora.chat.q_proj.A`` (Hugging Face), and FSDP2's per-layer
unit (``fully_shard(layer)``) shards them with the layer's own parameters and gathers them when the layer runs.
The base modules are untouched (their parameter names and state dict keys stay the checkpoint's): a forward hook on
each target ``nn.Linear`` adds the active task's update to its output, reading ``A`` and ``B`` from their module at
call time (the gathered parameters under FSDP2). With no active task, or one without an adapter on that module, the
hook returns nothing and the output is the base output exactly.

The active task is one mutable holder (:class:`ActiveTask`) that every hook of the model reads; it survives
``fully_shard`` (which keeps the module objects) and ``deepcopy`` (hooks are objects, copied with the model). An
activation-checkpointed layer reads it again when it recomputes in the backward, so the backward must run while the
task of its forward is active (the step runs each group's backward right after its forward).

Initial values (:func:`initial_adapter_value`): A as PEFT's default (``kaiming_uniform_(a=sqrt(5))``, i.e.
uniform(-1/sqrt(in), 1/sqrt(in))), B zeros (or N(0, ``init_b_std``)), each drawn from a generator of its own seeded
from (seed, task, layer, target, A|B), so they never touch the base model's generator stream and are the same
whatever the sharding or the order in which they are drawn.
"""

from __future__ import annotations

import hashlib
import math
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from flexorch.config.adapters import LoraSpec, check_targets

__all__ = [
    "ActiveTask",
    "LayerAdapters",
    "LoraWeights",
    "active_task",
    "adapter_tasks",
    "add_adapters",
    "apply_base_trainable",
    "initial_adapter_param",
    "initial_adapter_value",
    "is_adapter_param",
    "probing_task",
    "set_active_task",
    "with_adapter_values",
]


class ActiveTask:
    """The task whose adapters the model's hooks apply now (``name``; None: the base model alone)."""

    def __init__(self) -> None:
        self.name: str | None = None


class LoraWeights(nn.Module):
    """One adapter on one linear map ``in -> out``: ``A (rank, in)``, ``B (out, rank)``; ``forward(x)`` is the update
    ``scale * B A x``, in ``x``'s dtype."""

    def __init__(self, in_features: int, out_features: int, rank: int, scale: float) -> None:
        super().__init__()
        self.A = nn.Parameter(torch.empty(rank, in_features))
        self.B = nn.Parameter(torch.empty(out_features, rank))
        self.scale = scale
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """PEFT's default from the global RNG, as ``nn.Linear`` initialises itself (a no-op on the meta device; the
        model builders overwrite it with :func:`initial_adapter_value`)."""
        nn.init.kaiming_uniform_(self.A, a=math.sqrt(5))
        nn.init.zeros_(self.B)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.A.to(x.dtype), self.B.to(x.dtype)  # no-ops unless the input is in another dtype
        return F.linear(F.linear(x, a), b) * self.scale  # (..., in) -> (..., rank) -> (..., out)

    def extra_repr(self) -> str:
        return f"in={self.A.shape[1]}, out={self.B.shape[0]}, rank={self.A.shape[0]}, scale={self.scale:g}"


class LayerAdapters(nn.ModuleDict):
    """A decoder layer's adapters: task name -> ``nn.ModuleDict`` (target leaf name -> :class:`LoraWeights`), and
    the model's :class:`ActiveTask` (not a parameter, not in the state dict)."""

    def __init__(self, active: ActiveTask) -> None:
        super().__init__()
        self.active = active


class _AddUpdate:
    """Forward hook of one target ``nn.Linear``: ``output + update(input)`` of the active task's adapter on it, or
    None (output unchanged). An object, not a closure, so ``copy.deepcopy`` of the model points the copy's hooks at
    the copy's adapters."""

    def __init__(self, active: ActiveTask, by_task: dict[str, LoraWeights]) -> None:
        self.active = active
        self.by_task = by_task

    def __call__(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
        adapter = self.by_task.get(self.active.name) if self.active.name is not None else None
        if adapter is None:
            return None
        return output + adapter(args[0])


def _linears(layer: nn.Module) -> dict[str, nn.Linear]:
    """Leaf name -> the ``nn.Linear`` modules of a decoder layer (adapters excluded), in module order."""
    out: dict[str, nn.Linear] = {}
    for name, m in layer.named_modules():
        if isinstance(m, nn.Linear) and not name.startswith("lora."):
            leaf = name.rsplit(".", 1)[-1]
            if leaf in out:
                raise ValueError(f"two linear maps named {leaf!r} in one decoder layer: a LoRA target is ambiguous")
            out[leaf] = m
    return out


def add_adapters(model: nn.Module, specs) -> ActiveTask:
    """Give every decoder layer of ``model`` (``model.layers``) the adapters of ``specs`` (a ``lora`` submodule,
    registered after the layer's own modules, so its parameters follow them in ``named_parameters``) and a forward
    hook on each target linear map; returns the model's :class:`ActiveTask` (no task active). Parameters are
    allocated on the current default device (meta, in the builders, which then fill them from
    :func:`initial_adapter_value`; elsewhere initialised from the global RNG, as ``nn.Linear`` is)."""
    specs = tuple(specs)
    if not all(isinstance(s, LoraSpec) for s in specs):
        raise ValueError(f"adapters must be LoraSpec values, got {specs!r}")
    active = ActiveTask()
    for layer in model.layers:
        if hasattr(layer, "lora"):
            raise ValueError("this model's decoder layers have adapters already")
        linears = _linears(layer)
        lora = LayerAdapters(active)
        for s in specs:
            check_targets(s, linears)
            lora[s.task] = nn.ModuleDict(
                {t: LoraWeights(linears[t].in_features, linears[t].out_features, s.rank, s.scale) for t in s.targets}
            )
        layer.lora = lora
        for leaf, linear in linears.items():
            by_task = {s.task: lora[s.task][leaf] for s in specs if leaf in s.targets}
            if by_task:
                linear.register_forward_hook(_AddUpdate(active, by_task))
    return active


def _holders(model: nn.Module) -> list[ActiveTask]:
    seen: dict[int, ActiveTask] = {}
    for m in model.modules():
        if isinstance(m, LayerAdapters):
            seen.setdefault(id(m.active), m.active)
    return list(seen.values())


def set_active_task(model: nn.Module, name: str | None) -> None:
    """Apply task ``name``'s adapters in every following forward of ``model`` (and in the recompute of its
    activation-checkpointed layers); None, or a task without an adapter: the base model alone. A model without
    adapters accepts any name and computes the base model."""
    if name is not None and not isinstance(name, str):
        raise ValueError(f"the active task must be a task name or None, got {name!r}")
    for holder in _holders(model):
        holder.name = name


def active_task(model: nn.Module) -> str | None:
    """The task :func:`set_active_task` last set on ``model`` (None: none, or no adapters)."""
    holders = _holders(model)
    return holders[0].name if holders else None


def adapter_tasks(model: nn.Module) -> tuple[str, ...]:
    """Names of the tasks that have adapters in ``model``, in the order they were added."""
    for m in model.modules():
        if isinstance(m, LayerAdapters):
            return tuple(m.keys())
    return ()


def is_adapter_param(name: str) -> bool:
    """Whether parameter ``name`` is an adapter's (``...layers.<i>.lora.<task>.<target>.A|B``)."""
    return ".lora." in name


def apply_base_trainable(model: nn.Module, base_trainable: bool) -> None:
    """``base_trainable=False``: every parameter but the adapters' gets ``requires_grad=False`` (the optimizer skips
    them, ``flexorch.workers.optim.build_optimizer``); True: leave every parameter trainable."""
    if base_trainable:
        return
    for name, p in model.named_parameters():
        if not is_adapter_param(name):
            p.requires_grad_(False)


def _parse(name: str) -> tuple[int, str, str, str]:
    """``...layers.3.lora.chat.wq.A`` -> (3, 'chat', 'wq', 'A')."""
    layer_part, _, rest = name.partition(".lora.")
    parts = rest.split(".")
    if len(parts) != 3 or parts[2] not in ("A", "B") or not layer_part.rsplit(".", 1)[-1].isdigit():
        raise ValueError(f"{name!r} is not an adapter parameter name (<layer>.lora.<task>.<target>.A|B)")
    return int(layer_part.rsplit(".", 1)[-1]), parts[0], parts[1], parts[2]


def _generator(seed: int, *key) -> torch.Generator:
    """A CPU generator seeded from ``(seed, *key)`` through SHA-256 (stable across processes and Python runs, unlike
    ``hash``)."""
    digest = hashlib.sha256("/".join(map(str, (seed, *key))).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


def initial_adapter_value(name: str, shape, seed: int, b_std: float = 0.0) -> torch.Tensor:
    """The initial float32 CPU value of adapter parameter ``name`` (whole, ``shape``).

    A ``(rank, in)``: uniform(-1/sqrt(in), 1/sqrt(in)), PEFT's default ``nn.init.kaiming_uniform_(a=sqrt(5))``
    (gain sqrt(2 / (1 + 5)) times sqrt(3 / fan_in)). B ``(out, rank)``: zeros (PEFT, Hu et al. §4.1: the adapted
    model starts as the base), or N(0, ``b_std``) when ``b_std > 0``. Drawn from a generator seeded from
    (seed, task, layer, target, A|B): the same value in any process, for any sharding."""
    layer, task, target, which = _parse(name)
    shape = tuple(shape)
    gen = _generator(seed, "lora", task, layer, target, which)
    if which == "A":
        bound = 1.0 / math.sqrt(shape[1])
        return torch.empty(shape, dtype=torch.float32).uniform_(-bound, bound, generator=gen)
    if b_std == 0.0:
        return torch.zeros(shape, dtype=torch.float32)
    return torch.empty(shape, dtype=torch.float32).normal_(0.0, b_std, generator=gen)


def initial_adapter_param(name: str, shape, seed: int, specs) -> torch.Tensor:
    """:func:`initial_adapter_value` of ``name`` with B's std from its task's spec in ``specs``."""
    task = _parse(name)[1]
    return initial_adapter_value(name, shape, seed, next((s.init_b_std for s in specs if s.task == task), 0.0))


def with_adapter_values(base, shapes, seed: int, specs):
    """Yield ``(name, value)`` for every entry of ``shapes`` in order: adapter parameters from
    :func:`initial_adapter_param`, every other from ``base(base_shapes)`` (an
    iterator of ``(name, value)`` over the non-adapter entries, in order), so the base values and their generator
    stream are exactly those of the model without adapters."""
    shapes = list(shapes)
    values = iter(base([e for e in shapes if not is_adapter_param(e[0])]))
    for name, shape in shapes:
        if is_adapter_param(name):
            yield name, initial_adapter_param(name, shape, seed, specs)
        else:
            got, value = next(values)
            if got != name:
                raise RuntimeError(f"initial values out of order: expected {name}, got {got}")
            yield name, value


@contextmanager
def probing_task(model: nn.Module):
    """Within the block, the adapter with the most parameters is active (none when the model has no adapters): what a
    calibration probe or a memory measurement runs, so the time and bytes it measures include the costliest adapter
    (and, with a frozen base, the loss has a gradient to run the backward with). The task active before is restored."""
    tasks = adapter_tasks(model)
    if not tasks:
        yield None
        return
    sizes = dict.fromkeys(tasks, 0)
    for name, p in model.named_parameters():
        parts = name.split(".")
        if "lora" in parts:
            sizes[parts[parts.index("lora") + 1]] += p.numel()
    before = active_task(model)
    chosen = max(tasks, key=lambda t: sizes[t])
    set_active_task(model, chosen)
    try:
        yield chosen
    finally:
        set_active_task(model, before)
