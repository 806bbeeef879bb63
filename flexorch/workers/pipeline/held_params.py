"""The parameters (and their AdamW state) one worker holds, by model part (``flexorch.work.placement``).

A worker starts with the whole model. A pipelined step with ``[pipeline] params = "stage"`` keeps only the parts its
stage runs: the others are *released* (their storage replaced by an empty tensor, gradient and optimizer state
dropped), so a worker's memory for parameters, gradients and the two Adam moments is its stage's share. Parts a
worker needs and does not hold are copied in from a holder through the object store (:meth:`HeldParams.export`,
:meth:`HeldParams.load`): the tensor and its optimizer state, so the copy continues training bitwise like the
original. The parameter objects stay the same (their ``.data`` is swapped), so the optimizer and modules that
share them (``flexorch.workers.pipeline.stage.StageModule``) keep working.
"""

from __future__ import annotations

import torch

from flexorch.work.placement import ALL, part_of

__all__ = ["HeldParams"]


class HeldParams:
    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self.params = dict(model.named_parameters())
        self.shapes = {n: tuple(p.shape) for n, p in self.params.items()}
        self.part = {n: part_of(n) for n in self.params}
        self.parts = tuple(dict.fromkeys(self.part.values()))
        self.held: frozenset[str] | None = ALL
        """Parts held now; ``ALL`` (None): the whole model."""

    def holds(self, part: str) -> bool:
        return self.held is ALL or part in self.held

    def held_names(self) -> list[str]:
        return [n for n in self.params if self.holds(self.part[n])]

    def release(self, keep: frozenset[str]) -> None:
        """Drop every part not in ``keep`` (storage, gradient, optimizer state)."""
        for name, p in self.params.items():
            if self.part[name] not in keep and self.holds(self.part[name]):
                p.data = p.data.new_empty(0)
                p.grad = None
                self.optimizer.state.pop(p, None)
        self.held = frozenset(keep) if self.held is ALL else frozenset(self.held & set(keep))

    def require(self, parts: frozenset[str], who: str) -> None:
        """Raise if a part the step needs is not here (the driver copies parts in before the step)."""
        missing = sorted(p for p in parts if not self.holds(p))
        if missing:
            raise RuntimeError(f"{who} holds no copy of {missing}: the parameters were not moved here before the step")

    def export(self, parts) -> dict[str, dict]:
        """``{name: {"data": tensor, "state": optimizer state}}`` of ``parts`` (CPU copies)."""
        self.require(frozenset(parts), "the source worker")
        out = {}
        for name, p in self.params.items():
            if self.part[name] in parts:
                state = {k: _cpu(v) for k, v in self.optimizer.state.get(p, {}).items()}
                out[name] = {"data": _cpu(p.data), "state": state}
        return out

    def load(self, exported: dict[str, dict]) -> None:
        """Hold the parts in ``exported`` (from :meth:`export`), replacing any copy here."""
        for name, item in exported.items():
            p = self.params[name]
            data = item["data"].to(p.device)
            if tuple(data.shape) != self.shapes[name]:
                raise ValueError(f"{name}: got shape {tuple(data.shape)}, the model has {self.shapes[name]}")
            p.data = data
            p.grad = None
            self.optimizer.state.pop(p, None)
            if item["state"]:
                self.optimizer.state[p] = {k: v.to(p.device) for k, v in item["state"].items()}
        if self.held is not ALL:
            self.held = self.held | {self.part[n] for n in exported}
            if set(self.parts) <= self.held:
                self.held = ALL

    def set_from(self, model_state: dict[str, torch.Tensor]) -> None:
        """Hold exactly the parameters in ``model_state`` (a full or partial state dict); release the rest."""
        parts = {self.part[n] for n in model_state}
        for name, p in self.params.items():
            if name in model_state:
                t = model_state[name]
                if tuple(t.shape) != self.shapes[name]:
                    raise ValueError(f"{name}: the state has shape {tuple(t.shape)}, the model {self.shapes[name]}")
                p.data = t.detach().clone().to(p.device)
            elif self.part[name] in parts:
                raise ValueError(f"the state holds part {self.part[name]} without its parameter {name}")
            else:
                p.data = p.data.new_empty(0)
            p.grad = None
        self.held = ALL if set(self.parts) <= parts else frozenset(parts)

    def nbytes(self) -> int:
        """Bytes of the parameters, their gradients and optimizer state held now."""
        total = 0
        for p in self.params.values():
            total += p.data.numel() * p.data.element_size()
            if p.grad is not None:
                total += p.grad.numel() * p.grad.element_size()
            for v in self.optimizer.state.get(p, {}).values():
                if isinstance(v, torch.Tensor):
                    total += v.numel() * v.element_size()
        return total


def _cpu(t):
    return t.detach().cpu().clone() if isinstance(t, torch.Tensor) else t
