"""Run a planned pipeline step with every stage in this process (the stages' math, no transport).

The ops of all stages run in one global order that respects every dependency: the simulator's start times
(``flexorch.solver.pipeline.sim``), where an op starts only after what it needs has ended. Activations and their
gradients pass between stages as tensors in a dict (the distributed executor sends the same tensors point to point).
Used by the invariant tests (pipelined == single-process reference) and as the reference of the distributed executor.
"""

from __future__ import annotations

import torch

from flexorch.config.model import ModelConfig
from flexorch.solver.pipeline.sim import simulate
from flexorch.workers.pipeline.stage import StageModule, UnitInput

__all__ = ["build_stages", "run_local_step", "stage_grads_as_full"]


def build_stages(model, layers_per_stage: list[int]) -> list[StageModule]:
    """Stage modules holding copies of ``model``'s parameters, layers split as ``layers_per_stage``."""
    cfg: ModelConfig = model.cfg
    if sum(layers_per_stage) != cfg.num_layers:
        raise ValueError(f"stages hold {sum(layers_per_stage)} layers, the model has {cfg.num_layers}")
    out, first = [], 0
    for r, n in enumerate(layers_per_stage):
        out.append(StageModule(cfg, first, first + n, r, len(layers_per_stage)).load_from(model))
        first += n
    return out


def _order(schedule):
    run = simulate(
        [list(ops) for ops in schedule],
        [[1.0] * (len(schedule[0]) // 2)] * len(schedule),
        [[2.0] * (len(schedule[0]) // 2)] * len(schedule),
        [[0.0] * (len(schedule[0]) // 2)] * len(schedule),
    )
    return sorted(run.timings, key=lambda t: (t.start_ms, t.end_ms, t.stage))


def run_local_step(stages: list[StageModule], pipelines, sequences: list[torch.Tensor]) -> float:
    """Forward and backward of one step; ``pipelines``: (units, schedule, checkpointed[stage][unit]) run one after
    another. Gradients accumulate in the stages' parameters; returns the step's mean loss per predicted token."""
    n_pred = sum(int(s.numel()) - 1 for s in sequences)
    last = len(stages) - 1
    loss = 0.0
    for units, schedule, ckpt in pipelines:
        inputs = [UnitInput(u.pieces, sequences) for u in units]
        acts: dict[tuple[int, int], torch.Tensor] = {}
        grads: dict[tuple[int, int], torch.Tensor] = {}
        for t in _order(schedule):
            r, u = t.stage, t.op.unit
            if t.op.kind == "F":
                x = acts.pop((r - 1, u)) if r > 0 else None
                out = stages[r].forward_unit(u, inputs[u], x, n_pred, ckpt[r][u])
                if r == last:
                    loss += float(out)
                else:
                    acts[(r, u)] = out
            else:
                g = grads.pop((r + 1, u)) if r < last else None
                g_in = stages[r].backward_unit(u, g)
                if r > 0:
                    grads[(r, u)] = g_in
        for s in stages:
            s.end_step()
    return loss


def stage_grads_as_full(stages: list[StageModule]) -> dict[str, torch.Tensor]:
    """Every parameter's gradient under the full model's name; a tied embedding's copies are summed."""
    out: dict[str, torch.Tensor] = {}
    for s in stages:
        for name, p in s.named_parameters():
            full = s.full_name(name)
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            out[full] = out[full] + g if full in out else g.clone()
    return out
