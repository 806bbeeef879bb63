"""Regional ``torch.compile``: each decoder layer's compute compiled on its own, as TorchTitan compiles each block.

One compiled region per layer body, not the whole model: the 22 layers of a 1.1B Llama share one compiled graph
(same code, parameters are graph inputs), compile time is that of one layer (seconds), and what surrounds the
layers stays eager: FSDP2's gather/reshard hooks, activation checkpointing, the chunked loss. Inside a layer the
graph breaks once, at the attention call (:func:`flexorch.workers.model.call_attention`): varlen attention reads
host offsets and sequence parallelism runs collectives, so it stays a plain call, and Inductor fuses what is
around it (RMSNorm, RoPE, SwiGLU, residual adds, casts): the copies, casts and elementwise kernels between the
matmuls and the attention shrink most (``benchmarks/gpu/gpu_profile.py``; its H200 numbers, with and without
recompute, are in ``benchmarks/results/gpu/gpu_profile_h200.md``).

What is compiled is the function activation checkpointing wraps, so a recompute re-runs compiled code:

* flexorch's decoder (:class:`~flexorch.workers.model.Block`): ``_forward`` (the block) and ``_mlp`` (the part
  ``selective`` recompute checkpoints);
* a Transformers decoder layer: its class's ``forward``, looked up at each call (:func:`_class_forward`), and its
  MLP's own forward (``mlp.flexorch_plain_forward``, what ``selective`` recompute checkpoints inside the layer, a
  second graph break there: ``flexorch.workers.hf_model``).

Transformers 5.24 checkpoints a ``GradientCheckpointingLayer`` by wrapping its class's ``forward``, and wraps every
subclass's again, FSDP2's ``FSDP<Layer>`` among them; only the outermost wrapper, the one ``type(layer).forward``
is, checkpoints (``is_outermost``). ``fully_shard`` makes that subclass after the layers are compiled (TorchTitan's
order), so a ``forward`` bound at compile time is the inner wrapper, and a sharded compiled layer was never
recomputed: 'full' kept what 'none' keeps and took as long (``recompute 'auto'`` measured 1.00x for every mode on an
H200). The class's ``forward`` is therefore read when the layer runs, not when it is compiled.

Only methods of each layer instance are replaced (``layer.forward``, ``layer._forward``...), so parameter
names, ``state_dict`` keys, FSDP2 units and checkpoints are those of the eager model.
"""

from __future__ import annotations

import types

import torch
from torch import nn

__all__ = ["compile_layers", "compile_seconds", "compiled_layers", "wants_compile"]

_ATTR = "_flexorch_compiled"


def wants_compile(setting: bool | None, device: torch.device | None) -> bool:
    """``[model] compile``: True/False as set; unset (None) compiles on a GPU and not on a CPU (Inductor's CPU code
    gains little on the small models a CPU trains and costs seconds of C++ compilation per shape)."""
    if setting is None:
        return device is not None and device.type == "cuda"
    return bool(setting)


def _targets(layer: nn.Module) -> tuple[str, ...]:
    if hasattr(layer, "_forward") and hasattr(layer, "_mlp"):  # flexorch's Block
        return ("_forward", "_mlp")
    return ("forward",)


def compile_layers(model: nn.Module) -> int:
    """Compile each of ``model.layers`` in place (idempotent); returns how many layers were compiled now. The
    compilation itself happens at each layer's first call (and once more when the token count first changes, after
    which the graph is shape-generic)."""
    n = 0
    for layer in _layers(model):
        if getattr(layer, _ATTR, False) or not any(True for _ in layer.parameters()):
            continue  # compiled already, or a layer another pipeline stage holds (no parameters here)
        for name in _targets(layer):
            if name == "forward":  # a Transformers layer: its class's forward, whatever class it has when it runs
                layer.forward = types.MethodType(torch.compile(_class_forward), layer)
            else:
                setattr(layer, name, torch.compile(getattr(layer, name)))
        mlp = getattr(layer, "mlp", None)
        if hasattr(mlp, "flexorch_plain_forward"):  # an HF layer's MLP, wrapped for selective recompute
            mlp.flexorch_plain_forward = torch.compile(mlp.flexorch_plain_forward)
        setattr(layer, _ATTR, True)
        n += 1
    return n


def _class_forward(layer: nn.Module, *args, **kwargs):
    """``type(layer).forward(layer, ...)``: the forward of the class ``layer`` has now (FSDP2's subclass once it is
    sharded), so Transformers' outermost checkpointing wrapper runs, and checkpoints, inside the compiled region."""
    return type(layer).forward(layer, *args, **kwargs)


def compiled_layers(model: nn.Module) -> int:
    """How many of ``model.layers`` are compiled."""
    return sum(bool(getattr(layer, _ATTR, False)) for layer in _layers(model))


def _layers(model: nn.Module) -> list[nn.Module]:
    """``model.layers``: a ModuleList (a decoder) or a ModuleDict keyed by layer index (a pipeline stage)."""
    layers = getattr(model, "layers", None)
    if layers is None:
        return []
    return list(layers.values()) if isinstance(layers, nn.ModuleDict) else list(layers)


def compile_seconds() -> float:
    """Wall seconds this process has spent in ``torch.compile`` so far (TorchDynamo's own account,
    ``torch._dynamo.utils.calculate_time_spent``: tracing and Inductor's code generation); 0.0 where this torch does
    not keep it (a private API, looked up rather than assumed)."""
    try:
        from torch._dynamo.utils import calculate_time_spent

        return float(calculate_time_spent().get("total_wall_time", 0.0))
    except Exception:  # noqa: BLE001 - an account torch may drop or rename: then nothing is shown
        return 0.0
