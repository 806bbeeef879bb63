"""Calibration: timings measured on the real workers in, a `Profile` out (docs/design.md §2.1: constants are profiled).

The model fitted is FlexSP's (arXiv 2412.01523, §4.1.2) with flexorch's per-degree latency extension (measured
per docs/design.md §7; see `solver.cost_model`):

* compute, one packed micro-batch of sequences s_i on ONE device, forward+backward, all layers:
      ms = b1 + a1 * sum_i s_i^2 + a2 * sum_i s_i
* collectives of one micro-batch on a group of degree d with `kind` attention, t local tokens per rank:
      ms = latency[kind][d] + comm_bytes(t * d, d, kind) / bw[kind][d]      (`solver.cost_model.comm_bytes`)

On several nodes (``solver.topology``) the collectives are fitted twice over: samples of groups inside one node fill
the profile's intra-node tables (``a2a_gbps``, ``a2a_latency_ms``, ...), samples of groups that span nodes
(``spans``) its ``inter_*`` tables (a degree measured only across nodes, one no node holds, fills both: a profile
priced without a topology then sees what such a group costs, as the built-in A100 tables do for d >= 16).

Both are fitted by non-negative least squares on relative errors (each row divided by its measured ms, so a 1 ms
and a 1 s sample weigh alike); with at most three unknowns the exact NNLS optimum is the best least-squares solution
over every support of the unknowns, so plain numpy suffices. Everything here is JSON-friendly: samples and reports
are flat dataclasses with `to_dict`/`from_dict`, so the worker side can send them over the wire.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from flexorch.solver.calibration_samples import CommSample, ComputeSample, GroupSample
from flexorch.solver.cost_model import RING, ULYSSES, attention_square, comm_bytes, group_time_ms
from flexorch.solver.errors import ProfileError
from flexorch.solver.profiles import Profile

__all__ = [
    "ComputeSample",
    "CommSample",
    "GroupSample",
    "FitError",
    "FitReport",
    "MIN_COMPUTE_SAMPLES",
    "MIN_COMM_SAMPLES",
    "MAX_GBPS",
    "MIN_GBPS",
    "fit_profile",
    "predict_ms",
    "prediction_errors",
    "fit_compute_terms",
    "fit_group_comm",
    "intra_from_inter",
]

MIN_COMPUTE_SAMPLES = 3
"""One per unknown (b1, a1, a2); a dozen from short to long, single and packed, fit much better."""
MIN_COMM_SAMPLES = 2
"""Per (kind, degree), one per unknown (latency, bandwidth), at two or more message sizes."""
MAX_GBPS = 1e4
"""Fitted bandwidths are clamped to [MIN_GBPS, MAX_GBPS]: the cap stands for 'no measurable byte cost'."""
MIN_GBPS = 1e-9


@dataclass(frozen=True)
class FitError:
    """Relative residuals |predicted - measured| / measured of one fitted term over its samples."""

    samples: int
    max_rel_error: float
    median_rel_error: float

    @classmethod
    def from_errors(cls, errors: Sequence[float]) -> FitError:
        a = np.abs(np.asarray(errors, dtype=np.float64))
        return cls(int(a.size), float(a.max()) if a.size else 0.0, float(np.median(a)) if a.size else 0.0)


@dataclass(frozen=True)
class FitReport:
    """How well the fitted profile reproduces the samples it was fitted on, per term."""

    compute: FitError
    """The compute fit (b1, a1, a2)."""
    comm: dict[str, FitError] = field(default_factory=dict)
    """Per '<kind>-<degree>' (e.g. 'ulysses-2'): the latency/bandwidth fit of groups inside one node."""
    notes: tuple[str, ...] = ()
    """What the fit could not resolve (e.g. a bandwidth clamped because the byte term was not measurable)."""
    inter_comm: dict[str, FitError] = field(default_factory=dict)
    """Per '<kind>-<degree>': the fit of groups that span nodes (the ``inter_*`` tables); empty on one node."""

    @property
    def max_rel_error(self) -> float:
        comm = [*self.comm.values(), *self.inter_comm.values()]
        return max([self.compute.max_rel_error, *(e.max_rel_error for e in comm)])

    def to_dict(self) -> dict:
        out = {
            "compute": asdict(self.compute),
            "comm": {k: asdict(v) for k, v in sorted(self.comm.items())},
            "notes": list(self.notes),
            "max_rel_error": self.max_rel_error,
        }
        if self.inter_comm:  # several nodes only: a one-node report reads as it always did
            out["inter_comm"] = {k: asdict(v) for k, v in sorted(self.inter_comm.items())}
        return out


def _nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """argmin ||a x - b|| subject to x >= 0, for a handful of columns: the best least-squares fit over every support.

    The NNLS optimum is a least-squares solution on its own support, so enumerating supports (2^n - 1 of them)
    finds it exactly. Columns are scaled to unit norm first (sum s^2 and 1 differ by many orders of magnitude).
    """
    scale = np.linalg.norm(a, axis=0)
    scale[scale == 0] = 1.0
    an = a / scale
    n = a.shape[1]
    best, best_r = np.zeros(n), float(b @ b)
    for mask in range(1, 1 << n):
        cols = [j for j in range(n) if mask >> j & 1]
        x, *_ = np.linalg.lstsq(an[:, cols], b, rcond=None)
        if (x < 0).any():
            continue
        r = an[:, cols] @ x - b
        if float(r @ r) < best_r:
            best_r = float(r @ r)
            best = np.zeros(n)
            best[cols] = x
    return best / scale


def _relative_fit(features: np.ndarray, ms: np.ndarray, what: str, hint: str) -> np.ndarray:
    """NNLS of ms ~ features @ x on relative errors (rows divided by ms); the unknowns must be identifiable."""
    rows = features / ms[:, None]
    if np.linalg.matrix_rank(rows / np.linalg.norm(rows, axis=0).clip(min=1e-300)) < features.shape[1]:
        raise ProfileError(f"{what}: the samples do not separate the unknowns: {hint}")
    return _nnls(rows, np.ones(ms.size))


def fit_compute_terms(
    samples: Sequence[ComputeSample], what: str = "compute_samples", profile: Profile | None = None
) -> tuple[float, float, float]:
    """(b1, a1, a2) of ``ms = b1 + a1 * sum s^2 + a2 * sum s`` fitted to degree-1 samples (NNLS on relative errors);
    ProfileError when the samples do not separate the three. ``profile``: the model's sliding windows, if any, make
    ``s^2`` the window-aware ``attention_square(s)`` (``flexorch.solver.cost_model``), so a1 is the price of one
    key-query pair whatever the window."""
    feats = np.array(
        [[1.0, float(_squares(c.seq_lengths, profile).sum()), sum(c.seq_lengths)] for c in samples], dtype=np.float64
    )
    b1, a1, a2 = _relative_fit(
        feats,
        np.array([c.ms for c in samples]),
        what,
        "time micro-batches of different total tokens, some one long sequence, some many short ones packed",
    )
    return float(b1), float(a1), float(a2)


def _squares(lengths, profile: Profile | None) -> np.ndarray:
    s = np.asarray(lengths, dtype=np.float64)
    return s * s if profile is None else attention_square(s, profile)


def _coerce(samples, cls, what: str) -> list:
    out = []
    for i, s in enumerate(samples):
        try:
            out.append(s if isinstance(s, cls) else cls.from_dict(s))
        except (KeyError, TypeError) as e:
            raise ProfileError(f"{what}[{i}] is not a {cls.__name__}: {e!r}") from None
        except ProfileError as e:
            raise ProfileError(f"{what}[{i}]: {e}") from None
    return out


def fit_profile(
    name: str,
    *,
    num_layers: int,
    hidden: int,
    num_heads: int,
    num_kv_heads: int,
    head_size: int = 0,
    attention_window: int = 0,
    window_fraction: float = 0.0,
    bytes_per_element: int = 2,
    compute_samples: Sequence[ComputeSample | dict],
    comm_samples: Sequence[CommSample | dict],
    act_bytes_per_token: float,
    memory_budget_bytes: float,
    model_state_bytes: float = 0.0,
) -> tuple[Profile, FitReport]:
    """Fit a1, a2, b1 (compute samples) and per-(kind, degree) latency and bandwidth (comm samples) into a Profile.

    Needs >= MIN_COMPUTE_SAMPLES compute samples with different token counts and long/short mixes, and for at least
    one Ulysses degree (the profile's a2a tables need an entry) >= MIN_COMM_SAMPLES comm samples per (kind, degree)
    at different `tokens_per_rank`. Ring degrees without samples fall back to the Ulysses tables (`Profile`).
    Samples measured across nodes (``spans``) are fitted per (kind, degree) on their own into the ``inter_*``
    tables; a (kind, degree) measured only across nodes fills the intra table too (module docstring).
    """
    dims = Profile(  # validates the model dimensions and memory first; its a2a_gbps is a placeholder
        name=name,
        a1_ms=0.0,
        a2_ms=0.0,
        b1_ms=0.0,
        act_bytes_per_token=act_bytes_per_token,
        memory_budget_bytes=memory_budget_bytes,
        model_state_bytes=model_state_bytes,
        num_layers=num_layers,
        hidden=hidden,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        attention_window=attention_window,
        window_fraction=window_fraction,
        bytes_per_element=bytes_per_element,
        a2a_gbps={2: 1.0},
    )
    comp = _coerce(compute_samples, ComputeSample, "compute_samples")
    comms = _coerce(comm_samples, CommSample, "comm_samples")
    notes: list[str] = []
    b1, a1, a2 = _fit_compute(comp, notes, dims)
    by_group = _comm_groups(comms)
    tables = _fit_comm_tables(by_group, dims, notes)
    profile = dims.with_overrides(a1_ms=float(a1), a2_ms=float(a2), b1_ms=float(b1), **tables)
    return profile, _fit_report(profile, comp, by_group, notes)


def _fit_comm_tables(
    by_group: dict[tuple[str, int, bool], list[CommSample]], dims: Profile, notes: list[str]
) -> dict[str, dict[int, float]]:
    """The profile's bandwidth and latency tables, intra-node and ``inter_*``, each (kind, degree, spans) fitted on
    its own; a (kind, degree) measured only across nodes fills the intra table too."""
    names = ("a2a_gbps", "p2p_gbps", "a2a_latency_ms", "p2p_latency_ms")
    tables: dict[str, dict[int, float]] = {f"{where}{t}": {} for where in ("", "inter_") for t in names}
    for (kind, d, spans), group in sorted(by_group.items()):
        lat, gbps = _fit_comm_group(kind, d, group, dims, notes)
        bw_key, lat_key = _table_keys(kind, spans)
        tables[bw_key][d] = float(gbps)
        tables[lat_key][d] = float(max(0.0, lat))
        if spans and (kind, d, False) not in by_group:  # no node holds this group: the intra figure is this one
            intra_bw, intra_lat = _table_keys(kind, False)
            tables[intra_bw][d], tables[intra_lat][d] = tables[bw_key][d], tables[lat_key][d]
    return tables


def _fit_report(
    profile: Profile,
    comp: list[ComputeSample],
    by_group: dict[tuple[str, int, bool], list[CommSample]],
    notes: list[str],
) -> FitReport:
    """How well the fitted ``profile`` reproduces the compute samples and each (kind, degree, spans)'s comm samples."""
    comm_fit = {key: FitError.from_errors(prediction_errors(profile, g)) for key, g in by_group.items()}
    return FitReport(
        compute=FitError.from_errors(prediction_errors(profile, comp)),
        comm={f"{k}-{d}": e for (k, d, spans), e in comm_fit.items() if not spans},
        notes=tuple(notes),
        inter_comm={f"{k}-{d}": e for (k, d, spans), e in comm_fit.items() if spans},
    )


def _table_keys(kind: str, spans: bool) -> tuple[str, str]:
    """The profile's (bandwidth, latency) tables of ``kind`` groups inside a node, or across nodes (``spans``)."""
    prefix = ("inter_" if spans else "") + ("p2p" if kind == RING else "a2a")
    return f"{prefix}_gbps", f"{prefix}_latency_ms"


def _group_name(kind: str, d: int, spans: bool) -> str:
    return f"{kind}-{d}{' across nodes' if spans else ''}"


def _fit_compute(comp: list[ComputeSample], notes: list[str], dims: Profile) -> tuple[float, float, float]:
    """(b1, a1, a2) from the compute samples; a note when time did not grow with tokens."""
    if len(comp) < MIN_COMPUTE_SAMPLES:
        raise ProfileError(
            f"compute_samples: got {len(comp)}, need at least {MIN_COMPUTE_SAMPLES} (one per unknown b1, a1, a2; "
            "a dozen from short to long sequences, single and packed, fit much better)"
        )
    b1, a1, a2 = fit_compute_terms(comp, profile=dims)
    if a1 <= 0 and a2 <= 0:
        tokens = [sum(c.seq_lengths) for c in comp]
        notes.append(
            f"compute: time did not grow with tokens over the probes ({min(tokens)}-{max(tokens)} tokens), so the "
            "profile prices tokens at zero and the planner cannot tell a long micro-batch from a short one; "
            "calibrate with a larger tokens_per_worker or on a quieter machine"
        )
    return b1, a1, a2


def _comm_groups(comms: list[CommSample]) -> dict[tuple[str, int, bool], list[CommSample]]:
    """The comm samples by (kind, degree, spans); some Ulysses degree must have samples (the profile's a2a tables)."""
    by_group: dict[tuple[str, int, bool], list[CommSample]] = {}
    for c in comms:
        by_group.setdefault((c.kind, c.degree, c.spans), []).append(c)
    if not any(kind == ULYSSES for kind, _, _ in by_group):
        raise ProfileError(
            f"comm_samples: need at least {MIN_COMM_SAMPLES} Ulysses samples for some degree >= 2 (got degrees "
            f"{sorted({(k, d) for k, d, _ in by_group})}): the profile's a2a_gbps needs an entry"
        )
    return by_group


def _fit_comm_group(kind: str, d: int, group: list[CommSample], dims: Profile, notes: list[str]):
    """(latency ms, GB/s) of one (kind, degree, placement)'s collectives; a note when the bandwidth was clamped."""
    key = _group_name(kind, d, group[0].spans)
    if len(group) < MIN_COMM_SAMPLES or len({c.tokens_per_rank for c in group}) < 2:
        raise ProfileError(
            f"comm_samples for {key}: got {len(group)} sample(s) at {len({c.tokens_per_rank for c in group})} "
            f"message size(s), need at least {MIN_COMM_SAMPLES} at different tokens_per_rank (latency and "
            "bandwidth are two unknowns)"
        )
    nbytes = np.array([comm_bytes(c.tokens_per_rank * d, d, kind, dims) for c in group])
    lat, ms_per_byte = _relative_fit(
        np.column_stack([np.ones(len(group)), nbytes]),
        np.array([c.ms for c in group]),
        f"comm_samples for {key}",
        "time the collectives at two or more message sizes",
    )
    raw = 1e-6 / ms_per_byte if ms_per_byte > 0 else math.inf  # ms = bytes * 1e3 / (GB/s * 1e9)
    gbps = min(MAX_GBPS, max(MIN_GBPS, raw))
    if gbps != raw:
        notes.append(f"{key}: bandwidth {raw:.3g} GB/s clamped to {gbps:.3g} (byte cost not measurable here)")
    return lat, gbps


def predict_ms(profile: Profile, sample: ComputeSample | CommSample | GroupSample) -> float:
    """What the profile predicts for the sample's measured quantity."""
    if isinstance(sample, ComputeSample):
        return group_time_ms(sample.seq_lengths, 1, ULYSSES, profile)
    if isinstance(sample, GroupSample):
        return group_time_ms(sample.seq_lengths, sample.degree, sample.kind, profile, spans=sample.spans)
    if isinstance(sample, CommSample):
        d, ring, inter = sample.degree, sample.kind == RING, sample.spans
        nbytes = comm_bytes(sample.tokens_per_rank * d, d, sample.kind, profile)
        bw = profile.bandwidth_gbps(d, ring=ring, inter=inter)
        return profile.latency_ms(d, ring=ring, inter=inter) + nbytes / (bw * 1e9) * 1e3
    raise TypeError(f"not a calibration sample: {type(sample).__name__}")


def prediction_errors(profile: Profile, samples: Sequence[ComputeSample | CommSample | GroupSample]) -> list[float]:
    """Signed relative error (predicted - measured) / measured of each sample, in order."""
    return [(predict_ms(profile, s) - s.ms) / s.ms for s in samples]


def fit_group_comm(
    profile: Profile, samples: Sequence[GroupSample], kind: str, degree: int, grid: int = 241, *, spans: bool = False
) -> tuple[Profile, FitError]:
    """Refit one (kind, degree)'s latency and bandwidth so that `group_time_ms` itself matches measured groups.

    `fit_profile` fits communication as an additive term, which is exactly the Ulysses model but not the ring one
    (ring overlaps each K/V exchange with a block of attention: c + (d-1) * max(c, m)). Here the whole group time is
    the target: for every bandwidth on a log grid (1e-3 .. 1e4 GB/s) the best latency has a closed form (weighted
    least squares on relative errors, clamped at 0); the pair with the smallest error wins. ``spans``: the samples
    of groups across nodes are fitted into the ``inter_*`` tables (those inside a node, the default, into the intra
    ones); the others are ignored.
    """
    mine = [s for s in samples if s.kind == kind and s.degree == degree and s.spans == spans]
    if len(mine) < 2:
        name = _group_name(kind, degree, spans)
        raise ProfileError(f"fit_group_comm: need >= 2 group samples for {name}, got {len(mine)}")
    bw_key, lat_key = _table_keys(kind, spans)
    ms = np.array([s.ms for s in mine])
    w = 1.0 / ms**2
    best = None
    for bw in np.logspace(-3, 4, grid):
        trial = profile.with_overrides(
            **{lat_key: {**getattr(profile, lat_key), degree: 0.0}, bw_key: {**getattr(profile, bw_key), degree: bw}}
        )
        base = np.array([group_time_ms(s.seq_lengths, degree, kind, trial, spans=spans) for s in mine])
        lat = max(0.0, float(np.sum((ms - base) * w) / np.sum(w)))
        err = float(np.sum(((base + lat - ms) / ms) ** 2))
        if best is None or err < best[0]:
            best = (err, float(bw), lat)
    _, bw, lat = best
    fitted = profile.with_overrides(
        **{lat_key: {**getattr(profile, lat_key), degree: lat}, bw_key: {**getattr(profile, bw_key), degree: bw}}
    )
    return fitted, FitError.from_errors(prediction_errors(fitted, mine))


def intra_from_inter(profile: Profile, kind: str, degree: int) -> Profile:
    """``profile`` with ``kind``'s intra-node figures at ``degree`` set to its across-node ones: for a degree that no
    node holds (every group of it spans nodes), so that pricing without a topology sees what such a group costs."""
    bw_key, lat_key = _table_keys(kind, False)
    inter_bw, inter_lat = _table_keys(kind, True)
    if degree not in getattr(profile, inter_bw) or degree not in getattr(profile, inter_lat):
        raise ProfileError(f"intra_from_inter: {kind}-{degree} has no across-node figures to copy")
    return profile.with_overrides(
        **{
            bw_key: {**getattr(profile, bw_key), degree: getattr(profile, inter_bw)[degree]},
            lat_key: {**getattr(profile, lat_key), degree: getattr(profile, inter_lat)[degree]},
        }
    )
