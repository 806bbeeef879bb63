"""The driver in a process of its own: the Ray actor ``flexorch train`` and ``ray job submit`` start
(``flexorch.cli.driver_handle``).

After the start, what the driver built lives for the run (imports, the corpus index, the profile, the workers'
handles): :class:`DriverProcess` moves it out of the cyclic garbage collector's passes (``gc.freeze``), so that a full
pass during a step scans only what the steps make. With 1,024 workers a full pass over everything took a large share
of the driver's own time per step (``benchmarks/sim/control_plane.py``). Only a process that holds one driver does
this: frozen objects are never collected, so a process that builds many drivers (the tests) keeps the collector as
it is.

Threads: ``run`` in one thread while the CLI calls ``poll`` from another (``control.driver`` says what runs on
which thread).
"""

from __future__ import annotations

import gc

import ray

from flexorch.control.driver import TrainingDriver

__all__ = ["DriverProcess", "TrainingDriverActor"]


class DriverProcess(TrainingDriver):
    """A :class:`~flexorch.control.driver.TrainingDriver` that owns its process (see the module's docstring)."""

    def setup(self) -> dict:
        summary = super().setup()
        gc.collect()
        gc.freeze()
        return summary


TrainingDriverActor = ray.remote(num_cpus=0, max_concurrency=4)(DriverProcess)
"""The driver as a Ray actor (up to 4 calls at once: the run, the CLI's polls and stop requests)."""
