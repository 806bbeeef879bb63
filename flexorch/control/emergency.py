"""A run that must stop on an error keeps its work: a checkpoint of the state after the last completed step.

When the step loop fails for good (the elastic policy said Fail, a worker raised its own error, the planner gave
up), the members that are still alive may hold a consistent state: the state after the driver's last completed step
(the stream position the driver holds belongs to it). :func:`save_after_error` finds the members whose state version
(optimizer steps applied) equals that step, drops the others (they died, hung, are newcomers without state, or ran
ahead on a broken step), re-forms a world of the holders when the state is sharded (each new rank's rows come from
the holders, ``flexorch.workers.reshard``, and the world must restore exactly that version), and writes the run's
ordinary checkpoint, so ``--resume`` continues at the exact next batch. When that is impossible the answer says why
and where the last periodic checkpoint is.
"""

from __future__ import annotations

from collections.abc import Callable

from flexorch.control.failures import MembershipFailure
from flexorch.control.group import WorkerGroup

__all__ = ["save_after_error"]

VERSION_TIMEOUT_S = 30.0
"""How long members get to say which state they hold (a hung one is left out)."""


def save_after_error(
    workers: WorkerGroup | None,
    done: int,
    *,
    checkpointed_at: int | None,
    last_checkpoint: str | None,
    save: Callable[[], str],
    resume: str,
) -> tuple[str | None, str]:
    """(path written or None, one sentence for the error line). ``done``: steps completed (the driver's step
    number); ``checkpointed_at``: the step of the newest checkpoint this run has (None: none); ``save``: writes
    the run's checkpoint from the current members and returns its path; ``resume``: the command to go on with."""
    if checkpointed_at == done and last_checkpoint is not None:
        return None, f"The checkpoint of step {done}, {last_checkpoint}, holds every completed step: {resume}"
    if done == 0 or workers is None:
        return None, "No step was completed, so there was no work to keep"
    try:
        versions = workers.state_versions(VERSION_TIMEOUT_S)
        holders = sorted(w for w, v in versions.items() if v == done)
        if not holders:
            held = ", ".join(f"worker {w}: {v}" for w, v in sorted(versions.items())) or "no worker answered"
            raise RuntimeError(f"no live worker holds the state after step {done} (steps applied: {held})")
        others = [w for w in workers.worker_ids if w not in holders]
        if others:
            workers.remove(others)
        if workers.sharded:  # the holders' rows, re-sharded over a world of the holders
            _form_world_of_holders(workers)
            restored = workers.restored
            if restored is None or restored["version"] != done:
                got = None if restored is None else restored["version"]
                raise RuntimeError(f"the holders' shards restored version {got}, not the state after step {done}")
        path = save()
    except Exception as e:  # noqa: BLE001 - the run is stopping anyway: say why nothing was kept
        why = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}" if str(e) else type(e).__name__
        last = f"the last checkpoint is {last_checkpoint}" if last_checkpoint else "no checkpoint was written yet"
        return None, f"No emergency checkpoint could be written ({why}); {last}"
    return path, f"An emergency checkpoint of the state after step {done} was written to {path}: {resume}"


def _form_world_of_holders(workers: WorkerGroup) -> None:
    """Form a world of the current members; a member lost while it forms (a newcomer that had its state copied and
    then died, a node going away) is dropped and the rest try again, as long as no one raised an error of its own.
    Whether the rest still hold every shard is the restore's check."""
    for _ in range(len(workers.worker_ids)):
        try:
            workers.form_world()
            return
        except MembershipFailure as e:  # who was lost
            gone = sorted(set(e.failure.lost) & set(workers.worker_ids))
            if not gone or e.failure.errors or len(gone) == len(workers.worker_ids):
                raise
            workers.remove(gone)
    workers.form_world()
