"""Time and memory of pipeline units on pipeline stages (the FlexSP cost model of docs/design.md §2.1, per stage).

The model's L layers are split over P stages as evenly as possible (the first ``L % P`` stages get one more). A
stage is a group of ``degree`` workers that shares each unit's tokens (sequence parallel inside the stage). For a
unit of work ``w = sum a1*(end^2 - start^2) + a2*(end - start)`` over its pieces, on stage r with l_r layers:

* forward:   (w / degree + a2a(tokens, degree) + b1 + latency(degree)) * l_r / L / 3   (the profile's constants
  are forward + backward, backward ~ 2x; a2a is the cost model's Ulysses all-to-all time inside the stage, b1 +
  latency its per-group overhead, both 0 extra for degree 1 but b1)
* backward:  2 * forward + recompute: the forward time of the checkpointed layers
* held activations: ``(tokens / degree * (act_per_token / L) + prefix K/V) * (l_r - c) + tokens * keep * c`` (with
  Ulysses's all-to-all copies in ``act_per_token`` when degree > 1: ``Profile.ulysses_extra_bytes_per_token``) for
  c checkpointed layers, where the prefix K/V is what a segment's attention saves of its sequence's earlier tokens
  (``prefix x 2 x kv_heads x head_dim x bytes / degree`` per layer) and ``keep`` is what a checkpointed layer still
  holds per token (its input, its K/V kept by the prefix cache, RoPE's cos/sin: ``(hidden + 2 kv_heads head_dim +
  head_dim) * bytes_per_element / degree``); the last stage also holds ``tokens / degree * head_bytes_per_token``
  (the LM head's log-softmax, which checkpointing does not drop), taken out of the per-layer share;
* one send between stages: tokens * hidden * bytes_per_element / p2p bandwidth.

The per-stage budget is the profile's ``memory_budget_bytes`` less the stage's share of ``model_state_bytes``.
"""

from __future__ import annotations

from dataclasses import dataclass

from flexorch.solver.cost_model import ULYSSES, comm_bytes, group_overhead_ms
from flexorch.solver.pipeline.chunking import Unit
from flexorch.solver.profiles import Profile

__all__ = ["RECOMPUTE", "stage_layers", "StageModel"]

RECOMPUTE = ("auto", "none", "full")
"""What pipeline stages recompute (``StageModel.recompute``)."""


def stage_layers(num_layers: int, stages: int) -> list[int]:
    """Layers per stage, as even as possible; more stages than layers is an error."""
    if stages < 1:
        raise ValueError(f"pipeline_stages must be >= 1, got {stages}")
    if stages > num_layers:
        raise ValueError(
            f"{stages} pipeline stages for a model of {num_layers} layers: every stage needs at least one layer; "
            f"use at most {num_layers} stages"
        )
    base, extra = divmod(num_layers, stages)
    return [base + (1 if r < extra else 0) for r in range(stages)]


@dataclass(frozen=True)
class StageModel:
    profile: Profile
    stages: int
    degree: int = 1
    """Workers per stage (SP inside a stage)."""
    recompute: str = "auto"
    """``[sharding] activation_checkpointing`` with stages: 'auto', the layers to checkpoint chosen per stage and unit
    (``flexorch.solver.pipeline.checkpointing``); 'none', no layer; 'full', every layer."""

    def __post_init__(self) -> None:
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"pipeline recompute {self.recompute!r}: expected one of {RECOMPUTE}")

    def most_checkpointed(self, units: int) -> list[list[int]]:
        """The most layers ``[stage][unit]`` :attr:`recompute` lets ``units`` units checkpoint: none under 'none';
        every layer under 'full'; under 'auto' the fewest layers of any stage, on every stage (the ILP's bound: its
        choices are shared along the schedule's diagonals, across stages)."""
        if self.recompute == "auto":
            return [[min(self.layers)] * units for _ in range(self.stages)]
        return [[self.layers[r] if self.recompute == "full" else 0] * units for r in range(self.stages)]

    @property
    def layers(self) -> list[int]:
        return stage_layers(self.profile.num_layers, self.stages)

    def _share(self, r: int) -> float:
        return self.layers[r] / self.profile.num_layers

    def fwd_ms(self, u: Unit, r: int) -> float:
        return (u.work / self.degree + self.sp_comm_ms(u) + group_overhead_ms(self.degree, ULYSSES, self.profile)) * (
            self._share(r) / 3.0
        )

    def sp_comm_ms(self, u: Unit) -> float:
        """Ulysses all-to-all time of the unit's tokens inside a stage of ``degree`` workers (all layers, fwd+bwd)."""
        if self.degree == 1:
            return 0.0
        return comm_bytes(u.tokens, self.degree, ULYSSES, self.profile) / (
            self.profile.bandwidth_gbps(self.degree) * 1e6
        )

    def bwd_ms(self, u: Unit, r: int, checkpointed: int = 0) -> float:
        recompute = self.fwd_ms(u, r) * checkpointed / self.layers[r]
        return 2.0 * self.fwd_ms(u, r) + recompute

    def act_per_layer(self) -> float:
        """Bytes per token per layer a stage holds for backward (on one of its workers), with Ulysses's all-to-all
        copies when the stage is SP-parallel (``Profile.ulysses_extra_bytes_per_token``)."""
        p = self.profile
        per_token = p.act_bytes_per_token - p.head_bytes_per_token + p.ulysses_extra_bytes_per_token(self.degree)
        return per_token / p.num_layers / self.degree

    def head_bytes(self, r: int) -> float:
        """Bytes per token the LM head and loss hold on stage r (the last stage only; not checkpointed)."""
        return self.profile.head_bytes_per_token / self.degree if r == self.stages - 1 else 0.0

    def keep_per_layer(self) -> float:
        """Bytes per token per layer a checkpointed layer still holds: its input (hidden), its K and V (the prefix
        cache keeps them for the sequence's later segments: 2 x kv heads x head dim) and RoPE's cos/sin (head dim)."""
        p = self.profile
        per_token = p.hidden + 2 * p.num_kv_heads * p.head_dim + p.head_dim
        return min(per_token * p.bytes_per_element / self.degree, self.act_per_layer())

    def prefix_kv_bytes(self, u: Unit) -> float:
        """Bytes per layer a unit keeps for its pieces' K/V prefix (a segment's attention saves the concatenated
        K and V of its sequence's earlier tokens for backward): prefix tokens x 2 x kv heads x head dim."""
        p = self.profile
        prefix = sum(piece.start for piece in u.pieces)
        return prefix * 2 * p.num_kv_heads * p.head_dim * p.bytes_per_element / self.degree

    def layer_bytes(self, u: Unit) -> float:
        """What one layer run without checkpointing holds for unit u."""
        return u.tokens * self.act_per_layer() + self.prefix_kv_bytes(u)

    def keep_bytes(self, u: Unit) -> float:
        """What one checkpointed layer holds for unit u (its input)."""
        return u.tokens * self.keep_per_layer()

    def act_bytes(self, u: Unit, r: int, checkpointed: int = 0) -> float:
        c = checkpointed
        return self.layer_bytes(u) * (self.layers[r] - c) + self.keep_bytes(u) * c + u.tokens * self.head_bytes(r)

    def budget_bytes(self, r: int) -> float:
        p = self.profile
        return p.memory_budget_bytes - p.model_state_bytes * self._share(r)

    def send_ms(self, u: Unit) -> float:
        p = self.profile
        bw = (p.p2p_gbps or p.a2a_gbps or {2: 100.0}).get(2, 100.0)
        return u.tokens * p.hidden * p.bytes_per_element / (bw * 1e6)

    def token_cap(self) -> int:
        """Most tokens one unit may hold on every stage with no checkpointing (the chunker's memory cap)."""
        return int(
            min(
                self.budget_bytes(r) / (self.act_per_layer() * self.layers[r] + self.head_bytes(r))
                for r in range(self.stages)
            )
        )
