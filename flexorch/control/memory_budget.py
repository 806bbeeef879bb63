"""``[plan] tokens_per_worker = "auto"`` on GPU workers: the activation budget read from the devices.

At start, after the first world formed and before calibration, the driver asks every worker for its device's
memory (``Worker.device_memory``: ``torch.cuda.mem_get_info`` taken when the worker started, before it allocated
anything, so a process sharing the GPU is counted) and for the activation bytes one token costs on its model
(``flexorch.workers.calibrate.activation_bytes_per_token``, the meter calibration uses). Then, on the worker with
the least free memory:

    model state   = what the executor holds per worker in the run's sharding mode at the elastic floor
                    (``flexorch.control.calibration.model_state_plan``: parameters, gradients, AdamW moments, FSDP's
                    gathered layers), the same figure the planner budgets with
    after state   = free at start - model state
    margin        = MARGIN_SHARE x after state + MARGIN_BYTES   (allocator fragmentation, kernel workspaces,
                    NCCL buffers, compiled kernels, the estimate's error)
                    + the loss head's chunk  (``loss_chunk_tokens`` x vocab x 10 bytes: one chunk's float32 logits,
                    their float32 gradient and the bf16 logits, alive together in the head's backward and not in
                    the per-token meter, which counts what is held for the backward; 5.3 GB at a 128K vocab)
    activations   = after state - margin
    tokens        = activations / activation bytes per token

The planner gets the activation bytes as they are (``planner_profile(activation_budget_bytes=...)``), the run's
config the token count (``plan.tokens_per_worker``, so ``max_context`` and the elastic floor are checked again with
it). With MARGIN_SHARE 0.1 and 2 GiB, an H200 with 138 GiB free and a 1.1B model's 16.4 GiB of state gives the
activations 107.6 GiB: 88 % of the free memory after the model state.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from flexorch.config.errors import ConfigError

__all__ = [
    "MARGIN_BYTES",
    "MARGIN_SHARE",
    "OOM_CUT",
    "DeviceBudget",
    "device_budget",
    "head_chunk_bytes",
    "lowered_after_oom",
    "resolve_device_budget",
]

MARGIN_SHARE = 0.10
"""Share of the memory left after the model state that is kept free."""
MARGIN_BYTES = 2 * 2**30
"""Bytes kept free on top of the share."""
GIB = 2**30
OOM_CUT = 0.8
"""A step that ran out of memory cuts the activation budget to this share of what it was, for the rest of the run."""


@dataclasses.dataclass(frozen=True)
class DeviceBudget:
    """The activation budget of one worker, and how it was reached."""

    free_bytes: int
    total_bytes: int
    state_bytes: float
    margin_bytes: float
    activation_bytes: float
    act_bytes_per_token: float
    tokens: int
    head_bytes: float = 0.0
    """The loss head's chunk, the part of ``margin_bytes`` that grows with the vocabulary."""

    @property
    def share_of_free(self) -> float:
        """Activation bytes over the free memory after the model state."""
        after = self.free_bytes - self.state_bytes
        return self.activation_bytes / after if after > 0 else 0.0

    def describe(self) -> str:
        return (
            f"memory budget from the device: {self.free_bytes / GIB:.1f} GiB free of {self.total_bytes / GIB:.1f}, "
            f"model state {self.state_bytes / GIB:.1f} GiB, margin {self.margin_bytes / GIB:.1f} GiB"
            + (f" (the loss head's chunk {self.head_bytes / GIB:.1f} of it)" if self.head_bytes else "")
            + " -> "
            f"{self.activation_bytes / GIB:.1f} GiB for activations ({100 * self.share_of_free:.0f} % of the free "
            f"memory after the model state) = {self.tokens:,} tokens per worker at "
            f"{self.act_bytes_per_token / 2**20:.2f} MiB per token"
        )


def head_chunk_bytes(loss_chunk_tokens: int, vocab_size: int) -> float:
    """Bytes of one loss-head chunk in its backward (see the module doc); 0 without chunks, where the meter
    counts the whole logits per token."""
    return 10.0 * loss_chunk_tokens * vocab_size


def device_budget(
    free_bytes: int, total_bytes: int, state_bytes: float, act_bytes_per_token: float, head_bytes: float = 0.0
) -> DeviceBudget:
    """The budget of a device with ``free_bytes`` free (see the module doc); ConfigError when no activation fits."""
    after = free_bytes - state_bytes
    margin = MARGIN_SHARE * max(after, 0.0) + MARGIN_BYTES + head_bytes
    activations = after - margin
    tokens = int(activations // act_bytes_per_token) if activations > 0 else 0
    if tokens < 16:
        raise ConfigError(
            f"plan.tokens_per_worker = 'auto': the device has {free_bytes / GIB:.1f} GiB free and the model state "
            f"takes {state_bytes / GIB:.1f} GiB per worker, which leaves {max(activations, 0) / GIB:.2f} GiB for "
            f"activations after a {margin / GIB:.1f} GiB margin: not 16 tokens at {act_bytes_per_token / 2**20:.2f} "
            "MiB each. Shard the model state over more workers ([sharding] mode = 'fsdp'), recompute activations "
            "([sharding] activation_checkpointing = 'full'), or use a smaller model"
        )
    return DeviceBudget(
        free_bytes, total_bytes, state_bytes, margin, activations, act_bytes_per_token, tokens, head_bytes
    )


def resolve_device_budget(cfg, group, publish):
    """``(cfg with plan.tokens_per_worker measured, DeviceBudget)`` for a run whose budget comes from its devices
    (``cfg.budget_from_device``); ``(cfg, None)`` otherwise. Raises ConfigError, saying what to do, when the
    measured budget cannot hold ``max_context`` on the run's workers or no activation fits."""
    if not cfg.budget_from_device:
        return cfg, None
    from flexorch.control.calibration import model_state_plan

    memory = [m for m in group.call("device_memory") if m is not None]
    if not memory:
        raise ConfigError("plan.tokens_per_worker = 'auto' with use_gpu, but no worker has a CUDA device")
    least = min(memory, key=lambda m: m["free_at_start"])
    act = float(np.median(group.call("activation_bytes_per_token")))
    state = model_state_plan(cfg, cfg.min_workers).total
    head = head_chunk_bytes(cfg.model.loss_chunk_tokens, cfg.model.vocab_size)
    budget = device_budget(least["free_at_start"], least["total"], state, act, head)
    publish({"event": "progress", "message": budget.describe()})
    plan = dataclasses.replace(cfg.plan, tokens_per_worker=budget.tokens)
    try:
        return cfg.replace(plan=plan), budget
    except ConfigError as e:
        raise ConfigError(
            f"{e} (plan.tokens_per_worker = 'auto' measured {budget.tokens:,}: {budget.describe()})"
        ) from None


def lowered_after_oom(profile, workers, step: int, errors=()):
    """``(profile, record, message)`` after workers ran out of device memory in ``step``: the activation part of
    the planner's memory budget cut to :data:`OOM_CUT` of what it was (the model state's part stays), so the
    re-planned step puts fewer tokens on each worker. ``record`` goes into the step's recovery, with ``errors``
    ((worker id, the first line of its error), as ``Failure.oom_messages``); the message quotes the first."""
    before = profile.memory_budget_bytes - profile.model_state_bytes
    after = OOM_CUT * before
    lowered = profile.with_overrides(memory_budget_bytes=profile.model_state_bytes + after)
    record = {
        "workers": sorted(workers),
        "activation_bytes_before": before,
        "activation_bytes_after": after,
        "tokens_per_worker_before": profile.tokens_per_device,
        "tokens_per_worker_after": lowered.tokens_per_device,
        "errors": [list(e) for e in errors],
    }
    message = (
        f"step {step}: workers {sorted(workers)} ran out of device memory; the activation budget per worker goes "
        f"from {before / GIB:.2f} to {after / GIB:.2f} GiB ({profile.tokens_per_device:,} -> "
        f"{lowered.tokens_per_device:,} tokens) for the rest of the run, and the step is planned again"
        + (f" ({errors[0][1]})" if errors else "")
    )
    return lowered, record, message
