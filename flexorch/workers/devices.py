"""The device a worker process computes on: chosen once, pinned, and refused loudly when a GPU is asked for but absent.

With ``use_gpu`` the driver starts each worker actor with ``num_gpus=1``; Ray then sets ``CUDA_VISIBLE_DEVICES`` in
the actor's process to the GPU(s) it was given (Ray docs, "Accelerator Support"), so the process sees them as
``cuda:0``, ``cuda:1``, ... :func:`pin_device` picks one of those (by default the first) and makes it the process's
current CUDA device with ``torch.cuda.set_device``. NCCL needs every rank on a GPU of its own
(``torch.distributed.init_process_group`` docs: "each process must have exclusive access to every GPU it uses");
without pinning, kernels and NCCL calls run on whichever device happens to be current, and
``flexorch.workers.process_groups`` binds the world to the same device (``device_id``).

Without ``use_gpu`` the worker computes on CPU and the result is ``None`` (what ``flexorch.workers.actor`` calls
"no device": tensors stay where torch puts them by default). Torch only, no Ray: the caller says whether a GPU is
wanted. The ``cuda`` argument is the seam tests use to drive the GPU branch on a machine without one.
"""

from __future__ import annotations

import os
from typing import Any

import torch

__all__ = ["DeviceUnavailableError", "device_memory", "pin_device"]


class DeviceUnavailableError(RuntimeError):
    """A GPU was asked for (``use_gpu``) but this worker process cannot use one; the message says why and what to
    do."""


def pin_device(use_gpu: bool, local_index: int = 0, *, cuda: Any = None) -> torch.device | None:
    """The device this worker computes on, made current: ``cuda:<local_index>`` of the visible GPUs with
    ``use_gpu`` (after ``torch.cuda.set_device`` on it), ``None`` (CPU) without.

    ``local_index`` counts among the GPUs this process sees (``CUDA_VISIBLE_DEVICES``, which Ray narrows to the
    actor's own GPUs), not the node's. ``cuda`` stands in for ``torch.cuda`` (``is_available``, ``device_count``,
    ``set_device``). Raises :class:`DeviceUnavailableError` when ``use_gpu`` is set but CUDA is unusable or the index
    is not visible: a GPU run silently training on CPU would be far slower and would plan with the wrong costs.
    """
    if not use_gpu:
        return None
    cuda = torch.cuda if cuda is None else cuda
    if local_index < 0:
        raise ValueError(f"local_index must be >= 0, got {local_index}")
    if not cuda.is_available():
        raise DeviceUnavailableError(
            f"use_gpu is set but torch.cuda.is_available() is False in this worker ({_diagnosis()}). {_advice()}"
        )
    count = cuda.device_count()
    if local_index >= count:
        raise DeviceUnavailableError(
            f"use_gpu is set but this worker sees {count} CUDA device(s), so cuda:{local_index} does not exist "
            f"({_diagnosis()}). Ray exposes only the GPUs an actor was given (num_gpus); start the worker with at "
            f"least {local_index + 1} GPU(s), or pick a local index below {count}."
        )
    device = torch.device("cuda", local_index)
    cuda.set_device(device)
    return device


def device_memory(device: torch.device | None) -> dict | None:
    """``{"free_at_start": bytes, "total": bytes}`` of a CUDA ``device`` now (``torch.cuda.mem_get_info``: memory
    other processes hold counts as used); None for a CPU worker. Workers take it before they allocate anything."""
    if device is None or device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return {"free_at_start": int(free), "total": int(total)}


def _diagnosis() -> str:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "no CUDA (a CPU-only build)"
    return f"torch {torch.__version__} built with {build}, CUDA_VISIBLE_DEVICES={visible!r}"


def _advice() -> str:
    if not torch.version.cuda:
        return "Install a CUDA build of torch on the worker nodes, or run without use_gpu."
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) == "":
        return (
            "No GPU is visible to this process: Ray gives an actor GPUs only when it is started with num_gpus >= 1; "
            "check that the cluster has free GPUs, or run without use_gpu."
        )
    return (
        "Check the NVIDIA driver on this node (nvidia-smi) and that its CUDA version supports this torch build, "
        "or run without use_gpu."
    )
