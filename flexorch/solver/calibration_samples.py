"""Timing samples the workers measure for calibration (`solver.calibration`): flat, validated, JSON-friendly.

Each sample is a frozen dataclass with `to_dict`/`from_dict`; a bad value (non-finite, zero or negative time, a
degree that is not a power of two, an unknown kind) raises `ProfileError` naming the sample.

A group's samples say where the group lay (``spans``: its ranks on more than one node, ``solver.topology``): the fit
puts those measured across nodes into the profile's ``inter_*`` tables, the others into the intra-node ones. The
field is written to a sample's dict only when true, so a one-node calibration's samples read as they always did.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import numpy as np

from flexorch.solver.cost_model import KINDS
from flexorch.solver.errors import ProfileError

__all__ = ["ComputeSample", "CommSample", "GroupSample"]


def _check_ms(ms, what: str) -> float:
    if isinstance(ms, bool) or not isinstance(ms, int | float) or not math.isfinite(ms) or ms <= 0:
        raise ProfileError(f"{what}: ms must be a finite time > 0, got {ms!r}")
    return float(ms)


def _check_lengths(seq_lengths, what: str) -> tuple[int, ...]:
    try:
        out = tuple(seq_lengths)
    except TypeError:
        raise ProfileError(f"{what}: seq_lengths must be a list of token counts, got {seq_lengths!r}") from None
    if not out or any(isinstance(s, bool) or not isinstance(s, int | np.integer) or s < 1 for s in out):
        raise ProfileError(f"{what}: seq_lengths must be a non-empty list of integers >= 1, got {list(out)!r}")
    return tuple(int(s) for s in out)


def _check_spans(spans, what: str) -> bool:
    if not isinstance(spans, bool | np.bool_):
        raise ProfileError(f"{what}: spans must be true or false, got {spans!r}")
    return bool(spans)


def _to_dict(sample) -> dict:
    """A sample's fields in order (``seq_lengths`` as a list); ``spans`` only when true (see the module docstring)."""
    out = {}
    for f in fields(sample):
        value = getattr(sample, f.name)
        if f.name != "spans":
            out[f.name] = list(value) if isinstance(value, tuple) else value
        elif value:
            out["spans"] = True
    return out


def _from_dict(cls, data: dict):
    """A ``cls`` sample from :func:`_to_dict`'s dict: every field but ``spans`` required, ``spans`` false if absent."""
    return cls(**{f.name: data.get("spans", False) if f.name == "spans" else data[f.name] for f in fields(cls)})


def _check_group(kind, degree, what: str, *, allow_one: bool) -> None:
    if kind not in KINDS:
        raise ProfileError(f"{what}: kind must be one of {KINDS}, got {kind!r}")
    low = 1 if allow_one else 2
    if isinstance(degree, bool) or not isinstance(degree, int) or degree < low or degree & (degree - 1):
        raise ProfileError(f"{what}: degree must be a power of two >= {low}, got {degree!r}")


@dataclass(frozen=True)
class ComputeSample:
    """Forward+backward time of one packed micro-batch of `seq_lengths` on ONE device (d = 1), all layers."""

    seq_lengths: tuple[int, ...]
    """Token counts of the sequences packed into the micro-batch."""
    ms: float
    """Measured wall time, ms (> 0)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "seq_lengths", _check_lengths(self.seq_lengths, "compute sample"))
        object.__setattr__(self, "ms", _check_ms(self.ms, f"compute sample {list(self.seq_lengths)[:4]}"))

    def to_dict(self) -> dict:
        return _to_dict(self)

    @classmethod
    def from_dict(cls, data: dict) -> ComputeSample:
        return _from_dict(cls, data)


@dataclass(frozen=True)
class CommSample:
    """The time of all the collectives of one micro-batch (forward+backward, all layers) on a group of `degree`
    with `kind` attention when each rank holds `tokens_per_rank` local tokens.

    Time the collectives directly. For Ulysses, whose all-to-alls do not overlap compute, the group's micro-batch
    time minus (the same work's time on one device) / d measures the same thing; for ring, whose K/V exchanges
    overlap block compute, that difference under-counts them.
    """

    kind: str
    """'ulysses' (all-to-alls) or 'ring' (K/V exchanges)."""
    degree: int
    """SP degree d, a power of two >= 2."""
    tokens_per_rank: int
    """Local tokens on each rank (the group's tokens / d)."""
    ms: float
    """Measured time, ms (> 0)."""
    spans: bool = False
    """The group's ranks lay on more than one node (fitted into the profile's ``inter_*`` tables)."""

    def __post_init__(self) -> None:
        what = f"comm sample {self.kind}-{self.degree}{' across nodes' if self.spans is True else ''}"
        _check_group(self.kind, self.degree, what, allow_one=False)
        t = self.tokens_per_rank
        if isinstance(t, bool) or not isinstance(t, int | np.integer) or t < 1:
            raise ProfileError(f"{what}: tokens_per_rank must be an integer >= 1, got {t!r}")
        object.__setattr__(self, "tokens_per_rank", int(t))
        object.__setattr__(self, "ms", _check_ms(self.ms, what))
        object.__setattr__(self, "spans", _check_spans(self.spans, what))

    def to_dict(self) -> dict:
        return _to_dict(self)

    @classmethod
    def from_dict(cls, data: dict) -> CommSample:
        return _from_dict(cls, data)


@dataclass(frozen=True)
class GroupSample:
    """Measured time of one SP group's micro-batch (forward+backward, all layers): to check a profile against."""

    seq_lengths: tuple[int, ...]
    """Token counts of the sequences the group ran."""
    degree: int
    """SP degree d (1: a single device)."""
    kind: str
    """'ulysses' or 'ring'."""
    ms: float
    """Measured wall time, ms (> 0)."""
    spans: bool = False
    """The group's ranks lay on more than one node (priced with the profile's ``inter_*`` tables)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "seq_lengths", _check_lengths(self.seq_lengths, "group sample"))
        _check_group(self.kind, self.degree, "group sample", allow_one=True)
        what = f"group sample {self.kind}-{self.degree}"
        object.__setattr__(self, "ms", _check_ms(self.ms, what))
        object.__setattr__(self, "spans", _check_spans(self.spans, what))
        if self.spans and self.degree == 1:
            raise ProfileError(f"{what}: one device cannot span nodes (spans=True needs degree >= 2)")

    def to_dict(self) -> dict:
        return _to_dict(self)

    @classmethod
    def from_dict(cls, data: dict) -> GroupSample:
        return _from_dict(cls, data)
