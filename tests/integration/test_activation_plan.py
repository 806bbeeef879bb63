"""The planner's activation memory is what training holds: the one-device calibration (forward and loss) and the
profile's per-layout bytes (Ulysses's all-to-all copies, GQA K/V replication) against real SP groups over gloo,
and the solver keeping every group within its layout's token cap."""

from __future__ import annotations

import numpy as np
import pytest

from flexorch.config import ModelConfig
from flexorch.solver.cost_model import RING, ULYSSES
from flexorch.solver.errors import InvalidPlanError
from flexorch.solver.plan import Group, MicroBatch, Plan
from flexorch.solver.planner import PlannerConfig, plan_step
from tests._dist_utils import DistPool
from tests.train_helpers import model_profile

LENGTHS = [300, 100, 60, 52]  # one packed micro-batch of 512 tokens


@pytest.fixture(scope="module")
def pool():
    p = DistPool(4)
    yield p
    p.close()


def _profile(cfg: ModelConfig, act: float, **kw):
    """A profile of the model ``cfg`` (float32 activations) whose one-device bytes per token are ``act``."""
    return model_profile(cfg, act, head_bytes_per_token=0.0, **kw)


def _held_bytes_job(ctx, cfg: ModelConfig, layouts):
    """Bytes per local token a training step's forward + loss saves on this rank, per (kind, degree) layout (the
    group is ranks 0..d-1; the others sit out), measured as ``run_step`` measures it."""
    from flexorch.work.step import GroupWork
    from flexorch.workers.activation_memory import saved_tensor_meter
    from flexorch.workers.calibrate import _synthetic
    from flexorch.workers.model import init_model
    from flexorch.workers.step_exec import group_attention, micro_batch_inputs

    registry = ctx.registry()
    registry.ensure([tuple(range(d)) for _, d in layouts if d > 1])
    model = init_model(cfg, 0)
    tokens, cu = _synthetic(LENGTHS, cfg.vocab_size, seed=1)
    out = []
    for kind, d in layouts:
        ranks = tuple(range(d))
        if ctx.rank not in ranks:
            out.append(None)
            continue
        group = registry.group(ranks) if d > 1 else None
        ids, pos, labels, layout = micro_batch_inputs(tokens, cu, ctx.rank, d, kind)
        attn = group_attention(layout, GroupWork(0, ranks, kind, ()), group, None)
        with saved_tensor_meter(list(model.parameters())) as meter:
            loss = model(ids, pos, attn, labels=labels)  # head + loss fused in chunks, as run_step runs them
        out.append((meter.bytes, int(ids.numel())))
        del loss
    registry.close()
    return out


@pytest.mark.parametrize("kv_heads", [2, 4])
def test_profile_predicts_the_bytes_real_sp_groups_hold(pool, kv_heads):
    from flexorch.workers.calibrate import activation_bytes_per_token
    from flexorch.workers.model import init_model

    cfg = ModelConfig(num_kv_heads=kv_heads)
    act = activation_bytes_per_token(init_model(cfg, 0), cfg.vocab_size)  # what `flexorch train` calibrates
    profile = _profile(cfg, act, memory_budget_bytes=1e9)
    layouts = [(ULYSSES, 1), (ULYSSES, 2), (ULYSSES, 4), (RING, 2), (RING, 4)]
    per_rank = pool.run(_held_bytes_job, cfg, layouts)
    for i, (kind, d) in enumerate(layouts):
        for rank in range(d):
            held, local = per_rank[rank][i]
            want = local * profile.act_bytes_per_local_token(kind, d)
            # exact up to a few bytes of per-micro-batch scalars (the loss)
            assert held == pytest.approx(want, rel=1e-4), (kind, d, rank, held / local, want / local)
    # what the one-device calibration sees is the training step's forward *and loss*
    held, local = per_rank[0][0]
    assert held / local == pytest.approx(act, rel=1e-4)
    # the all-to-all copy costs one hidden vector per layer; K/V replication only where d does not divide kv heads
    extra = {d: profile.ulysses_extra_bytes_per_token(d) for d in (1, 2, 4)}
    assert extra[1] == 0.0 and extra[2] == cfg.num_layers * cfg.dim * 4
    assert extra[4] > extra[2] if kv_heads == 2 else extra[4] == extra[2]


def test_ulysses_groups_get_their_own_smaller_token_cap():
    cfg = ModelConfig()
    profile = _profile(cfg, 12_040.0, memory_budget_bytes=1024.5 * 12_040.0)
    assert profile.tokens_per_device == 1024 == profile.local_token_cap(RING, 4) == profile.local_token_cap(ULYSSES, 1)
    ul2, ul4 = profile.group_token_cap(ULYSSES, 2), profile.group_token_cap(ULYSSES, 4)
    assert ul4 < 4 * 1024 and ul2 < 2 * 1024 and ul4 / 4 < ul2 / 2
    # a Ulysses-2 group over its cap but within a ring-2 group's is refused, naming its own budget
    lengths = (ul2 + 1,)
    with pytest.raises(InvalidPlanError, match=rf"over its memory budget of {ul2} \(2 x {ul2 // 2}\)"):
        Plan.for_profile(
            num_devices=2,
            seq_lengths=lengths,
            micro_batches=[MicroBatch((Group(2, ULYSSES, (0, 1), (0,)),))],
            profile=profile,
        )
    ring = Plan.for_profile(
        num_devices=2,
        seq_lengths=lengths,
        micro_batches=[MicroBatch((Group(2, RING, (0, 1), (0,)),))],
        profile=profile,
    )
    assert ring.micro_batches[0].groups[0].kind == RING
    # the planner, Ulysses only, never fills a group beyond its cap: such a sequence needs 4 devices
    rng = np.random.default_rng(0)
    batch = [ul2 + 1, *rng.integers(50, 600, size=12).tolist()]
    plan = plan_step(batch, 4, profile, PlannerConfig(kinds=(ULYSSES,), time_limit_s=2.0)).plan
    for mb in plan.micro_batches:
        for g in mb.groups:
            held = sum(batch[i] for i in g.seq_ids)
            assert held <= profile.group_token_cap(g.kind, g.degree), (g, held)
            if 0 in g.seq_ids:
                assert g.degree == 4


def test_train_budget_holds_tokens_per_worker_in_every_layout():
    from flexorch.solver.step_planner import planner_profile

    cfg = ModelConfig()
    base = _profile(cfg, 12_040.0, memory_budget_bytes=1e9)
    p = planner_profile(base, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, tokens_per_worker=1024)
    caps = [p.local_token_cap(k, d) for k in (ULYSSES, RING) for d in (1, 2, 4)]
    assert min(caps) == 1024 == p.local_token_cap(ULYSSES, 4)  # the costliest layout holds exactly the setting
    assert p.tokens_per_device > 1024  # one device and ring groups hold a little more


def _padded_local(kind: str, degree: int, lengths: list[int]) -> int:
    """Tokens a rank of the group really holds: Ulysses pads the packed batch to a multiple of d, zigzag ring
    pads every document to a multiple of 2d (``flexorch.workers.attention.sharding``)."""
    if degree == 1:
        return sum(lengths)
    if kind == RING:
        return sum(-(-s // (2 * degree)) * 2 * degree for s in lengths) // degree
    return -(-sum(lengths) // degree)


@pytest.fixture(scope="module")
def training(tmp_path_factory):
    from tests.train_helpers import training_env

    yield from training_env(tmp_path_factory, "activation-plan")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["adaptive", "static-ulysses-4", "static-ring-2"])
def test_training_holds_what_the_plan_predicts(training, mode):
    """Real training on 4 Ray workers with a calibrated profile: every rank's peak of bytes saved for backward is
    what the profile predicts for its largest micro-batch (with the sharding's padding), in every layout."""
    import json

    from flexorch.solver.profiles import load_profile
    from flexorch.workers.calibrate import activation_bytes_per_token
    from flexorch.workers.model import init_model
    from tests.train_helpers import run_driver, train_config

    root, corpus_dir, fixed_profile, corpus = training
    path = root / f"profile-{mode}.json"
    plan = {"mode": mode, "tokens_per_worker": 128 if mode.endswith("-2") else 64}  # 256-token documents fit
    cfg = train_config(corpus_dir, root / f"run-{mode}", path, plan=plan)
    cfg_model = cfg.model  # its loss in chunks: what the probe measures is what training holds
    act = activation_bytes_per_token(init_model(cfg_model, 0), cfg_model.vocab_size)  # as `flexorch train` does
    path.write_text(json.dumps({**json.loads(fixed_profile.read_text()), "act_bytes_per_token": act}))
    records, _ = run_driver(cfg, corpus)
    profile = load_profile(path)
    assert profile.act_bytes_per_token == act
    checked = 0
    for rec in records:
        predicted = [0.0] * rec["world_size"]
        for mb in rec["plan"]["micro_batches"]:
            for g in mb:
                local = _padded_local(g["kind"], g["degree"], g["seq_lengths"])
                held = local * profile.act_bytes_per_local_token(g["kind"], g["degree"])
                for r in g["ranks"]:
                    predicted[r] = max(predicted[r], held)
        for r, rank in enumerate(rec["ranks"]):
            assert rank["peak_activation_bytes"] == pytest.approx(predicted[r], rel=2e-3), (rec["step"], r)
            checked += predicted[r] > 0
    assert checked >= 3 * 4 - 2  # every rank of every step ran something (a rank may sit out a micro-batch)
