"""Cost-model profiles: the constants of FlexSP's time and memory model (arXiv 2412.01523, §4.1.2).

A profile describes one model on one kind of hardware. The built-in profiles carry the constants published with
FlexSP's release (A100-40GB, GPT-7B/13B/30B); a profile measured on other hardware is loaded from a JSON file
with the same field names (see `examples/profiles/`).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from solver.errors import ProfileError

__all__ = ["Profile", "BUILTIN_PROFILES", "get_profile", "load_profile", "profile_names"]

# FlexSP release, A100-40GB, NVLink inside a node of 8 and InfiniBand across nodes: all-to-all bandwidth (GB/s)
# measured per group size d; it collapses once a group spans nodes (d >= 16).
_A100_A2A_GBPS = {2: 119.54, 4: 104.07, 8: 96.5, 16: 10.33, 32: 5.94, 64: 4.87}


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
    a2a_gbps: dict[int, float] = field(default_factory=dict)
    """All-to-all bandwidth per device in GB/s for a group of d devices (keys: powers of two >= 2)."""
    p2p_gbps: dict[int, float] = field(default_factory=dict)
    """Point-to-point bandwidth for a ring of d devices in GB/s; defaults to `a2a_gbps` when empty."""
    bytes_per_element: int = 2
    """Activation element size on the wire (2 for bf16)."""

    def __post_init__(self) -> None:
        problems = []
        for f in ("a1_ms", "a2_ms", "b1_ms", "act_bytes_per_token", "memory_budget_bytes"):
            v = getattr(self, f)
            if not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
                problems.append(f"{f} must be a finite number >= 0, got {v!r}")
        if self.act_bytes_per_token <= 0:
            problems.append(f"act_bytes_per_token must be > 0, got {self.act_bytes_per_token!r}")
        for f in ("num_layers", "hidden", "num_heads", "num_kv_heads", "bytes_per_element"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                problems.append(f"{f} must be a positive integer, got {v!r}")
        if not problems and self.num_heads % self.num_kv_heads:
            problems.append(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
        if not problems and self.hidden % self.num_heads:
            problems.append(f"hidden={self.hidden} must be a multiple of num_heads={self.num_heads}")
        if self.memory_budget_bytes <= self.model_state_bytes:
            problems.append(
                f"memory_budget_bytes={self.memory_budget_bytes:.3g} leaves nothing for activations after "
                f"model_state_bytes={self.model_state_bytes:.3g}"
            )
        for table in ("a2a_gbps", "p2p_gbps"):
            for d, bw in getattr(self, table).items():
                if not isinstance(d, int) or d < 2 or d & (d - 1):
                    problems.append(f"{table} keys must be powers of two >= 2, got {d!r}")
                elif not isinstance(bw, int | float) or not bw > 0:
                    problems.append(f"{table}[{d}] must be a bandwidth > 0 GB/s, got {bw!r}")
        if not self.a2a_gbps:
            problems.append("a2a_gbps needs at least one entry (GB/s per group size d)")
        if problems:
            raise ProfileError(f"profile {self.name!r} is invalid: " + "; ".join(problems))

    @property
    def head_dim(self) -> int:
        return self.hidden // self.num_heads

    @property
    def tokens_per_device(self) -> int:
        """Tokens of activations one device holds within its budget (the unit of SP memory)."""
        return int((self.memory_budget_bytes - self.model_state_bytes) // self.act_bytes_per_token)

    def bandwidth_gbps(self, d: int, *, ring: bool = False) -> float:
        """Bandwidth for a group of d devices; sizes beyond the table use the largest measured size."""
        table = (self.p2p_gbps or self.a2a_gbps) if ring else self.a2a_gbps
        if d in table:
            return table[d]
        known = sorted(table)
        larger = [k for k in known if k >= d]
        return table[larger[0]] if larger else table[known[-1]]

    def to_json(self) -> str:
        data = asdict(self)
        data["a2a_gbps"] = {str(k): v for k, v in self.a2a_gbps.items()}
        data["p2p_gbps"] = {str(k): v for k, v in self.p2p_gbps.items()}
        return json.dumps(data, indent=2)

    def with_overrides(self, **changes) -> Profile:
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data.update(changes)
        return Profile(**data)


BUILTIN_PROFILES: dict[str, Profile] = {
    p.name: p
    for p in (
        # FlexSP release constants (DESIGN.md §2.1). FlexSP's 28 GB budget (of 40 GB) is the activation budget:
        # model states are sharded (ZeRO-3) into the rest, so model_state_bytes is 0 here.
        Profile(
            name="gpt-7b-a100",
            a1_ms=5.128e-6,
            a2_ms=0.18396,
            b1_ms=629.36,
            act_bytes_per_token=4.48e6,
            memory_budget_bytes=28e9,
            num_layers=32,
            hidden=4096,
            num_heads=32,
            num_kv_heads=32,
            a2a_gbps=_A100_A2A_GBPS,
        ),
        Profile(
            name="gpt-13b-a100",
            a1_ms=9.2852e-6,
            a2_ms=0.30602,
            b1_ms=1132.56,
            act_bytes_per_token=4.22e6,
            memory_budget_bytes=28e9,
            num_layers=40,
            hidden=5120,
            num_heads=40,
            num_kv_heads=40,
            a2a_gbps=_A100_A2A_GBPS,
        ),
        Profile(
            name="gpt-30b-a100",
            a1_ms=15.4262e-6,
            a2_ms=0.80357,
            b1_ms=2789.36,
            act_bytes_per_token=3.42e6,
            memory_budget_bytes=28e9,
            num_layers=60,
            hidden=6656,
            num_heads=52,
            num_kv_heads=52,
            a2a_gbps=_A100_A2A_GBPS,
        ),
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
    """Load a profile from JSON (the fields of `Profile`; bandwidth tables keyed by group size)."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ProfileError(f"profile file {path} does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ProfileError(f"profile file {path} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ProfileError(f"profile file {path} must hold a JSON object, got {type(raw).__name__}")
    known = {f.name for f in fields(Profile)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ProfileError(f"profile file {path} has unknown fields {unknown}; known fields: {sorted(known)}")
    raw.setdefault("name", path.stem)
    for table in ("a2a_gbps", "p2p_gbps"):
        if table in raw:
            if not isinstance(raw[table], dict):
                raise ProfileError(f"profile file {path}: {table} must be an object {{group size: GB/s}}")
            try:
                raw[table] = {int(k): v for k, v in raw[table].items()}
            except ValueError:
                raise ProfileError(f"profile file {path}: {table} keys must be integers") from None
    try:
        return Profile(**raw)
    except TypeError as e:
        raise ProfileError(f"profile file {path} is missing fields: {e}") from None
