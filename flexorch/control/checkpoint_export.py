"""A checkpoint's whole model, in one process: the sharded (DCP) files gathered or a replicated ``model.pt`` read,
for ``flexorch export`` (``flexorch.control.hf_export`` writes the Hugging Face form). It reads a local checkpoint
directory; ``flexorch export`` downloads one from an object store first. No world is formed: DCP's
``dcp_to_torch_save`` reads every shard in this process.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from flexorch.control.checkpoint import CheckpointError, is_sharded, verify_files

__all__ = ["checkpoint_config", "consolidated_state", "export_model"]


def consolidated_state(directory: Path | str) -> dict:
    """The whole model's state dict (parameter name -> CPU tensor) of a local checkpoint directory, gathered from a
    sharded checkpoint's per-worker files or read from a replicated one's ``model.pt``; every file is checked
    against the manifest first. Runs in one process, without a world."""
    d = Path(directory)
    verify_files(d)
    if is_sharded(d):
        import tempfile

        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        with tempfile.TemporaryDirectory() as tmp:
            dcp_to_torch_save(d, Path(tmp) / "all.pt")
            return torch.load(Path(tmp) / "all.pt", weights_only=True, map_location="cpu")["model"]
    if (d / "model.pt").is_file():
        return torch.load(d / "model.pt", weights_only=True, map_location="cpu")
    raise CheckpointError(f"{d} is not a flexorch checkpoint (no model.pt and no .metadata)")


def checkpoint_config(directory: Path | str) -> dict:
    """The run configuration a checkpoint (a local directory) was written with (``TrainConfig.to_dict()``)."""
    f = Path(directory) / "driver_state.json"
    if not f.is_file():
        raise CheckpointError(f"{directory} is not a complete flexorch checkpoint: missing driver_state.json")
    return json.loads(f.read_text())["config"]


def export_model(directory: Path | str, out: Path | str) -> dict:
    """Consolidate a checkpoint's model into one ``torch.save`` file of the whole state dict (parameter name ->
    tensor); returns ``{"parameters", "tensors", "bytes"}``."""
    model = consolidated_state(directory)
    torch.save(model, out)
    return {
        "parameters": int(sum(t.numel() for t in model.values())),
        "tensors": len(model),
        "bytes": Path(out).stat().st_size,
    }
