"""Where ``flexorch train`` starts its TrainingDriver actor, and how it tells that the driver was lost.

The driver (and the planner it starts beside it) are placed on the entrypoint's own node with a strict node
affinity: under ``ray job submit`` the entrypoint runs on the head, so a worker node's loss never takes the driver
with it. When that node cannot take the driver (the entrypoint is no Ray node, or the actor is not placed within
``PLACE_WAIT_S``) the driver goes where Ray puts it, and the start line says so and why.

A lost driver (its process or node died: Ray reports the actor dead, or it stays unreachable for
``UNREACHABLE_S``) raises :class:`DriverLost` in the CLI's poll loop; ``flexorch.cli.train`` then starts a new one
from the run's newest checkpoint (``[elastic] driver_restarts``). The driver's workers and planner are its own
actors, so Ray ends them with it.
"""

from __future__ import annotations

import time

import ray

__all__ = ["DriverLost", "PLACE_WAIT_S", "UNREACHABLE_S", "start_driver", "loss_reason", "poll_driver"]

PLACE_WAIT_S = 30.0
"""How long the driver may take to be placed on the entrypoint's node before it is placed anywhere."""
UNREACHABLE_S = 30.0
"""A driver that answers no poll for this long (its node frozen or cut off) is declared lost (and killed)."""


class DriverLost(Exception):
    """The driver actor died or stayed unreachable; ``seen_at``: when the CLI saw it (``time.time()``)."""

    def __init__(self, reason: str, seen_at: float):
        super().__init__(reason)
        self.reason = reason
        self.seen_at = seen_at


def loss_reason(err: BaseException) -> str:
    """The first sentence of Ray's word on a dead actor, without the traceback it may carry."""
    text = " ".join(str(err).split())
    i = text.find("The actor is dead because")
    if i > 0:
        text = text[i:]
    for cut in (" Traceback", " Some common causes", " The actor never ran", " Lease ID"):
        i = text.find(cut)
        if i > 0:
            text = text[:i]
    return text[:240].rstrip()


def _node_ip(node_id: str) -> str | None:
    for n in ray.nodes():
        if n["NodeID"] == node_id and n["Alive"]:
            return n["NodeManagerAddress"]
    return None


def start_driver(config: dict, restarted: dict | None = None) -> tuple[object, str]:
    """Start the TrainingDriver actor for ``config``: (actor handle, where it runs in words for the start line).
    ``restarted``: what the new driver records about the loss it replaces (``TrainingDriver`` keyword)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from flexorch.control.driver_process import TrainingDriverActor

    here = ray.get_runtime_context().get_node_id()
    why = "this entrypoint is not a Ray node" if _node_ip(here) is None else None
    if why is None:
        strict = NodeAffinitySchedulingStrategy(here, soft=False)
        driver = TrainingDriverActor.options(scheduling_strategy=strict).remote(config, restarted=restarted)
        try:
            where = ray.get(driver.where.remote(), timeout=PLACE_WAIT_S)
            return driver, f"driver and planner on this entrypoint's node {where['ip']} (pid {where['pid']})"
        except ray.exceptions.GetTimeoutError:
            why = f"this entrypoint's node did not take it within {PLACE_WAIT_S:g} s"
        except ray.exceptions.RayActorError as e:
            if e.actor_init_failed:
                raise RuntimeError(f"the driver could not start: {loss_reason(e)}") from None
            why = f"it could not run on this entrypoint's node ({loss_reason(e)})"
        ray.kill(driver, no_restart=True)
    driver = TrainingDriverActor.remote(config, restarted=restarted)
    try:
        where = ray.get(driver.where.remote(), timeout=PLACE_WAIT_S * 4)
    except ray.exceptions.GetTimeoutError:
        ray.kill(driver, no_restart=True)
        raise RuntimeError(
            f"the driver actor was not placed on any node within {PLACE_WAIT_S * 4:g} s: is the cluster up "
            "(`ray status`)?"
        ) from None
    return driver, f"driver and planner on node {where['ip']} (pid {where['pid']}; not the entrypoint's node: {why})"


def poll_driver(driver, seen: int, silent_since: list) -> tuple[list[dict], bool] | None:
    """One poll of the driver's events: (events, done), or None when it did not answer this time (it may be busy
    or briefly unreachable). Raises :class:`DriverLost` when Ray reports it dead or it stayed unreachable for
    ``UNREACHABLE_S``; ``silent_since`` (a one-item list) holds when the driver last stopped answering."""
    try:
        got = ray.get(driver.poll.remote(seen), timeout=UNREACHABLE_S / 3)
        silent_since[0] = None
        return got
    except (ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError) as e:
        now = time.time()
        if silent_since[0] is None:
            silent_since[0] = now
        elif now - silent_since[0] >= UNREACHABLE_S:
            ray.kill(driver, no_restart=True)
            raise DriverLost(f"it answered nothing for {now - silent_since[0]:.0f} s ({loss_reason(e)})", now) from e
        return None
    except ray.exceptions.RayActorError as e:
        raise DriverLost(loss_reason(e), time.time()) from e
