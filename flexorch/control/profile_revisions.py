"""The profile a run plans with, and every revision of it that a step record may name.

A run starts from its calibrated profile (revision 0; a resumed or restarted run goes on counting after the last
revision in ``profile_revisions.jsonl``). The refit loop (``control.refitting``) makes new revisions from the steps'
measured times; an out-of-memory step lowers the memory budget. Each revision is logged with why it came, and the
planner gets it for its next solve. A step is priced with the revision that planned it (its ``profile_revision``),
times the step level of the warm steps before it (``solver.step_level``), so the record's ``predicted_ms``, the
refit's verdict and the planner's choice are one price.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

from flexorch.control.refitting import RunRefit
from flexorch.solver.profiles import Profile

__all__ = ["ProfileRevisions"]

KEEP_REVISIONS = 3
"""Older revisions kept for pricing steps still in flight when a new one comes (the planner plans one step ahead)."""


class ProfileRevisions:
    """The current profile, the revisions steps were priced with, and the run's refit loop.

    ``refits``: whether ``[plan] refit`` is on (off: the profile as given, level 1); ``refit_every`` and ``static``
    configure the loop (``control.refitting.RunRefit``); ``publish`` takes the console's one-line messages."""

    def __init__(self, run_dir: Path, *, refits: bool, refit_every: int, static: bool, publish: Callable) -> None:
        self.run_dir = Path(run_dir)
        self.refits_on = refits
        self.refits = RunRefit(refit_every, static=static)
        self.priced: dict[int, Profile] = {}
        """Profile revision -> the profile (a plan is priced with its own)."""
        self.profile: Profile | None = None
        self._publish = publish
        self._planner = None

    @classmethod
    def for_run(cls, cfg, publish: Callable) -> ProfileRevisions:
        """The revisions of the run ``cfg`` (a TrainConfig) describes: its ``[plan]`` refit settings, in its run dir."""
        plan = cfg.plan
        return cls(
            cfg.run_dir,
            refits=plan.refits,
            refit_every=plan.refit_every,
            static=plan.static is not None,
            publish=publish,
        )

    def start(self, profile: Profile, resumed: bool, step_no: int) -> Profile:
        """The profile this start plans with: revision 0 of a fresh run (``profile_revisions.jsonl`` begins anew);
        a resumed or restarted run goes on counting after the file's last revision, so that a record's
        ``profile_revision`` names one profile."""
        path = self.run_dir / "profile_revisions.jsonl"
        if not resumed or not path.exists():
            path.unlink(missing_ok=True)
            self.profile = profile
            return profile
        last = max((json.loads(line)["revision"] for line in path.read_text().splitlines() if line.strip()), default=0)
        self.profile = dataclasses.replace(profile, revision=last + 1)
        self._log(self.profile, f"resumed at step {step_no}", step_no)
        return self.profile

    def attach(self, planner) -> None:
        """The planner client that gets every later revision (``set_profile``)."""
        self._planner = planner

    def replace(self, profile: Profile) -> None:
        """Plan with ``profile`` from the next solve on (an out-of-memory step's lowered budget)."""
        self.profile = profile
        self._planner.set_profile(profile)

    def priced_by(self, planned) -> Profile:
        """The profile that planned and priced ``planned`` (its ``profile_revision``): the record's timeline and the
        refit's verdict use the same price as its ``predicted_ms``."""
        self.priced[self.profile.revision] = self.profile
        return self.priced.get(planned.profile_revision, self.profile)

    def level(self, planned, priced_by: Profile) -> float:
        """The step level of the run's steps before this one (``solver.step_level``) that this SP step's prices are
        multiplied by; 1.0 without refits (``[plan] refit = 'off'``: the profile as given) and for
        pipelined steps."""
        if not self.refits_on or planned.pipelined:
            return 1.0
        return self.refits.level(priced_by)

    def after_step(self, record: dict, step_no: int, priced_by: Profile) -> None:
        """Hand a trained record to the run's refit (``control.refitting``: every ``plan.refit_every`` steps a refit
        of the time terms in a thread beside the next step, then a trial on the steps planned with it)."""
        if self.refits_on:
            self._apply(self.refits.after_step(record, step_no, self.profile, priced_by), step_no)

    def settle(self, wait: bool, step_no: int) -> None:
        """Take up a refit that has finished (``wait``: wait for one in flight): on trial when it predicts its window
        better; the console says what it did."""
        self._apply(self.refits.settle(self.profile, wait), step_no)

    def close(self) -> None:
        self.refits.close()

    def _apply(self, changes, step_no: int) -> None:
        """Execute the refit loop's decisions (``control.refitting.Change``): plan with a new profile revision from
        the next solve on, and say what happened in one line each."""
        for change in changes:
            if change.profile is not None:
                self.profile = change.profile
                keep = self.profile.revision - KEEP_REVISIONS
                self.priced = {r: p for r, p in self.priced.items() if r >= keep}
                self.priced[self.profile.revision] = self.profile
                self._planner.set_profile(self.profile)
                (self.run_dir / "profile_refit.json").write_text(self.profile.to_json())
                self._log(self.profile, change.message, step_no)
            if change.message:
                self._publish({"event": "planner", "message": change.message})

    def _log(self, profile: Profile, why: str, step_no: int) -> None:
        """Append ``profile`` to ``profile_revisions.jsonl``: every revision a record may name, and why it came."""
        entry = {"revision": profile.revision, "after_step": step_no, "why": why}
        with open(self.run_dir / "profile_revisions.jsonl", "a") as f:
            f.write(json.dumps({**entry, "profile": json.loads(profile.to_json())}) + "\n")
