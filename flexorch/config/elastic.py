"""Elastic membership: the ``[elastic]`` table of a run file (how few and how many workers, how long to wait).

``min_workers`` and ``max_workers`` may be left out: :class:`~flexorch.config.run.TrainConfig` derives them from
the run (``TrainConfig.min_workers`` / ``max_workers`` are the bounds in force).
"""

from __future__ import annotations

from dataclasses import dataclass

from flexorch.config.errors import ConfigError

__all__ = ["ElasticSettings"]


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclass(frozen=True, kw_only=True)
class ElasticSettings:
    """Workers leaving and joining mid-run."""

    min_workers: int | None = None
    """Elastic floor: below this many live workers the run waits ``wait_s`` for capacity, then fails. None: the
    fewest workers whose largest power-of-two SP group holds ``data.max_context`` (with pipeline stages, the
    stages; and a forced static layout's degree)."""
    max_workers: int | None = None
    """Elastic ceiling: free slots in the cluster (a joined node) are used up to this many workers. None: the run's
    ``workers`` (replace lost workers when capacity comes back, never grow past the start)."""
    wait_s: float = 60.0
    """How long to wait for capacity when fewer than ``min_workers`` are alive, before failing the run."""
    max_attempts: int = 5
    """Attempts at one step (each membership failure costs one) before the run gives up."""
    collective_timeout_s: float = 120.0
    """A collective (or a rendezvous) waiting longer than this fails instead of hanging: the bound on how long a
    silent peer can stall the survivors before it is declared lost (hung, killed and replaced)."""

    heartbeat_timeout_s: float = 10.0
    """A worker whose heartbeat (a thread beside its step, beating once a second to the driver, outside the
    collectives) stays silent this long is declared hung and killed at once, so its peers' collectives fail now
    rather than at ``collective_timeout_s``; a worker that is merely slow (a long step, a big all-to-all) keeps
    beating. 0 turns the watch off."""

    sigterm_grace_s: float = 30.0
    """A worker process that gets SIGTERM (a platform's notice before it kills it: Slurm's preemption and
    ``scancel`` send it to every process of a job, then SIGKILL after ``GraceTime``) leaves at the next step boundary
    as a drained node's workers do, its deadline this many seconds after the signal (Kubernetes' and Slurm's usual
    grace is 30 s)."""

    driver_restarts: int = 3
    """How many times ``flexorch train`` starts a new driver when the one it started is lost (its process or node
    died): from the run's newest checkpoint, at the exact next batch. 0: a lost driver ends the run."""

    request_capacity: bool | str = "auto"
    """Ask the cluster's autoscaler for lost workers (``ray.autoscaler.sdk.request_resources``, one worker's
    resources per worker of the largest world the run has had, up to ``max_workers``), and withdraw the request once
    they have joined or the run ends (``flexorch.control.capacity``). 'auto': on when the run is on a Ray cluster
    that ``flexorch train`` did not start for it (``--address``, ``RAY_ADDRESS``, ``ray job submit``); without an
    autoscaler the request is a key in the GCS that nobody reads."""

    retire_below_speed: float = 0.0
    """Retire a worker as failed when its speed (``flexorch.solver.worker_speeds``: its measured pace against the
    cost model's, relative to the median worker's) stays below this for ``retire_after_steps`` observed steps: at a
    step boundary it leaves as a drained node's workers do (nothing re-run), and the step record's ``recoveries``
    say why (``"slow"``, the worker, its node and its speed). Never below ``min_workers``: then it stays, and the
    console says why once. 0 (the default) turns it off; e.g. 0.3 retires a worker running under a third of the
    others' pace, which the planner would otherwise keep planning around."""
    retire_after_steps: int = 5
    """How many consecutive observed steps a worker's speed must stay below ``retire_below_speed`` before it is
    retired (a passing hiccup, a compile, a world's first steps do not count)."""

    def __post_init__(self) -> None:
        if self.request_capacity not in (True, False, "auto"):
            raise ConfigError(f"elastic.request_capacity must be true, false or 'auto', got {self.request_capacity!r}")
        for name in ("min_workers", "max_workers"):
            v = getattr(self, name)
            if v is not None and not _positive_int(v):
                raise ConfigError(f"elastic.{name} must be a positive integer, got {v!r}")
        if self.min_workers is not None and self.max_workers is not None and self.min_workers > self.max_workers:
            raise ConfigError(
                f"need elastic.min_workers <= elastic.max_workers, got {self.min_workers} > {self.max_workers}"
            )
        if isinstance(self.wait_s, bool) or not isinstance(self.wait_s, int | float) or not self.wait_s >= 0:
            raise ConfigError(f"elastic.wait_s must be >= 0, got {self.wait_s!r}")
        if not _positive_int(self.max_attempts):
            raise ConfigError(f"elastic.max_attempts must be a positive integer, got {self.max_attempts!r}")
        t = self.collective_timeout_s
        if isinstance(t, bool) or not isinstance(t, int | float) or not t > 0:
            raise ConfigError(f"elastic.collective_timeout_s must be > 0, got {t!r}")
        g = self.sigterm_grace_s
        if isinstance(g, bool) or not isinstance(g, int | float) or not g > 0:
            raise ConfigError(f"elastic.sigterm_grace_s must be > 0 (seconds), got {g!r}")
        r = self.driver_restarts
        if isinstance(r, bool) or not isinstance(r, int) or r < 0:
            raise ConfigError(f"elastic.driver_restarts must be an integer >= 0, got {r!r}")
        v = self.retire_below_speed
        if isinstance(v, bool) or not isinstance(v, int | float) or not 0 <= v < 1:
            raise ConfigError(
                "elastic.retire_below_speed must be a number in [0, 1): 0 turns it off, e.g. 0.3 retires a worker "
                f"that runs under 0.3x the others' pace; got {v!r}"
            )
        if not _positive_int(self.retire_after_steps):
            raise ConfigError(
                f"elastic.retire_after_steps must be a positive integer (steps), got {self.retire_after_steps!r}"
            )
        h = self.heartbeat_timeout_s
        if isinstance(h, bool) or not isinstance(h, int | float) or not (h == 0 or h >= 2):
            raise ConfigError(
                f"elastic.heartbeat_timeout_s must be 0 (off) or at least 2 (seconds; workers beat once a second), "
                f"got {h!r}"
            )
