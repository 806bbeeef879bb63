"""The package versions a run's optional parts need, checked from the installed metadata before Ray starts.

A run that needs a package flexorch does not install by default (Transformers for ``[model] hf``, tokenizers for a
Hugging Face or trained BPE tokenizer, an experiment tracker the ``[tracking]`` table asks for) or a feature of a
newer torch (FSDP2 for ``[sharding] mode = "fsdp"`` / ``"hsdp"``) fails here, with the package, the version
installed and the version needed, instead of deep inside the first world a worker forms. The installed metadata is
read, nothing imported (milliseconds, and it works where the package itself would fail to import); only a package
importable without metadata is imported for its ``__version__``.

The minima are the oldest versions the suite has passed with: Transformers 5.17 (the HF model and tokenizer tests,
activation checkpointing included; 5.24 is the ``hf`` extra's pin), torch 2.11 (the data plane and a sharded step
on a lent GPU image; ``flexorch.workers.fsdp`` carries its fallback for a hook 2.13 added). The trackers' minima
are the ``track`` extra's floors; the suite ran with tensorboard 2.21, mlflow-skinny 3.17 and wandb 0.31.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata

from flexorch.config.errors import ConfigError

__all__ = ["Requirement", "check_requirements", "installed_version", "requirements_of", "version_tuple"]


@dataclass(frozen=True)
class Requirement:
    package: str
    """The distribution's name on PyPI."""
    minimum: str
    """The oldest version flexorch has run this part with."""
    needed_by: str
    """The setting that needs it, as the run file spells it."""
    install: str
    """What to run to get it."""
    alternatives: tuple[str, ...] = ()
    """Other distributions that install the same module (the full ``mlflow`` for ``mlflow-skinny``)."""


_HF_INSTALL = "pip install 'flexorch[hf]' (or pip install -e '.[hf]' in a checkout)"


def requirements_of(cfg) -> list[Requirement]:
    """What the run ``cfg`` (a ``TrainConfig``) needs beyond flexorch's required dependencies."""
    mode, _ = cfg.sharding.resolved(cfg.use_gpu)
    # one torch requirement, named after what needs it most (the same minimum: 2.11 ran both paths)
    torch_for = f"[sharding] mode = {mode!r} (FSDP2)" if mode in ("fsdp", "hsdp") else "flexorch's data plane"
    reqs = [Requirement("torch", "2.11", torch_for, "pip install 'torch>=2.11'")]
    if cfg.model.hf:
        reqs.append(Requirement("transformers", "5.17", f"[model] hf = {cfg.model.hf!r}", _HF_INSTALL))
    tok = cfg.data.tokenizer
    if tok.startswith(("hf:", "bpe:")) or (cfg.model.hf and tok == "auto"):
        reqs.append(Requirement("tokenizers", "0.23", f"[data] tokenizer = {tok!r}", _HF_INSTALL))
    return reqs + _tracker_requirements(cfg.tracking)


def _tracker_requirements(t) -> list[Requirement]:
    """The trackers a ``[tracking]`` table asks for by name (``tensorboard`` left out is on only when installed)."""
    from flexorch.config.tracking import TRACK_INSTALL

    reqs = []
    if t.tensorboard:
        reqs.append(Requirement("tensorboard", "2.20", "[tracking] tensorboard = true", TRACK_INSTALL))
    if t.mlflow_database:  # SQLAlchemy stores are in the full package only
        reqs.append(Requirement("mlflow", "3.0", f"[tracking] mlflow = {t.mlflow!r}", "pip install 'mlflow>=3.0'"))
    elif t.mlflow is not None:
        where = f"[tracking] mlflow = {t.mlflow!r}"
        reqs.append(Requirement("mlflow-skinny", "3.0", where, TRACK_INSTALL, alternatives=("mlflow",)))
    if t.wandb is not None:
        reqs.append(Requirement("wandb", "0.20", f"[tracking] wandb = {t.wandb!r}", TRACK_INSTALL))
    return reqs


def version_tuple(version: str) -> tuple[int, ...]:
    """``'2.13.0+cpu'`` -> ``(2, 13, 0)``: the leading release numbers (a pre-release counts as its release)."""
    m = re.match(r"\d+(\.\d+)*", version.strip())
    if not m:
        raise ValueError(f"not a version: {version!r}")
    return tuple(int(x) for x in m.group(0).split("."))


def installed_version(package: str) -> str:
    """The installed version of ``package``: its distribution metadata, or, for a package importable without any
    (a torch built from source into an image), its ``__version__``; ``PackageNotFoundError`` when it is absent."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        if importlib.util.find_spec(package) is None:
            raise
    version = getattr(importlib.import_module(package), "__version__", None)
    if not isinstance(version, str):
        raise metadata.PackageNotFoundError(package)
    return version


def check_requirements(cfg, installed: Callable[[str], str] | None = None) -> None:
    """Raise ``ConfigError`` naming the first requirement of ``cfg`` that is missing or too old.

    ``installed`` maps a distribution name to its version (:func:`installed_version`, raising
    ``PackageNotFoundError`` when it is absent); tests pass another environment's versions."""
    installed = installed or installed_version
    for req in requirements_of(cfg):
        package, have = _first_installed(req, installed)
        if have is None:
            raise ConfigError(
                f"{req.needed_by} needs {req.package} >= {req.minimum}, which is not installed: {req.install}"
            )
        if version_tuple(have) < version_tuple(req.minimum):
            raise ConfigError(
                f"{req.needed_by} needs {package} >= {req.minimum}; this environment has {package} {have}. "
                f"Upgrade it: pip install -U '{package}>={req.minimum}'"
            )


def _first_installed(req: Requirement, installed: Callable[[str], str]) -> tuple[str, str | None]:
    """(distribution, version) of the first of ``req``'s distributions installed, else (its package, None)."""
    for package in (req.package, *req.alternatives):
        try:
            return package, installed(package)
        except metadata.PackageNotFoundError:
            continue
    return req.package, None
