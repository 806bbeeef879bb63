"""Pipelined steps across real processes (gloo point-to-point): loss and gradients equal the single-process reference.

Each stage is its own process; activations and gradients of units whose shapes change per unit travel by
``dist.isend``/``dist.recv``. 2 and 4 stages, Seq1F1B segments with their K/V prefix cache, checkpointing, a tied
embedding, back-to-back pipelines.
"""

from __future__ import annotations

import pytest
import torch

from solver.pipeline_schedule import one_f_one_b
from solver.stage_model import stage_layers
from tests._dist_utils import DistPool
from tests.test_pipeline_local import LENGTHS, _reference, _sequences, _units
from workers.model import ModelConfig, init_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pool():
    p = DistPool(4)
    yield p
    p.close()


def _job(ctx, stages, cfg_kwargs, kind, ckpt, split):
    from workers.pipeline_dist import run_stage_step
    from workers.pipeline_local import build_stages

    torch.manual_seed(0)
    cfg = ModelConfig(**cfg_kwargs)
    seqs = _sequences(cfg)
    units = _units(kind, LENGTHS)
    parts = [units]
    if split:
        half = next(i for i in range(len(units) // 2, len(units)) if units[i].position == 0)
        parts = [units[:half], units[half:]]
    layers = stage_layers(cfg.num_layers, stages)
    pipes = []
    for part in parts:
        sched = one_f_one_b(part, stages)
        pipes.append(
            (part, sched, [[layers[r] if ckpt and u % 3 == 0 else 0 for u in range(len(part))] for r in range(stages)])
        )
    with ctx.registry() as reg:
        reg.ensure([[0, stages - 1]] if stages > 1 else [])
        if ctx.rank >= stages:
            return None
        model = init_model(cfg, seed=3)
        stage = build_stages(model, layers)[ctx.rank]
        tie = reg.group([0, stages - 1]) if cfg.tie_embeddings and ctx.rank in (0, stages - 1) else None
        loss = run_stage_step(stage, ctx.rank, list(range(stages)), pipes, seqs, tie_group=tie)
        grads = {stage.full_name(n): p.grad.clone() for n, p in stage.named_parameters() if p.grad is not None}
        return loss, grads


@pytest.mark.parametrize(
    "stages,kind,ckpt,tied,split",
    [
        (2, "segments", False, False, False),
        (4, "segments", True, False, False),
        (4, "packed", False, True, False),
        (2, "segments", True, True, True),
    ],
)
def test_pipelined_step_over_gloo_equals_the_reference(pool, stages, kind, ckpt, tied, split):
    cfg_kwargs = {"num_layers": 4, "tie_embeddings": tied}
    cfg = ModelConfig(**cfg_kwargs)
    _, ref_loss, ref_grads = _reference(cfg, _sequences(cfg))
    results = pool.run(_job, stages, cfg_kwargs, kind, ckpt, split)
    assert all(r is None for r in results[stages:])
    loss = results[stages - 1][0]
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    got: dict[str, torch.Tensor] = {}
    for _, grads in results[:stages]:
        for name, g in grads.items():
            if name in got:  # the tied embedding: both copies hold the all-reduced sum
                torch.testing.assert_close(got[name], g)
            got[name] = g
    assert set(got) == set(ref_grads)
    for name, g in ref_grads.items():
        torch.testing.assert_close(got[name], g, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
