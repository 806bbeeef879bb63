"""How model state is laid out and computed on the workers: the ``[sharding]`` table of a run file.

``mode`` picks where parameters, gradients and AdamW moments live (``flexorch.workers.fsdp`` builds them):

* ``replicate``: every worker holds the whole fp32 model, its gradient and both moments (16 bytes per parameter);
  gradients are summed with one all-reduce. The CPU default.
* ``fsdp``: ZeRO-3 over the whole world with PyTorch's FSDP2 (``fully_shard``), one unit per decoder layer plus the
  root; a worker holds 1/world of the model state plus the layers gathered in flight. The GPU default.
* ``hsdp``: sharded within groups of ``shard_size`` workers and replicated across them (a 2-D device mesh): a
  worker holds 1/shard_size, and a lost worker's shard still lives in another replica group.

``precision`` is ``fp32`` or ``bf16`` (bf16 compute with fp32 master weights, fp32 gradient reduction and fp32
AdamW moments: FSDP2's ``MixedPrecisionPolicy``); ``auto`` is bf16 on GPU and fp32 on CPU. ``activation_checkpointing``
recomputes each decoder layer (``full``) or its MLP (``selective``) in the backward instead of keeping their
activations. Nothing here imports torch: :class:`~flexorch.config.run.TrainConfig` checks the table against the
workers before any worker starts.
"""

from __future__ import annotations

from dataclasses import dataclass

from flexorch.config.errors import ConfigError

__all__ = ["GATHERS", "MODES", "PRECISIONS", "RECOMPUTE", "ShardingSettings", "effective_shard_size"]

MODES = ("auto", "replicate", "fsdp", "hsdp")
PRECISIONS = ("auto", "fp32", "bf16")
RECOMPUTE = ("none", "full", "selective", "auto")
GATHERS = ("layer", "step")


@dataclass(frozen=True, kw_only=True)
class ShardingSettings:
    """Model-state sharding, mixed precision and activation checkpointing."""

    mode: str = "auto"
    """'replicate', 'fsdp' or 'hsdp'; 'auto': 'fsdp' with ``use_gpu``, else 'replicate'."""
    shard_size: int | None = None
    """hsdp only: workers per shard group (it must divide ``workers``)."""
    precision: str = "auto"
    """'fp32', or 'bf16' (needs 'fsdp' or 'hsdp'); 'auto': 'bf16' with ``use_gpu`` and a sharded mode, else 'fp32'."""
    gather: str = "layer"
    """fsdp/hsdp: 'layer' gathers each layer before its use and reduce-scatters its gradient after every
    micro-batch (ZeRO-3: only one layer whole at a time); 'step' gathers each layer once per step and keeps it,
    accumulates whole gradients and reduce-scatters once at the end (FSDP2's ``set_reshard_after_forward`` /
    ``set_requires_gradient_sync``): the communication of whole replicas, with the whole model's parameters and
    gradients in memory during the step and only the shards between steps."""
    activation_checkpointing: str | None = None
    """'none', 'full' (recompute every decoder layer in the backward), 'selective' (recompute each layer's MLP
    and its norm, keep attention's outputs: attention's collectives are not run again), or 'auto': chosen per
    micro-batch and SP group, the fastest mode whose activations for the group's tokens fit the budget ('none',
    then 'selective', else 'full'); the planner packs each step for full's bytes and for each
    faster mode's and runs the fastest (``flexorch.solver.recompute``). With ``[pipeline] stages`` the planner
    chooses whole layers per stage and unit instead ('auto': the fewest recomputed layers that fit, InfiniPipe's
    checkpointing ILP, ``flexorch.solver.pipeline.checkpointing``; 'none': no layer; 'full': every layer; no
    'selective'). Unset: 'auto' on GPU workers and with pipeline stages (a document too long for a device without
    recompute then still runs), else 'none' (:meth:`recompute`)."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"sharding.mode must be one of {list(MODES)}, got {self.mode!r}")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"sharding.precision must be one of {list(PRECISIONS)}, got {self.precision!r}")
        if self.activation_checkpointing is not None and self.activation_checkpointing not in RECOMPUTE:
            raise ConfigError(
                f"sharding.activation_checkpointing must be one of {list(RECOMPUTE)}, got "
                f"{self.activation_checkpointing!r}"
            )
        if self.gather not in GATHERS:
            raise ConfigError(f"sharding.gather must be one of {list(GATHERS)}, got {self.gather!r}")
        s = self.shard_size
        if s is not None and (not isinstance(s, int) or isinstance(s, bool) or s < 1):
            raise ConfigError(f"sharding.shard_size must be a positive integer, got {s!r}")
        if self.mode == "hsdp" and s is None:
            raise ConfigError("sharding.mode = 'hsdp' needs sharding.shard_size (workers per shard group)")
        if self.mode in ("replicate", "fsdp") and s is not None:
            raise ConfigError(
                f"sharding.shard_size is for mode 'hsdp' only (mode {self.mode!r} "
                + ("shards over the whole world" if self.mode == "fsdp" else "does not shard")
                + "); remove it or set mode = 'hsdp'"
            )

    def recompute(self, use_gpu: bool, pipelined: bool) -> str:
        """The activation checkpointing in force: the setting, or unset, 'auto' on GPU workers and with pipeline
        stages (their checkpointing ILP measures nothing), 'none' on CPU workers with SP steps ('auto' measures each
        mode at start, which costs more there than it saves)."""
        if self.activation_checkpointing is not None:
            return self.activation_checkpointing
        return "auto" if use_gpu or pipelined else "none"

    def resolved(self, use_gpu: bool) -> tuple[str, str]:
        """(mode, precision) in force on a CPU or GPU run."""
        mode = self.mode if self.mode != "auto" else ("fsdp" if use_gpu else "replicate")
        if self.precision != "auto":
            return mode, self.precision
        return mode, "bf16" if use_gpu and mode != "replicate" else "fp32"


def effective_shard_size(mode: str, world_size: int, shard_size: int | None) -> int:
    """Workers one shard group spans in a world of ``world_size`` (the world may have shrunk or grown since the
    start): 1 for replicate, the world for fsdp; for hsdp ``shard_size`` when it divides the world, else the
    smallest divisor of the world above it, so a worker's share never grows (3 workers with shard_size 2: 3)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if mode == "replicate":
        return 1
    if mode == "fsdp":
        return world_size
    if mode != "hsdp" or shard_size is None:
        raise ValueError(f"unknown sharding mode {mode!r} (or hsdp without shard_size)")
    s = min(shard_size, world_size)
    while world_size % s:
        s += 1
    return s


def uneven_world_note(mode: str, world_size: int, shard_size: int | None) -> str | None:
    """What an hsdp run does with a world that is not a multiple of ``shard_size`` (after a loss or a partial
    grow), in words for the membership line; None when the world divides evenly (or the mode is not hsdp)."""
    if mode != "hsdp" or shard_size is None or world_size % shard_size == 0:
        return None
    s = effective_shard_size(mode, world_size, shard_size)
    head = f"hsdp: {world_size} workers do not split into shard groups of {shard_size}"
    until = f"until the world is a multiple of {shard_size} again"
    if s == world_size:
        return (
            f"{head}, so the model state is sharded over all {world_size} with no replica (as fsdp: losing a "
            f"worker now goes back to the last checkpoint) {until}"
        )
    return f"{head}, so {world_size // s} replicas of shard groups of {s} {until}"
