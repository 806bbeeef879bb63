"""The [sharding] table's checks, the shard-size rule, the planner's model-state bytes and the re-shard choice (pure,
fast): bad input is a clear error before any worker starts."""

from __future__ import annotations

import math

import pytest

from flexorch.config import ConfigError, ModelConfig, config_from_dict
from flexorch.config.sharding import effective_shard_size
from flexorch.solver.model_state import model_state_bytes, shard_rows


@pytest.mark.parametrize(
    "table,match",
    [
        ({"mode": "zero3"}, r"sharding.mode must be one of \['auto', 'replicate', 'fsdp', 'hsdp'\], got 'zero3'"),
        ({"mode": "hsdp", "shard_size": 3}, r"shard_size=3 does not divide workers=4.*\[1, 2, 4\]"),
        ({"mode": "hsdp"}, "needs sharding.shard_size"),
        ({"mode": "fsdp", "shard_size": 2}, "for mode 'hsdp' only"),
        ({"mode": "replicate", "precision": "bf16"}, "bf16' needs sharding.mode 'fsdp' or 'hsdp'"),
        ({"activation_checkpointing": "some"}, "activation_checkpointing must be one of"),
        ({"mode": "hsdp", "shard_size": 0}, "positive integer"),
        ({"mode": "replicate", "gather": "step"}, "is for SP steps with sharding.mode 'fsdp' or 'hsdp'"),
        ({"mode": "fsdp", "gather": "model"}, "sharding.gather must be one of"),
    ],
)
def test_bad_sharding_is_a_clear_error(table, match):
    with pytest.raises(ConfigError, match=match):
        config_from_dict({"sharding": table})


@pytest.mark.parametrize(
    "sharding,stages,model,match",
    [
        ({"mode": "fsdp"}, "auto", {}, "can change the stage map every step"),
        ({"mode": "hsdp", "shard_size": 2}, 2, {}, "fsdp inside each stage"),
        ({"mode": "fsdp"}, 2, {"tie_embeddings": True}, "tied embedding"),
    ],
)
def test_sharded_pipelines_that_cannot_run_are_refused_with_what_to_do(sharding, stages, model, match):
    with pytest.raises(ConfigError, match=match):
        config_from_dict({"sharding": sharding, "pipeline": {"stages": stages}, "model": {"num_layers": 4, **model}})
    config_from_dict({"sharding": {"mode": "fsdp"}, "pipeline": {"stages": 2}, "model": {"num_layers": 4}})


def test_auto_is_fsdp_and_bf16_on_gpu_replicate_and_fp32_on_cpu():
    cpu, gpu = config_from_dict({}), config_from_dict({"use_gpu": True})
    assert (cpu.sharding_mode, cpu.precision) == ("replicate", "fp32")
    assert (gpu.sharding_mode, gpu.precision) == ("fsdp", "bf16")
    assert config_from_dict({"sharding": {"mode": "fsdp", "precision": "bf16"}}).precision == "bf16"


def test_recompute_is_auto_on_gpu_and_pipelined_runs_and_none_on_cpu_sp_runs_unless_set():
    # a GPU run's budget comes from the device: without recompute a document longer than a device holds would make
    # its batch infeasible; 'auto' recomputes only the groups that need it. Pipeline stages' 'auto' is their
    # checkpointing ILP (what they always ran), which measures nothing at start, so it is their default on CPU too
    assert config_from_dict({}).recompute == "none"
    assert config_from_dict({"use_gpu": True}).recompute == "auto"
    piped = {"workers": 2, "pipeline": {"stages": 2}, "model": {"num_layers": 4}}
    assert config_from_dict(piped).recompute == "auto"
    assert config_from_dict({**piped, "use_gpu": True}).recompute == "auto"
    for mode in ("none", "full", "selective", "auto"):
        set_ = {"sharding": {"activation_checkpointing": mode}}
        assert config_from_dict({"use_gpu": True, **set_}).recompute == mode
        assert config_from_dict(set_).recompute == mode
        if mode != "selective":
            assert config_from_dict({**piped, **set_}).recompute == mode
    with pytest.raises(ConfigError, match="pipeline stages recompute whole layers: with .pipeline. stages use 'auto'"):
        config_from_dict({**piped, "sharding": {"activation_checkpointing": "selective"}})


@pytest.mark.parametrize(
    "sharding", [{"precision": "fp32"}, {"mode": "replicate"}, {"mode": "fsdp", "precision": "fp32"}]
)
def test_gpu_runs_in_fp32_are_refused_before_any_worker_starts(sharding):
    # CUDA attention is fused only in fp16/bf16 (flexorch.workers.attention.kernels.DTYPES)
    with pytest.raises(ConfigError, match=r"use_gpu trains in bf16, got sharding.precision = 'fp32'.*'fsdp' or 'hsdp'"):
        config_from_dict({"use_gpu": True, "sharding": sharding})
    config_from_dict({"use_gpu": True, "sharding": {"mode": "hsdp", "shard_size": 1}})


def test_effective_shard_size_never_grows_a_workers_share():
    assert [effective_shard_size("hsdp", w, 2) for w in (1, 2, 3, 4, 5, 6)] == [1, 2, 3, 2, 5, 2]
    assert effective_shard_size("fsdp", 6, None) == 6 and effective_shard_size("replicate", 6, None) == 1


def test_shard_rows_follow_torch_chunk():
    import torch

    for rows, shards in [(257, 4), (10, 3), (2, 4), (64, 6)]:
        chunks = torch.arange(rows).chunk(shards)
        for i in range(shards):
            a, b = shard_rows(rows, shards, i)
            want = chunks[i].tolist() if i < len(chunks) else []
            assert list(range(a, b)) == want


def test_model_state_bytes_per_mode():
    cfg = ModelConfig()
    shapes, n = cfg.param_shapes(), cfg.num_params()
    assert model_state_bytes(shapes, 1, sharded=False).resident == 16 * n
    four = model_state_bytes(shapes, 4, sharded=True)
    assert 16 * n / 4 <= four.resident <= 16 * n / 4 * 1.05
    assert four.in_flight > 0 and four.resident <= 0.30 * 16 * n
    deep = ModelConfig(num_layers=32, dim=256, num_heads=4, num_kv_heads=4, ffn_dim=1024)  # one layer in flight of 32
    total = model_state_bytes(deep.param_shapes(), 4, sharded=True).total
    assert total <= 0.30 * 16 * deep.num_params()
    assert model_state_bytes(shapes, 4, sharded=True, param_bytes=2).in_flight < four.in_flight
    whole_step = model_state_bytes(shapes, 4, sharded=True, gather="step")  # every layer gathered with its gradient
    assert whole_step.resident == four.resident and whole_step.in_flight == 8 * n


def test_reshard_takes_the_newest_version_that_still_covers_every_shard():
    from flexorch.workers.reshard import _choose

    def held(version, index, count, names=("a", "b")):
        return (version, {n: (index, count) for n in names}, True)

    # version 5 lost shard 1 (its only holder is gone); version 4 is whole on ranks 1 and 2
    # (contributing rank, shard count, index of the holding at that rank)
    assert _choose([held(5, 0, 2), held(4, 0, 2), held(4, 1, 2), None], ["a", "b"]) == (
        4,
        {"a": {0: (1, 2, 0), 1: (2, 2, 0)}, "b": {0: (1, 2, 0), 1: (2, 2, 0)}},
    )
    assert _choose([held(5, 0, 2), held(5, 1, 2), held(5, 0, 2), None], ["a"])[1] == {"a": {0: (0, 2, 0), 1: (1, 2, 0)}}
    assert _choose([held(3, 0, 4), held(3, 1, 4), None], ["a"]) is None
    assert _choose([None, None], ["a"]) is None
    # pipeline stages: each rank holds its stage's parameters; a stage whose every holder is gone loses them
    stages = [held(2, 0, 2, ["a"]), held(2, 1, 2, ["a"]), held(2, 0, 1, ["b"])]
    assert _choose(stages, ["a", "b"])[1]["b"] == {0: (2, 1, 0)}
    assert _choose(stages[:2], ["a", "b"]) is None
    # a drained node's workers 2 and 3 handed their shards to ranks 0 and 1 before they left: fsdp over 4, so
    # only the handed holdings cover shards 2 and 3
    handed = [[held(7, 0, 4), held(7, 2, 4)], [held(7, 1, 4), held(7, 3, 4)]]
    assert _choose(handed, ["a"])[1] == {"a": {0: (0, 4, 0), 1: (1, 4, 0), 2: (0, 4, 1), 3: (1, 4, 1)}}
    assert _choose([[held(7, 0, 4)], [held(7, 1, 4)]], ["a"]) is None, "without the handoff shards 2 and 3 are gone"


def test_activation_checkpointing_keeps_less_and_computes_the_same_gradients():
    import torch

    from flexorch.work.step import GroupWork
    from flexorch.workers.calibrate import activation_bytes_per_token
    from flexorch.workers.model import init_model, loss_sum, set_activation_checkpointing
    from flexorch.workers.step_exec import group_attention, micro_batch_inputs

    cfg = ModelConfig(num_layers=3)
    tokens = torch.randint(0, cfg.vocab_size, (200,), generator=torch.Generator().manual_seed(0))
    ids, pos, labels, layout = micro_batch_inputs(tokens, [0, 120, 200], 0, 1, "ulysses")
    per_token, grads = {}, {}
    for mode in ("none", "selective", "full"):
        model = init_model(cfg, 0)
        set_activation_checkpointing(model, mode)
        per_token[mode] = activation_bytes_per_token(model, cfg.vocab_size)
        attn = group_attention(layout, GroupWork(0, (0,), "ulysses", ()), None, None)
        loss_sum(model(ids, pos, attn), labels).backward()
        grads[mode] = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert per_token["none"] > per_token["selective"] > per_token["full"] > 0
    assert torch.equal(grads["none"], grads["full"]) and torch.equal(grads["none"], grads["selective"])


def test_a_world_that_is_not_a_multiple_of_shard_size_is_said_in_words():
    from flexorch.config.sharding import uneven_world_note

    assert uneven_world_note("hsdp", 4, 2) is None and uneven_world_note("fsdp", 3, None) is None
    three = uneven_world_note("hsdp", 3, 2)  # after a loss from 4: sharded over all 3, no replica
    assert three.startswith("hsdp: 3 workers do not split into shard groups of 2, so the model state is sharded over")
    assert "no replica" in three and "last checkpoint" in three and "multiple of 2 again" in three
    assert uneven_world_note("hsdp", 9, 2) == (
        "hsdp: 9 workers do not split into shard groups of 2, so 3 replicas of shard groups of 3 until the world is a "
        "multiple of 2 again"
    )


def test_membership_lines_for_a_roll_back_and_an_uneven_world():
    from flexorch.cli.train_console import format_membership

    back = {"event": "membership", "what": "run step 4", "rollback": True, "lost": [2], "reason": "parts lost",
            "from_step": 4, "to_step": 2, "world_before": [0, 1, 3], "world_after": [0, 1, 3],
            "recovery_ms": 80.0}  # fmt: skip
    assert format_membership(back) == (
        "membership: run step 4: parts lost; back to the checkpoint of step 2 (from step 4), world of 3 in 80 ms"
    )
    shrink = {"event": "membership", "what": "run step 4", "reason": "workers [1] died or hung", "decisions":
              ["Shrink"], "world_before": [0, 1, 2, 3], "world_after": [0, 2, 3], "recovery_ms": 240.0,
              "step_completed": False, "layout": "hsdp: 3 workers do not split ..."}  # fmt: skip
    assert format_membership(shrink).endswith("in 240 ms; re-running the step; hsdp: 3 workers do not split ...")


def test_model_state_of_a_frozen_base_and_of_hugging_face_layer_names():
    """A frozen base keeps its weights only (4 bytes each, no gradient, no moments) while the tasks' adapters keep
    16; a Hugging Face model's decoder layers (``model.layers.<i>.``) are gathered one at a time like ours."""
    from flexorch.config.adapters import LoraSpec

    cfg = ModelConfig(adapters=(LoraSpec("chat", 4, 8.0, ("wq", "wv")),), base_trainable=False)
    shapes = cfg.param_shapes()
    adapters = sum(math.prod(s) for n, s in shapes if ".lora." in n)
    base = sum(math.prod(s) for n, s in shapes if ".lora." not in n)
    frozen = lambda name: ".lora." not in name  # noqa: E731
    assert model_state_bytes(shapes, 1, sharded=False, frozen=frozen).resident == 4 * base + 16 * adapters
    four = model_state_bytes(shapes, 4, sharded=True, frozen=frozen)
    trained = model_state_bytes(shapes, 4, sharded=True)
    assert four.resident < 0.3 * trained.resident and four.in_flight < trained.in_flight
    deep = [(f"model.{n}", s) for n, s in ModelConfig(num_layers=32).param_shapes()]  # HF-style names
    hf = model_state_bytes(deep, 4, sharded=True)
    assert hf.in_flight == model_state_bytes([(n[6:], s) for n, s in deep], 4, sharded=True).in_flight
    assert hf.in_flight < 0.2 * 8 * sum(math.prod(s) for _, s in deep)  # one layer of 32 gathered, not the model


def test_a_pipelined_run_s_workers_build_their_layers_without_recompute_whatever_the_setting():
    # a stage checkpoints the layers its plan says (flexorch.workers.pipeline.stage); a layer built to recompute
    # itself would recompute again under the stage's own checkpoint, beyond what the planner priced
    from flexorch.workers.recompute import built_mode

    assert [built_mode({"recompute": m}) for m in ("none", "full", "selective", "auto")] == [
        "none", "full", "selective", "full",  # 'auto': built for full recompute, each task says its groups' modes
    ]  # fmt: skip
    for stages in (2, 4, "auto"):
        for m in ("none", "full", "auto"):
            assert built_mode({"recompute": m, "stages": stages}) == "none"


def test_reshard_moves_tensors_in_buckets_each_whole_and_in_order():
    from flexorch.workers.reshard import _buckets

    items = [("a", (4, 4), "param"), ("b", (8,), "param"), ("c", (100,), "param"), ("d", (2,), "param")]
    # 64 + 32 bytes fit under 100; c (400 bytes) is over the limit alone; d starts the next bucket
    assert [[n for n, _, _ in b] for b in _buckets(items, limit=100)] == [["a", "b"], ["c"], ["d"]]
    assert [[n for n, _, _ in b] for b in _buckets(items, limit=10**6)] == [["a", "b", "c", "d"]]
    assert list(_buckets([], limit=100)) == []
