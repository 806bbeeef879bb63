"""Where checkpoints go and how many are kept: the ``[checkpoint]`` table of a run file.

::

    [checkpoint]
    storage = "s3://my-bucket/runs/long-ctx"   # default: RUN_DIR/checkpoints; a shared path; s3://...; gs://...
    every = 100                                # = the top-level checkpoint_every (0: only at the end)
    keep = 2                                   # = the top-level keep_checkpoints: the newest kept
    keep_every = 1000                          # also keep every checkpoint whose step is a multiple (0: none)
    async = true                               # the default: the steps go on while a checkpoint is written

``every`` and ``keep`` are the top-level ``checkpoint_every`` and ``keep_checkpoints`` of older run files, which keep
working; a run file may set either spelling, not both to different values (``flexorch.config.run``). Credentials and
endpoints of an object store come from the environment, as for corpora (``flexorch.data.store.remote``).
"""

from __future__ import annotations

from dataclasses import dataclass

from flexorch.config.errors import ConfigError

__all__ = ["CheckpointSettings"]

_SCHEMES = ("s3://", "gs://", "gcs://", "file://")


@dataclass(frozen=True, kw_only=True)
class CheckpointSettings:
    """Where a run's checkpoints are written and which are kept."""

    storage: str | None = None
    """A directory (local, or a shared filesystem every node mounts), or an object-store prefix ``s3://bucket/prefix``
    / ``gs://bucket/prefix``. None: ``RUN_DIR/checkpoints``. Every worker writes its own shard there and the driver
    writes its state and the manifest last, so a run resumes from it on any node with nothing local."""
    every: int | None = None
    """Checkpoint every this many steps (0: only at the end). None: the top-level ``checkpoint_every``."""
    keep: int | None = None
    """The newest checkpoints kept (older ones are deleted once a newer one verifies). None: the top-level
    ``keep_checkpoints``."""
    keep_every: int = 0
    """Also keep every checkpoint whose step is a multiple of this (0: none), beside the newest ``keep``."""
    async_: bool = True
    """``async`` in a run file: the steps go on while a checkpoint is written. The state is staged in host memory
    (a copy of a replicated state on the worker that writes it; a sharded run's shards on each worker's node), then
    written to the storage by a background thread; at most one save is in flight (the next waits for it), and a
    stop waits for it. A write that fails is reported and the previous checkpoint stays the newest. The default: it
    measured faster than synchronous saves (``benchmarks/measured/checkpoint.py``). False: every save blocks the
    step."""

    def __post_init__(self) -> None:
        s = self.storage
        if s is not None:
            if not isinstance(s, str) or not s.strip():
                raise ConfigError(f"checkpoint.storage must be a directory or an s3:// / gs:// URI, got {s!r}")
            if "://" in s and not s.lower().startswith(_SCHEMES):
                raise ConfigError(
                    f"checkpoint.storage = {s!r}: unsupported scheme (use a directory, s3://bucket/prefix or "
                    "gs://bucket/prefix)"
                )
        for name, low in (("every", 0), ("keep", 1)):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < low):
                what = "an integer >= 0" if low == 0 else "a positive integer"
                raise ConfigError(f"checkpoint.{name} must be {what}, got {v!r}")
        if not isinstance(self.async_, bool):
            raise ConfigError(f"checkpoint.async must be true or false, got {self.async_!r}")
        v = self.keep_every
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ConfigError(f"checkpoint.keep_every must be an integer >= 0 (0: keep only the newest), got {v!r}")
