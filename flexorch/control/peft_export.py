"""Write a run's per-task LoRA adapters as PEFT adapter directories beside an exported Hugging Face model.

A run with adapters (``[[tasks]]``, ``flexorch.config.adapters``) keeps each one in its decoder layers as
``model.layers.<i>.lora.<task>.<target>.A`` ``(rank, in)`` and ``.B`` ``(out, rank)`` with the update
``alpha / rank * B A x`` (``flexorch.workers.lora``): exactly PEFT's LoRA with ``lora_dropout = 0``, whose
``lora_A`` / ``lora_B`` are ``nn.Linear(in, rank)`` / ``nn.Linear(rank, out)`` with those weights and whose
``scaling`` is ``lora_alpha / r``. :func:`write_peft_adapters` writes each task's adapter with PEFT's own API
(``LoraConfig``, ``get_peft_model``, ``save_pretrained``), so the files are in the format of the installed PEFT:
``OUT/adapters/<task>/adapter_config.json`` and ``adapter_model.safetensors``, loaded with
``PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(OUT), OUT/adapters/<task>)``.

The PEFT model is built on the meta device from the exported ``config.json`` (its architecture, no weights: the
base is never loaded a second time, whatever its size), and only its LoRA weights are replaced by the run's
tensors before ``save_pretrained`` (which saves the adapter's tensors alone).
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import torch
from torch import nn

from flexorch.config.adapters import LoraSpec
from flexorch.control.checkpoint import CheckpointError

__all__ = ["ADAPTERS_DIR", "peft_module", "write_peft_adapters"]

ADAPTERS_DIR = "adapters"
"""The subdirectory of an export that holds one PEFT adapter directory per task."""

_LAYER = re.compile(r"^(.*layers\.\d+)\.")


def peft_module():
    """``import peft``, or an ImportError that says how to install it."""
    try:
        import peft
    except ImportError:
        raise ImportError(
            "exporting a run's LoRA adapters writes them with PEFT: pip install 'flexorch[hf]' (or pip install peft)"
        ) from None
    return peft


def _task_tensors(state: dict, task: str) -> dict[tuple[str, str], dict[str, torch.Tensor]]:
    """``{(layer prefix, target): {"A": tensor, "B": tensor}}`` of ``task`` in a state dict
    (``model.layers.3.lora.chat.q_proj.A`` -> ``("model.layers.3", "q_proj")``)."""
    out: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    for name, t in state.items():
        layer, sep, rest = name.partition(".lora.")
        parts = rest.split(".")
        if sep and len(parts) == 3 and parts[0] == task:
            out.setdefault((layer, parts[1]), {})[parts[2]] = t
    return out


def write_peft_adapters(out: Path | str, specs, state: dict) -> list[dict]:
    """For each :class:`LoraSpec` of ``specs``, write ``out/adapters/<task>/`` from the adapter tensors of
    ``state`` (the run's state dict, or just its ``.lora.`` entries), for the model of ``out/config.json`` (an
    export already written there). Returns one ``{"task", "path", "rank", "alpha", "targets", "tensors"}`` per
    adapter, in ``specs``' order. Raises CheckpointError when ``state`` lacks a tensor of an adapter or has one of
    the wrong shape, or PEFT wraps a module the run had no adapter on."""
    peft = peft_module()
    from transformers import AutoConfig, AutoModelForCausalLM

    out = Path(out)
    conf = AutoConfig.from_pretrained(out, local_files_only=True)
    written = []
    for spec in specs:
        if not isinstance(spec, LoraSpec):
            raise ValueError(f"adapters must be LoraSpec values, got {spec!r}")
        tensors = _task_tensors(state, spec.task)
        if not tensors:
            raise CheckpointError(f"the checkpoint has no tensors of task {spec.task!r}'s adapter (.lora.{spec.task}.)")
        with torch.device("meta"):
            lm = AutoModelForCausalLM.from_config(conf)
        lora_config = peft.LoraConfig(
            r=spec.rank,
            lora_alpha=spec.alpha,
            target_modules=list(spec.targets),
            lora_dropout=0.0,
            task_type="CAUSAL_LM",
        )
        with warnings.catch_warnings():  # PEFT calls Transformers' deprecated `is_gradient_checkpointing`
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            model = peft.get_peft_model(lm, lora_config)  # adapter "default": save_pretrained writes it at the root
        _fill(model.get_base_model(), spec, tensors)
        where = out / ADAPTERS_DIR / spec.task
        model.peft_config["default"].base_model_name_or_path = str(out.resolve())
        model.save_pretrained(where)
        written.append(
            {
                "task": spec.task,
                "path": str(where),
                "rank": spec.rank,
                "alpha": spec.alpha,
                "targets": list(spec.targets),
                "tensors": 2 * len(tensors),
            }
        )
    return written


def _fill(base: nn.Module, spec: LoraSpec, tensors: dict) -> None:
    """Replace the meta ``lora_A`` / ``lora_B`` weights of every module PEFT wrapped in ``base`` by the run's A / B
    (same layout: ``lora_A.weight (rank, in)``, ``lora_B.weight (out, rank)``), checking that the wrapped modules
    are exactly those the run had the adapter on."""
    from peft.tuners.lora import LoraLayer

    wrapped = {}
    for name, module in base.named_modules():
        if isinstance(module, LoraLayer):  # model.layers.3.self_attn.q_proj -> (model.layers.3, q_proj)
            m = _LAYER.match(name)
            wrapped[(m.group(1) if m else name, name.rsplit(".", 1)[-1])] = module
    if set(wrapped) != set(tensors):
        only_peft = sorted(set(wrapped) - set(tensors))
        only_run = sorted(set(tensors) - set(wrapped))
        raise CheckpointError(
            f"task {spec.task!r}: PEFT's target_modules {list(spec.targets)} wrap {len(wrapped)} modules of the "
            f"exported model, the checkpoint has the adapter on {len(tensors)}; (layer, target) only in PEFT: "
            f"{only_peft[:3]}, only in the checkpoint: {only_run[:3]}"
        )
    for key, module in wrapped.items():
        got = tensors[key]
        for which, lin in (("A", module.lora_A["default"]), ("B", module.lora_B["default"])):
            if which not in got:
                raise CheckpointError(f"the checkpoint lacks {key[0]}.lora.{spec.task}.{key[1]}.{which}")
            t = got[which]
            if tuple(t.shape) != tuple(lin.weight.shape):
                raise CheckpointError(
                    f"{key[0]}.lora.{spec.task}.{key[1]}.{which} has shape {tuple(t.shape)}; PEFT's lora_{which} "
                    f"of rank {spec.rank} on that module has {tuple(lin.weight.shape)}"
                )
            lin.weight = nn.Parameter(t.detach().to(torch.float32).contiguous(), requires_grad=False)
