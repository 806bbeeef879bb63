"""Export a checkpoint of a Hugging Face model run as a directory ``AutoModelForCausalLM.from_pretrained`` loads.

The directory gets the trained weights as safetensors (Transformers' parameter names, which the run kept
throughout: ``flexorch.workers.hf_model``; one ``model.safetensors``, or files of at most ``max_shard_bytes`` listed
in ``model.safetensors.index.json`` as ``save_pretrained`` splits them), the source directory's ``config.json``
(with ``architectures`` filled in when the source had none) and the run's tokenizer files: those of the model
directory, or of the BPE tokenizer the run trained on its corpus (``[data] tokenizer``). A run that used the byte
tokenizer has no tokenizer files to give; the export says so.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from flexorch.config.adapters import LoraSpec
from flexorch.config.hf import FAMILY_LAYOUTS
from flexorch.control.checkpoint import CheckpointError
from flexorch.control.checkpoint_export import checkpoint_config, consolidated_state
from flexorch.workers.lora import is_adapter_param

__all__ = ["export_hf"]

ARCHITECTURES = {family: layout.architecture for family, layout in FAMILY_LAYOUTS.items()}
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model", "vocab.json",
    "merges.txt", "added_tokens.json", "chat_template.jinja",
)  # fmt: skip


MAX_SHARD_BYTES = 5 * 10**9
"""The largest safetensors file an export writes (Transformers' ``save_pretrained`` default, 5 GB)."""


def export_hf(checkpoint: Path | str, out: Path | str, max_shard_bytes: int = MAX_SHARD_BYTES) -> dict:
    """Write ``out`` (a new or empty directory) from ``checkpoint``; returns ``{"parameters", "tensors", "bytes",
    "files", "tokenizer", "adapters"}`` (``files``: the safetensors files written; ``parameters``, ``tensors``,
    ``bytes``: theirs, the base model's; ``tokenizer``: where its files came from, or None; ``adapters``: one dict
    per task's PEFT adapter written, :func:`~flexorch.control.peft_export.write_peft_adapters`, empty without
    adapters)."""
    import huggingface_hub  # noqa: F401 - missing, an error before anything is read
    import safetensors.torch  # noqa: F401

    cfg = checkpoint_config(checkpoint)
    model, data = cfg["model"], cfg["data"]
    specs = [LoraSpec.from_dict(a) for a in model.get("adapters") or ()]
    if model.get("hf") is None:
        tasks = f" and its LoRA adapters (tasks {', '.join(s.task for s in specs)})" if specs else ""
        raise CheckpointError(
            f"{checkpoint} is a checkpoint of flexorch's own decoder, not a Hugging Face model; export it{tasks} as "
            "one file with `flexorch export CHECKPOINT model.pt`, where adapters keep flexorch's names "
            "(layers.<i>.lora.<task>.<target>.A/B); only a [model] hf run's adapters are written as PEFT adapters"
        )
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"{out} exists and is not an empty directory; give a new directory to export into")
    source = Path(model["hf"])
    if not (source / "config.json").is_file():
        raise CheckpointError(f"the run's model directory {source} is gone (no config.json): it holds the config")
    if specs:
        from flexorch.control.peft_export import peft_module

        peft_module()  # missing PEFT is an error before anything is written
    everything = consolidated_state(checkpoint)
    state = {name: t.contiguous() for name, t in everything.items() if not is_adapter_param(name)}
    out.mkdir(parents=True, exist_ok=True)
    split = _write_weights(out, state, max_shard_bytes)
    conf = json.loads((source / "config.json").read_text())
    conf.setdefault("architectures", [ARCHITECTURES[model["family"]]])
    conf["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(conf, indent=2) + "\n")
    tokenizer = _copy_tokenizer(data.get("tokenizer", "byte"), out)
    adapters = []
    if specs:
        from flexorch.control.peft_export import write_peft_adapters

        adapters = write_peft_adapters(out, specs, {n: t for n, t in everything.items() if is_adapter_param(n)})
    return {
        "parameters": int(sum(t.numel() for t in state.values())),
        "tensors": len(state),
        "bytes": sum((out / f).stat().st_size for f in split.filename_to_tensors),
        "files": sorted(split.filename_to_tensors),
        "tokenizer": tokenizer,
        "adapters": adapters,
    }


def _write_weights(out: Path, state: dict, max_shard_bytes: int):
    """Write ``state`` as safetensors files of at most ``max_shard_bytes`` (with their index when there are several);
    returns the split (which tensor went to which file)."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    split = split_torch_state_dict_into_shards(state, max_shard_size=max_shard_bytes)
    for file, names in split.filename_to_tensors.items():
        save_file({n: state[n] for n in names}, str(out / file), metadata={"format": "pt"})
    if split.is_sharded:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())}}
        index["weight_map"] = split.tensor_to_filename
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return split


def _copy_tokenizer(spec: str, out: Path) -> str | None:
    """Copy an ``hf:<dir>`` tokenizer's files into ``out``; returns the directory they came from, or None."""
    if not spec.startswith("hf:"):
        return None
    tok_dir = Path(spec[3:])
    copied = [f for f in TOKENIZER_FILES if (tok_dir / f).is_file()]
    for f in copied:
        shutil.copy2(tok_dir / f, out / f)
    return str(tok_dir) if copied else None
