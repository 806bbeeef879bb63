"""The invariant for pipelines: a pipelined step gives the single-process reference's loss and gradients.

2 and 4 stages; whole sequences packed into units (plain 1F1B) or long sequences split into Seq1F1B segments whose
K/V prefix cache and its gradients cross units; with and without activation checkpointing; also a tied embedding
(copies on the first and last stage, gradients summed) and back-to-back pipelines.
"""

from __future__ import annotations

import pytest
import torch

from flexorch.config import ModelConfig
from flexorch.solver.pipeline.chunking import chunk_batch
from flexorch.solver.pipeline.plan import packed_1f1b_units
from flexorch.solver.pipeline.schedule import one_f_one_b
from flexorch.solver.pipeline.stage_model import stage_layers
from flexorch.testing.pipeline_local import build_stages, run_local_step, stage_grads_as_full
from flexorch.testing.reference import pack_documents, reference_loss_sum
from flexorch.workers.model import init_model

LENGTHS = [300, 17, 90, 5, 160, 41, 8, 220, 2, 64]


def _sequences(cfg: ModelConfig, lengths=LENGTHS) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, cfg.vocab_size, (n,), generator=g) for n in lengths]


def _reference(cfg, seqs):
    model = init_model(cfg, seed=3)
    batch = pack_documents(seqs)
    loss = reference_loss_sum(model, batch) / batch.n_predicted
    loss.backward()
    return model, float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}


def _units(kind: str, lengths):
    if kind == "packed":
        return packed_1f1b_units(lengths, 4, 1e-3, 1.0)
    return chunk_batch(lengths, 12, 1e-3, 1.0, token_cap=128)  # the 300/220/160-token sequences become segments


@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("kind", ["packed", "segments"])
@pytest.mark.parametrize("ckpt", [False, True])
def test_pipelined_step_equals_the_reference(stages, kind, ckpt):
    cfg = ModelConfig(num_layers=4)
    seqs = _sequences(cfg)
    model, ref_loss, ref_grads = _reference(cfg, seqs)
    units = _units(kind, LENGTHS)
    if kind == "segments":
        assert any(u.prefix > 0 for u in units), "the plan should split some sequence into segments"
    layers = stage_layers(cfg.num_layers, stages)
    schedule = one_f_one_b(units, stages)
    checkpointed = [[layers[r] if (ckpt and u % 2 == 0) else 0 for u in range(len(units))] for r in range(stages)]
    pipe_stages = build_stages(model, layers)
    loss = run_local_step(pipe_stages, [(units, schedule, checkpointed)], seqs)
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    grads = stage_grads_as_full(pipe_stages)
    assert set(grads) == set(ref_grads)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_compiled_layers_in_pipeline_stages_equal_the_reference():
    # regional compile (flexorch.workers.compile) inside stages: segments with a K/V prefix, checkpointed units
    from flexorch.workers.compile import compile_layers

    cfg = ModelConfig(num_layers=4)
    seqs = _sequences(cfg)
    model, ref_loss, ref_grads = _reference(cfg, seqs)
    units = _units("segments", LENGTHS)
    layers = stage_layers(cfg.num_layers, 2)
    checkpointed = [[layers[r] if u % 2 == 0 else 0 for u in range(len(units))] for r in range(2)]
    pipe_stages = build_stages(model, layers)  # copies of the layers, two per stage
    assert [compile_layers(st) for st in pipe_stages] == [2, 2]
    from torch._dynamo.utils import counters

    counters.clear()
    loss = run_local_step(pipe_stages, [(units, one_f_one_b(units, 2), checkpointed)], seqs)
    assert counters["stats"]["calls_captured"] > 0, "the layers ran compiled"
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    grads = stage_grads_as_full(pipe_stages)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_tied_embeddings_and_back_to_back_pipelines():
    cfg = ModelConfig(num_layers=2, tie_embeddings=True)
    seqs = _sequences(cfg)
    model, ref_loss, ref_grads = _reference(cfg, seqs)
    units = _units("segments", LENGTHS)
    half = next(i for i in range(len(units) // 2, len(units)) if units[i].position == 0)  # between sequences
    pipes = []
    for part in (units[:half], units[half:]):
        sched = one_f_one_b(part, 2)
        pipes.append((part, sched, [[0] * len(part)] * 2))
    pipe_stages = build_stages(model, [1, 1])
    loss = run_local_step(pipe_stages, pipes, seqs)
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    grads = stage_grads_as_full(pipe_stages)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_segments_out_of_order_are_refused():
    cfg = ModelConfig(num_layers=2)
    seqs = _sequences(cfg)
    model = init_model(cfg, seed=3)
    units = _units("segments", LENGTHS)
    j = next(i for i, u in enumerate(units) if u.prefix > 0)  # a later segment run before its predecessor
    from flexorch.workers.pipeline.stage import UnitInput

    stage = build_stages(model, [2])[0]
    with pytest.raises(RuntimeError, match="needs the K/V of tokens"):
        stage.forward_unit(0, UnitInput(units[j].pieces, seqs), None, 100)


@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("kind", ["packed", "segments"])
def test_measured_peak_activation_memory_stays_within_the_plan_budget(stages, kind):
    """The checkpointing ILP's plan, run for real: bytes saved for backward per stage stay within the budget
    (segments also hold their K/V prefix, which the stage model counts)."""
    import dataclasses

    from flexorch.solver.pipeline.checkpointing import checkpoint_plan
    from flexorch.solver.pipeline.stage_model import StageModel
    from flexorch.workers.calibrate import activation_bytes_per_token, stage_activation_bytes
    from tests.train_helpers import model_profile

    cfg = ModelConfig(num_layers=4)
    seqs = _sequences(cfg)
    model = init_model(cfg, seed=3)
    units = packed_1f1b_units(LENGTHS, 6, 1e-3, 1.0)
    per_layer, head = stage_activation_bytes(model, cfg.vocab_size)  # what the workers measure for the planner
    # the head and loss run fused in chunks (flexorch.workers.chunked_loss): the fp32 log-softmax (vocab * 4 bytes
    # per token) the whole-logits loss keeps is not held
    whole_cfg = dataclasses.replace(cfg, loss_chunk_tokens=0)
    _, whole = stage_activation_bytes(init_model(whole_cfg, seed=3), cfg.vocab_size)
    assert 0 < head <= whole - 0.9 * 4 * cfg.vocab_size, (head, whole)
    whole = activation_bytes_per_token(model, cfg.vocab_size)  # the SP calibration's figure, for comparison
    assert 0.9 * whole < per_layer * cfg.num_layers + head < 1.2 * whole
    per_token = per_layer * cfg.num_layers + head
    profile = model_profile(cfg, per_token, head_bytes_per_token=head, memory_budget_bytes=1e12)
    units = _units(kind, LENGTHS)
    sched = one_f_one_b(units, stages)
    loose = StageModel(profile, stages)
    need = max(sum(loose.act_bytes(units[u], 0) for u in held) for held in _held(sched[0]))
    model_cfg = StageModel(dataclasses.replace(profile, memory_budget_bytes=0.5 * need), stages)
    ckpt = checkpoint_plan(model_cfg, units, sched)
    assert ckpt is not None and sum(map(sum, ckpt)) > 0, "the budget should need checkpointing"
    pipe_stages = build_stages(model, stage_layers(cfg.num_layers, stages))
    run_local_step(pipe_stages, [(units, sched, ckpt)], seqs)
    free = [build_stages(model, stage_layers(cfg.num_layers, stages)), None]
    run_local_step(free[0], [(units, sched, [[0] * len(units)] * stages)], seqs)
    for r in range(stages):  # the last stage's LM head share is in the stage model too
        assert pipe_stages[r].peak_held_bytes <= model_cfg.budget_bytes(r)
        assert pipe_stages[r].peak_held_bytes <= free[0][r].peak_held_bytes
    assert any(pipe_stages[r].peak_held_bytes < free[0][r].peak_held_bytes for r in range(stages))
    assert all(s.held_bytes == 0 for s in pipe_stages)


def _held(ops):
    from flexorch.solver.pipeline.checkpointing import held_sets

    return held_sets(ops)
