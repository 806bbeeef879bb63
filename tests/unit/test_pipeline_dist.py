"""Pipelined steps across real processes (gloo point-to-point): loss and gradients equal the single-process reference.

Each stage is its own process; activations and gradients of units whose shapes change per unit travel by
``dist.isend``/``dist.recv``. 2 and 4 stages, Seq1F1B segments with their K/V prefix cache, checkpointing, a tied
embedding, back-to-back pipelines.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.distributed as dist

from flexorch.config import ModelConfig
from flexorch.solver.pipeline.schedule import one_f_one_b
from flexorch.solver.pipeline.stage_model import stage_layers
from flexorch.work.pipeline import gradient_channels
from flexorch.workers.model import init_model
from tests._dist_utils import DistPool
from tests.unit.test_pipeline_local import LENGTHS, _reference, _sequences, _units

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pool():
    p = DistPool(4)
    yield p
    p.close()


def _job(ctx, stages, cfg_kwargs, kind, ckpt, split):
    from flexorch.testing.pipeline_local import build_stages
    from flexorch.workers.pipeline.p2p import gradient_groups, run_stage_step

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
        channels = gradient_channels([(r,) for r in range(stages)])  # (r, r + 1): gradients on their own group
        reg.ensure(([[0, stages - 1]] if stages > 1 else []) + channels)
        if ctx.rank >= stages:
            return None
        r = ctx.rank
        grad_groups = gradient_groups(reg.group, r, r - 1 if r > 0 else None, r + 1 if r < stages - 1 else None)
        model = init_model(cfg, seed=3)
        stage = build_stages(model, layers)[r]
        tie = reg.group([0, stages - 1]) if cfg.tie_embeddings and r in (0, stages - 1) else None
        routes = set()  # (forward 0 / backward 1, carried by the world or by a gradient channel)

        def spy(real):
            def call(t, *args, group=None, tag=0, **kw):
                routes.add((tag % 2, "channel" if group is not None and group in grad_groups else "world"))
                return real(t, *args, group=group, tag=tag, **kw)

            return call

        with mock.patch.object(dist, "isend", spy(dist.isend)), mock.patch.object(dist, "recv", spy(dist.recv)):
            loss = run_stage_step(stage, r, list(range(stages)), pipes, seqs, grad_groups=grad_groups, tie_group=tie)
        grads = {stage.full_name(n): p.grad.clone() for n, p in stage.named_parameters() if p.grad is not None}
        return loss, grads, routes


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
    # activations travel on the world, gradients on each neighbour pair's own group (NCCL: one stream each way)
    assert set().union(*(r[2] for r in results[:stages])) == {(0, "world"), (1, "channel")}
    got: dict[str, torch.Tensor] = {}
    for _, grads, _ in results[:stages]:
        for name, g in grads.items():
            if name in got:  # the tied embedding: both copies hold the all-reduced sum
                torch.testing.assert_close(got[name], g)
            got[name] = g
    assert set(got) == set(ref_grads)
    for name, g in ref_grads.items():
        torch.testing.assert_close(got[name], g, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def assert_params_match(state: dict, ref_state: dict) -> None:
    """Parameters after a few AdamW steps equal the reference up to float reordering. Adam divides by the running
    gradient RMS, so an element whose gradient is ~0 can turn a 1e-9 reordering difference into a visible step:
    allow that for at most 0.1 % of the elements and never more than 1e-3 (a wrong gradient moves elements by ~lr =
    1e-2); every other element within rtol 1e-4 / atol 2e-5."""
    for name, ref in ref_state.items():
        diff = (state[name] - ref).abs()
        off = diff > 2e-5 + 1e-4 * ref.abs()
        assert float(diff.max()) < 1e-3, f"{name}: differs by {float(diff.max()):.2e}"
        assert int(off.sum()) <= max(1, ref.numel() // 1000), f"{name}: {int(off.sum())} of {ref.numel()} differ"


def _staged(units, stages: int, degree: int, world: int, num_layers: int, ckpt: bool):
    """A StagedPlan over hand-made units (costs do not matter to the executor, only the schedule does)."""
    from flexorch.solver.pipeline.plan import Pipeline, PipelinePlan
    from flexorch.solver.pipeline.sim import simulate
    from flexorch.solver.pipeline.staged import StagedPlan

    layers = stage_layers(num_layers, stages)
    sched = one_f_one_b(units, stages)
    ones = [[1.0] * len(units)] * stages
    run = simulate(sched, ones, [[2.0] * len(units)] * stages, ones)
    ck = tuple(tuple(layers[r] if ckpt and u % 3 == 0 else 0 for u in range(len(units))) for r in range(stages))
    pipe = Pipeline(tuple(units), tuple(tuple(s) for s in sched), ck, run)
    return StagedPlan(PipelinePlan(stages, len(units), (pipe,)), degree, world, tuple(layers))


def _train_job(ctx, stages, degree, cfg_kwargs, kind, ckpt, steps):
    import numpy as np

    from flexorch.config import OptimConfig
    from flexorch.work.pipeline import pipeline_work
    from flexorch.work.step import DocRef
    from flexorch.workers.optim import build_optimizer
    from flexorch.workers.pipeline.executor import run_pipeline_step
    from flexorch.workers.step_context import StepContext

    torch.manual_seed(0)
    cfg = ModelConfig(**cfg_kwargs)
    seqs = _sequences(cfg)
    block = np.concatenate([s.numpy() for s in seqs]).astype(np.int32)
    offsets = np.cumsum([0] + [len(s) for s in seqs])
    docs = [DocRef(i, 0, int(offsets[i]), len(s)) for i, s in enumerate(seqs)]
    staged = _staged(_units(kind, LENGTHS), stages, degree, ctx.world_size, cfg.num_layers, ckpt)
    model = init_model(cfg, seed=3)
    optim_cfg = OptimConfig(lr=1e-2, warmup_steps=0, grad_clip=0.5, eps=1e-6)  # eps: see assert_params_match
    opt, sched = build_optimizer(model, optim_cfg)
    losses, ops = [], None
    with ctx.registry() as reg:
        for step in range(steps):
            task = pipeline_work(staged, docs, step)[ctx.rank]
            reg.ensure(task.rank_sets)
            step_ctx = StepContext(model, opt, sched, reg.group, reg.world, optim_cfg, vocab_size=cfg.vocab_size)
            out = run_pipeline_step(step_ctx, task, {0: block})
            losses.append(out.loss)
            ops = out.ops
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, ops


@pytest.mark.parametrize(
    "stages,degree,kind,ckpt,tied",
    [
        (2, 2, "segments", True, True),  # SP inside each stage (Ulysses, 2 workers per stage)
        (4, 1, "segments", False, False),
        (3, 1, "packed", True, True),  # 3 stages on 4 workers: rank 3 sits out, still syncs
    ],
)
def test_pipelined_training_on_stage_workers_equals_the_reference(pool, stages, degree, kind, ckpt, tied):
    """The worker's executor (stage sharing the replica's modules, SP inside a stage, world all-reduce, clipped
    AdamW): per-step losses and parameters after 2 steps equal the single-process reference, every replica equal."""
    from flexorch.config import OptimConfig
    from flexorch.testing.reference import reference_train

    cfg_kwargs = {"num_layers": 4, "tie_embeddings": tied}
    cfg = ModelConfig(**cfg_kwargs)
    ref_losses, ref_state = reference_train(
        cfg, OptimConfig(lr=1e-2, warmup_steps=0, grad_clip=0.5, eps=1e-6), [_sequences(cfg)] * 2, seed=3
    )
    results = pool.run(_train_job, stages, degree, cfg_kwargs, kind, ckpt, 2)
    for losses, state, _ in results:
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        assert_params_match(state, ref_state)
        for name, v in results[0][1].items():
            assert torch.equal(state[name], v), f"replicas differ in {name}"
    in_stage = stages * degree
    n_units = len(_units(kind, LENGTHS))
    assert all(len(r[2]) == 2 * n_units for r in results[:in_stage])
    assert all(r[2] == [] for r in results[in_stage:])
    for _, _, ops in results[:in_stage]:  # one op at a time: each waited for its input after the previous ended
        for before, op in zip(ops, ops[1:], strict=False):
            assert op["wait_ms"] >= 0 and op["start_ms"] - op["wait_ms"] >= before["end_ms"] - 1e-6, (before, op)
