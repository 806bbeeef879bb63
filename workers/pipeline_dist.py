"""One stage's part of a pipelined step across processes: activations and gradients sent point to point.

Every stage process runs its own op list of the planned schedule (``solver.pipeline_schedule``), in order:

* ``F u``: stage r > 0 receives unit u's hidden states ``(tokens_u, dim)`` from stage r-1 (the shape comes from the
  plan, so no shape message is sent), runs the unit forward and sends its output to stage r+1 (non-blocking);
* ``B u``: stage r < P-1 receives the gradient of that output ``(tokens_u, dim)`` from stage r+1, runs the unit
  backward and sends its input's gradient to stage r-1 (non-blocking).

Messages carry the tag ``2 * unit + (0 forward, 1 backward)`` (units numbered across the step's back-to-back
pipelines), so shapes that change per unit never get mixed up. Sends are asynchronous and receives block, which is
what ``solver.pipeline_sim`` assumes when it checks the schedule for deadlocks: a schedule that simulates cannot
deadlock here. With tied embeddings the first and last stage all-reduce their two copies' gradients at the end.
Works over gloo (CPU) and NCCL (GPU) alike.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from workers.pipeline_stage import StageModule, UnitInput

__all__ = ["run_stage_step"]


def run_stage_step(
    stage: StageModule,
    stage_index: int,
    stage_ranks: list[int],
    pipelines,
    sequences: list[torch.Tensor],
    *,
    group: dist.ProcessGroup | None = None,
    tie_group: dist.ProcessGroup | None = None,
) -> float | None:
    """Run this stage's ops of one step; returns the step's loss on the last stage, None elsewhere.

    ``pipelines``: (units, schedule, checkpointed[stage][unit]) run one after another; ``stage_ranks[r]``: the
    rank (in ``group``) of stage r's process."""
    r, p = stage_index, len(stage_ranks)
    n_pred = sum(int(s.numel()) - 1 for s in sequences)
    dim = stage.cfg.dim
    loss = 0.0
    base = 0
    for units, schedule, ckpt in pipelines:
        inputs = [UnitInput(u.pieces, sequences) for u in units]
        sends = []
        for op in schedule[r]:
            u, tokens, tag = op.unit, units[op.unit].tokens, 2 * (base + op.unit)
            if op.kind == "F":
                x = None
                if r > 0:
                    x = torch.empty(tokens, dim)  # (t, dim) hidden states of unit u from stage r-1
                    dist.recv(x, src=stage_ranks[r - 1], group=group, tag=tag)
                out = stage.forward_unit(u, inputs[u], x, n_pred, ckpt[r][u])
                if r < p - 1:
                    sends.append(dist.isend(out.contiguous(), dst=stage_ranks[r + 1], group=group, tag=tag))
                else:
                    loss += float(out)
            else:
                g = None
                if r < p - 1:
                    g = torch.empty(tokens, dim)  # (t, dim) gradient of unit u's output from stage r+1
                    dist.recv(g, src=stage_ranks[r + 1], group=group, tag=tag + 1)
                g_in = stage.backward_unit(u, g)
                if r > 0:
                    sends.append(dist.isend(g_in.contiguous(), dst=stage_ranks[r - 1], group=group, tag=tag + 1))
        for w in sends:
            w.wait()
        stage.end_step()
        base += len(units)
    if stage.cfg.tie_embeddings and p > 1 and (stage.is_first or stage.is_last):
        w = stage.tok_embeddings.weight if stage.is_first else stage.head_weight
        if w.grad is None:
            w.grad = torch.zeros_like(w)
        dist.all_reduce(w.grad, group=tie_group)
    return loss if r == p - 1 else None
