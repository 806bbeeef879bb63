"""The model state the workers hold, moved between them: copies from one member to others (replicas), stage-local
parameters placed where a pipelined step needs them, the whole state assembled for a checkpoint or set from one,
sharded checkpoints written and read by every member, and what members on a draining node hand over before they go.

:class:`StateMoves` is a component of :class:`~flexorch.control.worker_group.RayWorkerGroup`: it is given the
group's actors (a live view), its membership (the members in rank order), the settler that waits on its calls
(``control.settle``), whether the state is sharded and the model's parts; it owns ``held``, the model parts each
member holds (``flexorch.work.placement``), which the group updates as members come and go."""

from __future__ import annotations

import time
from collections.abc import Callable

import ray

from flexorch.control.failures import WorkerGroupError
from flexorch.control.membership import Membership
from flexorch.control.settle import Settler
from flexorch.work.placement import ALL, handoff_needs, missing_parts, transfers

__all__ = ["StateMoves"]


class StateMoves:
    """Moving model state between the workers (see the module's docstring)."""

    def __init__(self, actors: dict, membership: Membership, settler: Settler, *, sharded: bool, parts) -> None:
        self._actors = actors  # worker id -> actor handle: the group's own dict
        self._membership = membership
        self._settler = settler
        self.sharded = sharded
        self.parts = parts
        """The model's parts (``flexorch.work.placement.model_parts``)."""
        self.held: dict[int, frozenset[str] | None] = {}
        """Model parts each member holds (None: the whole model)."""

    @property
    def worker_ids(self) -> tuple[int, ...]:
        return self._membership.worker_ids

    @property
    def timeout_s(self) -> float:
        return self._settler.timeout_s

    def call_all(self, refs: dict, what: str, timeout_s: float) -> dict:
        return self._settler.call_all(refs, what, timeout_s)

    def joined(self, worker_id: int) -> None:
        """A new member: it builds the whole model (its state comes from :meth:`sync_state`)."""
        self.held[worker_id] = ALL

    def left(self, worker_id: int) -> None:
        self.held.pop(worker_id, None)

    def hand_off(self, leaving) -> dict:
        """Before members ``leaving`` go (their node is being drained), give the members that stay what only the
        leaving hold: with sharded state each leaving worker's shards (round robin over the stayers, who bring them
        to the next world's re-shard); with stage-local parameters the parts no stayer holds (``place_params``);
        replicas hold everything already. Returns ``{"handoff_bytes", "handoff_ms"}``."""
        t0 = time.perf_counter()
        leaving = sorted(leaving)
        stay = [w for w in self.worker_ids if w not in leaving]
        nbytes = 0
        if self.sharded:  # each leaver returns (size, holding): the driver waits on the sizes, never the shards
            pairs = {w: self._actors[w].hand_off.remote() for w in leaving}
            self.call_all({w: p[0] for w, p in pairs.items()}, "hand off the leaving workers' shards", self.timeout_s)
            handed: dict[int, list] = {}
            for i, w in enumerate(leaving):
                handed.setdefault(stay[i % len(stay)], []).append(pairs[w][1])
            refs = {dst: self._actors[dst].take_handoff.remote(rs) for dst, rs in handed.items()}
            got = self.call_all(refs, "take the leaving workers' shards", self.timeout_s)
            nbytes = int(sum(got.values()))
        else:
            needed = handoff_needs(self.held, self.worker_ids, leaving, self.parts)
            if needed is not None:
                nbytes = int(self.place_params(needed)["moved_bytes"])
        return {"handoff_bytes": nbytes, "handoff_ms": (time.perf_counter() - t0) * 1e3}

    def sync_state(self, source: int, targets) -> None:
        """Copy model, optimizer, schedule and RNG state from worker ``source`` to ``targets`` (object store): they
        then hold what ``source`` holds (with stage-local parameters, its parts only)."""
        targets = [t for t in targets if t != source]
        if self.sharded:  # sharded state moves as the next world forms (flexorch.workers.reshard)
            return
        if targets:
            ref = self._actors[source].get_state.remote()
            self.call_all(
                {t: self._actors[t].set_state.remote(ref) for t in targets}, "copy the model state", self.timeout_s
            )
            for t in targets:
                self.held[t] = self.held[source]

    def missing_parts(self) -> list[str]:
        """Model parts no member holds (their every holder was lost)."""
        return missing_parts({w: self.held[w] for w in self.worker_ids}, self.parts)

    def place_params(self, needed_by_rank) -> dict:
        """Before a step with stage-local parameters: copy to each member the parts it will need and does not hold
        (``needed_by_rank[r]``: the parts rank r holds during the step), each from a holder, through the object
        store; the step itself drops what a member no longer needs. Returns what moved."""
        t0 = time.perf_counter()
        needed = {w: frozenset(needed_by_rank[r]) for r, w in enumerate(self.worker_ids)}
        moves = transfers({w: self.held[w] for w in self.worker_ids}, needed, self.parts)
        refs = {}
        for dst, srcs in moves.items():
            exported = [self._actors[src].export_parts.remote(list(parts)) for src, parts in srcs.items()]
            refs[dst] = self._actors[dst].import_parts.remote(exported)
        got = self.call_all(refs, "move parameters between stages", self.timeout_s) if refs else {}
        self.held.update(needed)
        return {
            "moved_parts": sum(len(ps) for srcs in moves.values() for ps in srcs.values()),
            "moved_bytes": int(sum(got.values())),
            "move_ms": (time.perf_counter() - t0) * 1e3,
        }

    def get_state(self, rank: int = 0) -> dict:
        """The whole model's state: from one member when it holds everything, else assembled from holders of
        every part (model tensors and optimizer state by part; schedule and RNG from the first)."""
        ids = self.worker_ids
        first = ids[rank]
        if self.held[first] is ALL:
            return self.call_all(
                {first: self._actors[first].get_state.remote()}, "fetch the model state", self.timeout_s
            )[first]
        missing = self.missing_parts()
        if missing:
            raise WorkerGroupError(f"no member holds {missing}: the model state cannot be assembled")
        chosen, covered = [], set()
        for w in [first, *[x for x in ids if x != first]]:  # fewest fetches: take holders in rank order
            if self.held[w] is ALL or not self.held[w] <= covered:
                chosen.append(w)
                covered |= set(self.parts) if self.held[w] is ALL else self.held[w]
            if covered >= set(self.parts):
                break
        got = self.call_all(
            {w: self._actors[w].get_state.remote() for w in chosen}, "fetch the model state", self.timeout_s
        )
        state = dict(got[chosen[0]])
        state["model"], state["optimizer"] = {}, dict(state["optimizer"], state={})
        for w in chosen:
            state["model"].update(got[w]["model"])
            state["optimizer"]["state"].update(got[w]["optimizer"]["state"])
        state["parts"] = None
        return state

    def save_sharded(self, directory: str) -> None:
        """Every member writes its shard of the model state into ``directory`` (sharded model state)."""
        self.call_all(
            {w: self._actors[w].save_sharded.remote(directory) for w in self.worker_ids}, "save", self.timeout_s
        )

    def stage_sharded(self, directory: str) -> Callable[[float], dict[int, dict[str, str]]]:
        """Every member stages its shard in host memory (a collective, waited for here) and copies it to ``directory``
        in the background. Returns ``wait(timeout_s)``: {worker id: its files and their SHA-256} once every copy is
        done, else the error of the first that failed (a member lost meanwhile fails it). ``wait`` holds this
        world's actors, so it can be called from another thread while the group changes."""
        self.call_all(
            {w: self._actors[w].stage_sharded.remote(directory) for w in self.worker_ids}, "stage", self.timeout_s
        )
        actors = {w: self._actors[w] for w in self.worker_ids}

        def wait(timeout_s: float) -> dict[int, dict[str, str]]:
            refs = {w: a.finish_upload.remote(timeout_s) for w, a in actors.items()}
            return {w: ray.get(r, timeout=timeout_s + 30) for w, r in refs.items()}

        return wait

    def write_whole(self, directory: str, background: bool) -> Callable[[float], dict[str, str]] | None:
        """Replicated state: the first member holding the whole model writes ``model.pt`` and ``train_state.pt``
        into ``directory`` itself (now, or with ``background`` from a thread of its own while it trains on), so the
        state never travels to the driver. Returns ``wait(timeout_s)``: {file: SHA-256} once written, else the
        error; None when no member holds the whole model (stage-local parameters: ``get_state`` assembles it)."""
        whole = next((w for w in self.worker_ids if self.held.get(w) is ALL), None)
        if whole is None:
            return None
        actor = self._actors[whole]
        ref = actor.write_state.remote(directory, background)
        got = self.call_all({whole: ref}, "write the checkpoint", self.timeout_s)[whole]
        if not background:
            return lambda timeout_s: got
        return lambda timeout_s: ray.get(actor.finish_upload.remote(timeout_s), timeout=timeout_s + 30)

    def set_state(self, state: dict) -> None:
        if "sharded_dir" in state:  # a sharded checkpoint: each member reads its own rows, on any world size
            d = state["sharded_dir"]
            self.call_all({w: self._actors[w].load_sharded.remote(d) for w in self.worker_ids}, "load", self.timeout_s)
            return
        ref = ray.put(state)
        self.call_all({w: self._actors[w].set_state.remote(ref) for w in self.worker_ids}, "load state", self.timeout_s)
        for w in self.worker_ids:
            self.held[w] = ALL if state.get("parts") is None else frozenset(state["parts"])

    def state_versions(self, timeout_s: float) -> dict[int, int]:
        """{worker id: optimizer steps in the state it holds} of the members that answer within ``timeout_s``; one
        that does not (dead or hung) is left out (and killed, as :meth:`settle` does)."""
        refs = {w: self._actors[w].state_version.remote() for w in self.worker_ids}
        results, _ = self._settler.settle(refs, timeout_s)
        return {w: int(v) for w, v in results.items()}
