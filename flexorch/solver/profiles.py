"""Cost-model profiles: the constants of FlexSP's time and memory model (arXiv 2412.01523, §4.1.2).

A profile describes one model on one kind of hardware. The built-in profiles carry the constants published with
FlexSP's release (A100-40GB, GPT-7B/13B/30B); a profile measured on other hardware is loaded from a JSON file
with the same field names (see `examples/profiles/`), or fitted from timings by `solver.calibration`.

The per-degree collective latency tables (`a2a_latency_ms`, `p2p_latency_ms`) are flexorch's extension of FlexSP's
model: FlexSP folds every fixed cost into one b1, but on CPU workers over gloo each collective costs ~1-2 ms
whatever its size (docs/design.md §7), so a group's fixed cost depends on its degree and attention kind.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from flexorch.solver.errors import ProfileError

__all__ = [
    "DEGREE_TABLES",
    "Profile",
    "BUILTIN_PROFILES",
    "get_profile",
    "load_profile",
    "profile_from_dict",
    "profile_names",
]

# FlexSP release, A100-40GB, NVLink inside a node of 8 and InfiniBand across nodes: all-to-all bandwidth (GB/s)
# measured per group size d; it collapses once a group spans nodes (d >= 16).
_A100_A2A_GBPS = {2: 119.54, 4: 104.07, 8: 96.5, 16: 10.33, 32: 5.94, 64: 4.87}
# The same table split by where a group lies (`Topology`, `cost_model`'s ``spans``): inside a node of 8 the rows
# d = 2..8 (NVLink); across nodes the rows d = 16..64 (InfiniBand), a spanning group of d < 16 (e.g. 4 ranks over
# two nodes after a worker was lost) taking the 16-row (the nearest larger measured degree). The intra rows stay in
# `a2a_gbps` whole, 16..64 included, so a profile priced without a topology keeps FlexSP's figures per degree.
_A100_INTER_A2A_GBPS = {16: 10.33, 32: 5.94, 64: 4.87}  # FlexSP release, rows d >= 16 of its all-to-all table
# Point-to-point (ring) bandwidth and the latency tables: FlexSP publishes neither. The built-in profiles take the
# ring's bandwidth from the all-to-all table of the same degree (`p2p_gbps` empty: the rule every profile has), across
# nodes too (`inter_p2p_gbps` empty: `inter_a2a_gbps`), and no collective latency (FlexSP folds every fixed cost
# into b1); a calibrated or hand-written profile can give all four tables (examples/profiles/my-cluster.json).
DEGREE_TABLES = (
    "a2a_gbps",
    "p2p_gbps",
    "a2a_latency_ms",
    "p2p_latency_ms",
    "inter_a2a_gbps",
    "inter_p2p_gbps",
    "inter_a2a_latency_ms",
    "inter_p2p_latency_ms",
)
"""The per-degree collective tables: bandwidths (GB/s) and latencies (ms), inside a node and across nodes."""


def _lookup(table: dict[int, float], d: int) -> float:
    """table[d]; a degree not measured takes the nearest larger measured degree, beyond the table the largest."""
    if d in table:
        return table[d]
    larger = [k for k in table if k >= d]
    return table[min(larger)] if larger else table[max(table)]


@dataclass(frozen=True, kw_only=True)
class Profile:
    """Constants of the time/memory model for one model on one hardware kind."""

    name: str
    """Identifier shown in reports."""
    a1_ms: float
    """Quadratic (causal attention) compute coefficient, ms per token^2 on one device, fwd+bwd, all layers."""
    a2_ms: float
    """Linear compute coefficient (everything but attention scores), ms per token on one device."""
    b1_ms: float
    """Fixed overhead once per SP group per micro-batch (launch, sync, optimizer share), ms."""
    act_bytes_per_token: float
    """Activation memory per token held on a device, bytes (all layers)."""
    memory_budget_bytes: float
    """Per-device memory available to the step (activations plus `model_state_bytes`), bytes."""
    model_state_bytes: float = 0.0
    """Per-device memory for parameters/gradients/optimizer that does not depend on the plan, bytes."""
    num_layers: int
    """Transformer layers L (communication volume scales with it)."""
    hidden: int
    """Hidden size h."""
    num_heads: int
    """Query heads; Ulysses at degree d needs num_heads % d == 0."""
    num_kv_heads: int
    """Key/value heads (GQA); ring attention moves only these."""
    head_size: int = 0
    """The size of one head when the model sets one other than hidden / num_heads (Qwen3, Gemma 3: ``head_dim``);
    0: hidden / num_heads (:attr:`head_dim` reads either)."""
    attention_window: int = 0
    """The sliding attention window (tokens) of the model's windowed layers; 0: every layer attends to its whole
    document. A windowed layer's attention over s tokens costs ``2 s w - w^2`` where a full one costs ``s^2``
    (``flexorch.solver.cost_model.attention_square``)."""
    window_fraction: float = 0.0
    """The share of the layers that use :attr:`attention_window` (Gemma 3: 5 of 6; Mistral: 1)."""
    a2a_gbps: dict[int, float] = field(default_factory=dict)
    """All-to-all bandwidth per device in GB/s for a group of d devices (keys: powers of two >= 2)."""
    p2p_gbps: dict[int, float] = field(default_factory=dict)
    """Point-to-point bandwidth for a ring of d devices in GB/s; defaults to `a2a_gbps` when empty."""
    bytes_per_element: int = 2
    """Activation element size on the wire (2 for bf16)."""
    a2a_latency_ms: dict[int, float] = field(default_factory=dict)
    """Fixed latency (ms) a Ulysses group of d devices pays once per micro-batch for all its all-to-alls (4 per layer
    forward + 4 backward, all layers), whatever its tokens; keys: powers of two >= 2. Empty: 0 for every d."""
    head_bytes_per_token: float = 0.0
    """The part of ``act_bytes_per_token`` the LM head and the loss hold (the fp32 log-softmax of the logits,
    ``vocab * 4`` bytes): in a pipeline only the last stage holds it, and checkpointing cannot drop it. 0: spread
    over the layers like the rest."""
    p2p_latency_ms: dict[int, float] = field(default_factory=dict)
    """Fixed latency (ms) a ring group of d devices pays once per micro-batch for all its K/V exchanges (d-1 per
    layer forward, ~d backward), whatever its tokens; defaults to `a2a_latency_ms` when empty (like `p2p_gbps`)."""
    inter_a2a_gbps: dict[int, float] = field(default_factory=dict)
    """All-to-all bandwidth per device (GB/s) of a group of d whose ranks span nodes (``solver.topology``); the
    tables above are then the figures inside one node. Empty: `a2a_gbps` (no difference between the two)."""
    inter_p2p_gbps: dict[int, float] = field(default_factory=dict)
    """Point-to-point bandwidth (GB/s) of a ring of d that spans nodes; empty: `inter_a2a_gbps` when given, else
    the intra ring figure (`p2p_gbps`, itself defaulting to `a2a_gbps`)."""
    inter_a2a_latency_ms: dict[int, float] = field(default_factory=dict)
    """`a2a_latency_ms` of a group that spans nodes; empty: `a2a_latency_ms`."""
    inter_p2p_latency_ms: dict[int, float] = field(default_factory=dict)
    """`p2p_latency_ms` of a ring that spans nodes; empty: `inter_a2a_latency_ms` when given, else the intra ring
    latency."""
    none_act_ratio: float = 0.0
    """``[sharding] activation_checkpointing = "auto"``: activation bytes per token a layer keeps without recompute
    over ``act_bytes_per_token`` (those of full recompute), measured on the workers' model
    (``flexorch.solver.recompute``); 0: every group runs the run's one recompute mode."""
    none_time_ratio: float = 1.0
    """With ``none_act_ratio``: a group's time without recompute over its time with full recompute (the time terms
    above are full recompute's), measured on the workers; 1: not measured."""
    selective_act_ratio: float = 0.0
    """With ``none_act_ratio``, on a model that can recompute only its MLPs (flexorch's decoder): activation bytes per
    token with selective recompute over ``act_bytes_per_token``; 0: selective is not a choice."""
    selective_time_ratio: float = 1.0
    """With ``selective_act_ratio``: a group's time with selective recompute over its time with full recompute."""
    step_ms: float = 0.0
    """Fixed time per step outside its micro-batches (ms): the gradient sync, the optimizer step and the dispatch a
    step pays once, whatever its plan (a record's ``measured_ms - compute_ms``). Refitted from the run's steps
    (``solver.refit``); 0 in calibrated and built-in profiles. It moves no plan's ranking, only what a step is
    predicted to take (``solver.simulator.step_time_ms``) and its bound."""
    revision: int = 0
    """Which version of the run's profile this is: 0 as calibrated or loaded, +1 for each refit the driver takes up
    or rolls back to (``control.refitting``). A plan carries the revision it was priced with
    (``PlannedStep.profile_revision``), so a record is priced, and a refit judged, on the profile that planned it."""

    def __post_init__(self) -> None:
        problems = []
        for f in ("a1_ms", "a2_ms", "b1_ms", "step_ms", "act_bytes_per_token", "memory_budget_bytes"):
            v = getattr(self, f)
            if not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
                problems.append(f"{f} must be a finite number >= 0, got {v!r}")
        if not isinstance(self.head_bytes_per_token, int | float) or not (
            0 <= self.head_bytes_per_token < self.act_bytes_per_token
        ):
            problems.append(
                f"head_bytes_per_token must be >= 0 and below act_bytes_per_token, got {self.head_bytes_per_token!r}"
            )
        if self.act_bytes_per_token <= 0:
            problems.append(f"act_bytes_per_token must be > 0, got {self.act_bytes_per_token!r}")
        r = self.none_act_ratio
        if not isinstance(r, int | float) or not math.isfinite(r) or (r != 0 and r < 1):
            problems.append(f"none_act_ratio must be 0 (unused) or >= 1 (no recompute keeps more), got {r!r}")
        for f in ("none", "selective"):
            r = getattr(self, f"{f}_act_ratio")
            if f == "selective" and (not isinstance(r, int | float) or not math.isfinite(r) or (r != 0 and r < 1)):
                problems.append(f"selective_act_ratio must be 0 (unused) or >= 1 (it keeps more than full), got {r!r}")
            r = getattr(self, f"{f}_time_ratio")
            if not isinstance(r, int | float) or not 0 < r <= 1:
                problems.append(f"{f}_time_ratio must be in (0, 1] (it recomputes less than full), got {r!r}")
        for f in ("num_layers", "hidden", "num_heads", "num_kv_heads", "bytes_per_element"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                problems.append(f"{f} must be a positive integer, got {v!r}")
        if not problems and self.num_heads % self.num_kv_heads:
            problems.append(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
        w, f = self.attention_window, self.window_fraction
        if isinstance(w, bool) or not isinstance(w, int) or w < 0:
            problems.append(f"attention_window must be an integer >= 0 (0: no window), got {w!r}")
        elif isinstance(f, bool) or not isinstance(f, int | float) or not 0 <= f <= 1 or (f > 0) != (w > 0):
            problems.append(f"window_fraction must be in (0, 1] with an attention_window, 0 without, got {f!r}")
        if isinstance(self.head_size, bool) or not isinstance(self.head_size, int) or self.head_size < 0:
            problems.append(f"head_size must be an integer >= 0 (0: hidden / num_heads), got {self.head_size!r}")
        elif not problems and not self.head_size and self.hidden % self.num_heads:
            problems.append(f"hidden={self.hidden} must be a multiple of num_heads={self.num_heads}")
        if self.memory_budget_bytes <= self.model_state_bytes:
            problems.append(
                f"memory_budget_bytes={self.memory_budget_bytes:.3g} leaves nothing for activations after "
                f"model_state_bytes={self.model_state_bytes:.3g}"
            )
        for table in DEGREE_TABLES:
            values = getattr(self, table)
            if not isinstance(values, dict):
                problems.append(f"{table} must be a mapping {{group size: value}}, got {type(values).__name__}")
                continue
            for d, v in values.items():
                if not isinstance(d, int) or isinstance(d, bool) or d < 2 or d & (d - 1):
                    problems.append(f"{table} keys must be powers of two >= 2, got {d!r}")
                elif table.endswith("_gbps") and (not isinstance(v, int | float) or not v > 0):
                    problems.append(f"{table}[{d}] must be a bandwidth > 0 GB/s, got {v!r}")
                elif table.endswith("_ms") and (not isinstance(v, int | float) or not math.isfinite(v) or v < 0):
                    problems.append(f"{table}[{d}] must be a latency >= 0 ms, got {v!r}")
        if not self.a2a_gbps:
            problems.append("a2a_gbps needs at least one entry (GB/s per group size d)")
        if problems:
            raise ProfileError(f"profile {self.name!r} is invalid: " + "; ".join(problems))

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden // self.num_heads

    @property
    def q_dim(self) -> int:
        """Width of a token's queries (and of the attention's output before its projection): heads x head size."""
        return self.num_heads * self.head_dim

    @property
    def tokens_per_device(self) -> int:
        """Tokens of activations one device holds within its budget (the unit of SP memory): the most a device of
        any group holds (one device, or a ring group); a Ulysses group of degree d > 1 holds
        ``local_token_cap("ulysses", d)`` per device, a little less."""
        return int((self.memory_budget_bytes - self.model_state_bytes) // self.act_bytes_per_token)

    def ulysses_extra_bytes_per_token(self, degree: int) -> float:
        """Bytes a device of a Ulysses group of ``degree`` holds per local token beyond ``act_bytes_per_token``
        (measured on one device), in every layer: the attention output in head shards ``(s, h/d, hd)`` is saved
        by the attention kernel and its all-to-all back ``(s/d, h, hd)`` by the output projection, two storages
        where one device has one (``h * hd`` elements, ``hidden`` unless the model sets its head size); and K/V heads
        replicated to ``lcm(kv_heads, d)`` when d does not divide them hold ``lcm(kv_heads, d) - kv_heads`` more heads
        each
        (``flexorch/workers/attention/ulysses.py``). ``tests/integration/test_activation_plan.py`` checks it against
        the bytes a worker of each layout holds."""
        if degree <= 1:
            return 0.0
        replicated = math.lcm(self.num_kv_heads, degree) - self.num_kv_heads
        per_layer = self.q_dim + 2 * replicated * self.head_dim
        return float(self.num_layers * per_layer * self.bytes_per_element)

    def act_bytes_per_local_token(self, kind: str, degree: int) -> float:
        """Activation bytes a device of a group of ``kind`` (``"ulysses"``/``"ring"``) and ``degree`` holds per token
        of its shard (FlexSP's memory term ``s / d * act_per_token``, with Ulysses's all-to-all copies)."""
        extra = self.ulysses_extra_bytes_per_token(degree) if kind == "ulysses" else 0.0
        return self.act_bytes_per_token + extra

    def local_token_cap(self, kind: str, degree: int) -> int:
        """Tokens one device of a ``kind`` group of ``degree`` holds within its budget."""
        room = self.memory_budget_bytes - self.model_state_bytes
        return int(room // self.act_bytes_per_local_token(kind, degree))

    def group_token_cap(self, kind: str, degree: int) -> int:
        """Tokens a ``kind`` group of ``degree`` devices holds in one micro-batch: ``degree * local_token_cap``."""
        return degree * self.local_token_cap(kind, degree)

    def bandwidth_gbps(self, d: int, *, ring: bool = False, inter: bool = False) -> float:
        """Bandwidth for a group of d devices; sizes not measured use the nearest larger (beyond: largest) size.
        ``inter``: of a group that spans nodes (the ``inter_*`` tables; a profile without them: the same figure)."""
        table = (self.p2p_gbps or self.a2a_gbps) if ring else self.a2a_gbps
        if inter:
            a2a = self.inter_a2a_gbps or self.a2a_gbps
            table = (self.inter_p2p_gbps or self.inter_a2a_gbps or table) if ring else a2a
        return _lookup(table, d)

    def latency_ms(self, d: int, *, ring: bool = False, inter: bool = False) -> float:
        """Collective latency per micro-batch of a group of d devices (0 for d == 1 or empty tables).

        A degree not measured takes the nearest larger measured degree (latency grows with d, so this errs on the
        slow side), beyond the table the largest measured one, as for the bandwidth tables. ``inter``: of a group
        that spans nodes (the ``inter_*`` tables, each defaulting as the bandwidth tables do).
        """
        table = (self.p2p_latency_ms or self.a2a_latency_ms) if ring else self.a2a_latency_ms
        if inter:
            a2a = self.inter_a2a_latency_ms or self.a2a_latency_ms
            table = (self.inter_p2p_latency_ms or self.inter_a2a_latency_ms or table) if ring else a2a
        if d <= 1 or not table:
            return 0.0
        return _lookup(table, d)

    @property
    def has_inter_tables(self) -> bool:
        """Whether the profile prices a group that spans nodes differently from one inside a node."""
        return any(getattr(self, t) for t in DEGREE_TABLES if t.startswith("inter_"))

    def to_json(self) -> str:
        data = asdict(self)
        for table in DEGREE_TABLES:
            data[table] = {str(k): v for k, v in sorted(getattr(self, table).items())}
        return json.dumps(data, indent=2)

    def mode_time_ratios(self) -> dict[str, float]:
        """A group's time in each recompute mode ('full', 'none', 'selective') over its time with full recompute
        (``flexorch.solver.recompute``)."""
        return {"full": 1.0, "none": self.none_time_ratio, "selective": self.selective_time_ratio}

    def with_overrides(self, **changes) -> Profile:
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data.update(changes)
        return Profile(**data)


def _flexsp_a100(
    name: str, a1_ms: float, a2_ms: float, b1_ms: float, act_bytes: float, layers: int, hidden: int, heads: int
) -> Profile:
    """A FlexSP release profile (docs/design.md §2.1): multi-head attention on A100s. FlexSP's 28 GB budget (of 40 GB)
    is the activation budget: model states are sharded (ZeRO-3) into the rest, so model_state_bytes is 0."""
    return Profile(
        name=name,
        a1_ms=a1_ms,
        a2_ms=a2_ms,
        b1_ms=b1_ms,
        act_bytes_per_token=act_bytes,
        memory_budget_bytes=28e9,
        num_layers=layers,
        hidden=hidden,
        num_heads=heads,
        num_kv_heads=heads,
        a2a_gbps=_A100_A2A_GBPS,
        inter_a2a_gbps=_A100_INTER_A2A_GBPS,
    )


BUILTIN_PROFILES: dict[str, Profile] = {
    p.name: p
    for p in (
        # FlexSP release constants: name, a1, a2, b1, activation bytes per token, layers, hidden, heads.
        _flexsp_a100("gpt-7b-a100", 5.128e-6, 0.18396, 629.36, 4.48e6, 32, 4096, 32),
        _flexsp_a100("gpt-13b-a100", 9.2852e-6, 0.30602, 1132.56, 4.22e6, 40, 5120, 40),
        _flexsp_a100("gpt-30b-a100", 15.4262e-6, 0.80357, 2789.36, 3.42e6, 60, 6656, 52),
    )
}


def profile_names() -> list[str]:
    return sorted(BUILTIN_PROFILES)


def get_profile(name_or_path: str | Path) -> Profile:
    """A built-in profile by name, or a profile JSON file by path."""
    key = str(name_or_path)
    if key in BUILTIN_PROFILES:
        return BUILTIN_PROFILES[key]
    path = Path(key)
    if path.suffix == ".json" or path.exists():
        return load_profile(path)
    raise ProfileError(
        f"unknown profile {key!r}: use one of {', '.join(profile_names())} or the path of a profile JSON file"
    )


def load_profile(path: str | Path) -> Profile:
    """Load a profile from JSON (the fields of `Profile`; bandwidth and latency tables keyed by group size)."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ProfileError(f"profile file {path} does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ProfileError(f"profile file {path} is not valid JSON: {e}") from None
    return profile_from_dict(raw, f"profile file {path}", path.stem)


def profile_from_dict(raw, where: str = "profile", name: str = "profile") -> Profile:
    """A profile from the JSON object ``Profile.to_json`` writes (``where`` names it in errors)."""
    if not isinstance(raw, dict):
        raise ProfileError(f"{where} must hold a JSON object, got {type(raw).__name__}")
    raw = dict(raw)
    known = {f.name for f in fields(Profile)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ProfileError(f"{where} has unknown fields {unknown}; known fields: {sorted(known)}")
    raw.setdefault("name", name)
    for table in DEGREE_TABLES:
        if table in raw:
            if not isinstance(raw[table], dict):
                unit = "GB/s" if table.endswith("_gbps") else "ms"
                raise ProfileError(f"{where}: {table} must be an object {{group size: {unit}}}")
            try:
                raw[table] = {int(k): v for k, v in raw[table].items()}
            except ValueError:
                raise ProfileError(f"{where}: {table} keys must be integers") from None
    try:
        return Profile(**raw)
    except TypeError as e:
        raise ProfileError(f"{where} is missing fields: {e}") from None
