"""Checks of a training run that need no worker, run by ``flexorch train`` and ``flexorch profile`` before Ray starts.

Everything that can be wrong without a worker is found here, within seconds of the command, with what was wrong and
what to do: the versions of the packages the run's optional parts need (``flexorch.config.requirements``), the
configuration itself (already checked when it was built: ``flexorch.config``), the data source (exists, readable,
holds at least one document: ``flexorch.data.source_check.check_source``, plain file reads), a local tokenizer
directory, the checkpoint storage (writable, its bucket there: ``CheckpointStore.check_writable``), the checkpoint a
``--resume`` continues from (present, every file matching its manifest, written for this model:
``flexorch.control.checkpoint.check_resume``), and a fixed cost-model profile (readable, and consistent with the
model's shape). What needs the corpus loaded (its fingerprint against the checkpoint's) or the workers (calibration)
is checked by the driver after the corpus is read, still before any worker starts.
"""

from __future__ import annotations

from pathlib import Path

from flexorch.config import ConfigError, TrainConfig

__all__ = ["preflight"]


def preflight(cfg: TrainConfig) -> list[str]:
    """Raise ``ConfigError``, ``DataError`` or ``ProfileError`` (all ValueErrors: the CLI prints them and exits 2)
    for the first problem found; returns lines worth telling the user (e.g. the checkpoint ``--resume`` takes)."""
    from flexorch.config.requirements import check_requirements
    from flexorch.data.source_check import check_source

    check_requirements(cfg)
    notes: list[str] = []
    if cfg.tasks:  # [[tasks]]: every task's own data (the run's [data] only gives their defaults)
        from flexorch.data.errors import DataError

        for task in cfg.tasks:
            try:
                check_source(task.data)
            except DataError as e:
                raise DataError(f"[[tasks]] {task.name!r}: {e}") from None
    elif cfg.data.sources:  # [[data.sources]]: every source of the mixture
        from flexorch.data.errors import DataError

        for i, src in enumerate(cfg.data.sources):
            try:
                check_source(cfg.data.source_config(i))
            except DataError as e:
                raise DataError(f"[[data.sources]] {src.name!r}: {e}") from None
    else:
        check_source(cfg.data)
    spec = cfg.data.tokenizer
    if spec.startswith("hf:") and not Path(spec[3:]).expanduser().is_dir():
        raise ConfigError(f"[data] tokenizer = {spec!r}: directory {spec[3:]!r} does not exist")
    from flexorch.control.checkpoint_store import CheckpointStore

    store = CheckpointStore.of_run(cfg.run_dir, cfg.checkpoint.storage)
    store.check_writable()  # the storage every checkpoint goes to: a missing bucket is said before Ray starts
    if cfg.resume:
        from flexorch.control.checkpoint import check_resume

        notes.append(check_resume(store, cfg.model.to_dict()))
    if cfg.plan.profile != "auto":
        _check_profile(cfg)
    return notes


def _check_profile(cfg: TrainConfig) -> None:
    """A fixed profile loads and fits the model (heads, layers, per-worker budget), as the run will fit it."""
    from flexorch.control.calibration import fitted_profile
    from flexorch.solver.profiles import ProfileError, get_profile

    try:
        fitted_profile(get_profile(cfg.plan.profile), cfg)
    except ProfileError as e:
        m = cfg.model
        raise ProfileError(
            f"plan.profile = {cfg.plan.profile!r}: {e}. A fixed profile must fit this model (hidden {m.dim}, "
            f"{m.num_heads} heads, {m.num_kv_heads} KV heads); use profile = 'auto' to calibrate on the workers"
        ) from None
