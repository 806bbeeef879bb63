"""What a token keeps for the backward in each recompute mode, three ways on CPU: the activation meter
(``flexorch.workers.activation_memory``), the count by hand of what each layer keeps
(``flexorch.workers.activation_count``) and ``torch.profiler``'s memory events; and what 'auto' recompute makes of
the figures (``flexorch.control.recompute_choice``, ``flexorch.solver.recompute``).

The test model: hidden 64, 4 layers, 4 heads of 16, 2 KV heads, MLP 172, float32. The count gives per token
21,172 bytes without recompute, 8,100 with selective recompute and 1,876 with full recompute for flexorch's decoder
(none / full 11.29, selective / full 4.32), and 21,236 / 10,228 / 1,812 for the Transformers Llama of the same shape
(11.72, 5.64). An H200 run printed 1.00x for both modes on a Transformers Llama sharded by FSDP2 with compiled layers:
the layers were never recomputed (``flexorch.workers.compile``), which the sharded, compiled case here checks.
"""

from __future__ import annotations

import dataclasses
import functools
from types import SimpleNamespace

import pytest
import torch

from flexorch.config.model import ModelConfig
from flexorch.workers.activation_count import layer_bytes_per_token, model_bytes_per_token
from flexorch.workers.calibrate import activation_bytes_per_token
from flexorch.workers.model_source import build_model, set_activation_checkpointing

MODES = ("none", "selective", "full")
SHAPE = {"vocab_size": 97, "dim": 64, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2, "ffn_dim": 172}
CFG = ModelConfig(**SHAPE, loss_chunk_tokens=64)
TOKENS = 256
EXPECTED = {
    "own": {"none": 21172, "selective": 8100, "full": 1876},
    "hf": {"none": 21236, "selective": 10228, "full": 1812},
}


def _hf_cfg(tmp_path) -> ModelConfig:
    transformers = pytest.importorskip("transformers")
    from flexorch.config.hf import hf_model_config

    transformers.LlamaConfig(
        hidden_size=64, intermediate_size=172, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=97, max_position_embeddings=1024,
    ).save_pretrained(tmp_path)  # fmt: skip
    return ModelConfig.from_dict({**hf_model_config(str(tmp_path)), "loss_chunk_tokens": 64})


def _per_mode(model, cfg) -> dict[str, float]:
    out = {}
    for mode in MODES:
        set_activation_checkpointing(model, mode)
        out[mode] = activation_bytes_per_token(model, cfg.vocab_size, tokens=TOKENS)
    return out


def test_the_hand_count_of_a_1b_llama_keeps_18x_more_without_recompute():
    cfg = ModelConfig(vocab_size=32000, dim=2048, num_layers=22, num_heads=16, num_kv_heads=4, ffn_dim=5632)
    assert layer_bytes_per_token(cfg, "none", 2) == 88136 and layer_bytes_per_token(cfg, "full", 2) == 4096
    none, full = (model_bytes_per_token(cfg, m, 2, hf=True) for m in ("none", "full"))
    assert none == 1_955_908 and full == 106_516 and 18 < none / full < 19
    with pytest.raises(ValueError, match="'none', 'selective' or 'full', got 'auto'"):
        layer_bytes_per_token(cfg, "auto")


@pytest.mark.parametrize("family", ["own", "hf"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_meter_counts_what_each_layer_keeps_in_each_mode(tmp_path, family, dtype):
    cfg = CFG if family == "own" else _hf_cfg(tmp_path)
    got = _per_mode(build_model(cfg, 0).to(dtype), cfg)
    p = torch.finfo(dtype).bits // 8
    want = {m: model_bytes_per_token(cfg, m, p, hf=family == "hf") for m in MODES}
    assert got == pytest.approx(want, rel=0.01), (got, want)
    if dtype == torch.float32:
        assert want == EXPECTED[family]
    assert got["none"] / got["full"] > 8 and got["none"] > got["selective"] > 2 * got["full"]


def test_torch_profiler_sees_what_the_meter_counts():
    """Bytes allocated during the forward and still alive after it (``torch.profiler``, CPU memory events) are the
    meter's figure, less the ids and labels (allocated before) and plus the CPU random-number state each checkpoint
    keeps (``torch.utils.checkpoint``'s ``preserve_rng_state``: host memory, not the meter's business)."""
    from torch.profiler import ProfilerActivity, profile

    from flexorch.work.step import GroupWork
    from flexorch.workers.calibrate import _synthetic
    from flexorch.workers.step_exec import group_attention, micro_batch_inputs

    model = build_model(CFG, 0)
    ids, cu = _synthetic([TOKENS], CFG.vocab_size, seed=0)
    ids, pos, labels, layout = micro_batch_inputs(ids, cu, 0, 1, "ulysses")
    attn = group_attention(layout, GroupWork(0, (0,), "ulysses", ()), None, None)
    rng = torch.get_rng_state().numel()
    for mode, meter in _per_mode(model, CFG).items():
        set_activation_checkpointing(model, mode)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            out = model(ids, pos, attn, labels)
        alive = sum(e.cpu_memory_usage for e in prof.events() if e.cpu_parent is None)
        del out
        checkpoints = TOKENS // CFG.loss_chunk_tokens + (CFG.num_layers if mode != "none" else 0)
        want = meter * TOKENS - (ids.nbytes + labels.nbytes) + checkpoints * rng
        assert alive == pytest.approx(want, rel=0.005), mode


def test_a_sharded_compiled_transformers_llama_recomputes_in_each_mode(tmp_path, monkeypatch):
    """FSDP2 (a world of one over gloo, bf16 compute) and compiled layers, as a GPU worker runs a Transformers model:
    Transformers checkpoints a layer in its class's outermost ``forward`` wrapper, and FSDP2's subclass adds one
    after the layers are compiled; the layers must still be recomputed, and gathered parameters (views of them saved
    by the matmuls) are not activations. Dynamo's eager backend traces the layers as Inductor would, in seconds."""
    import torch.distributed as dist

    from flexorch.workers.fsdp import build_mesh, fill_initial, sharded_decoder
    from flexorch.workers.process_groups import ProcessGroupRegistry

    if dist.is_initialized():
        pytest.skip("a torch.distributed world is already open in this process")
    cfg = dataclasses.replace(_hf_cfg(tmp_path), compile=True)
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    torch._dynamo.reset()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    with ProcessGroupRegistry(store=store, rank=0, world_size=1, epoch=0, backend="gloo"):
        model = sharded_decoder(cfg, build_mesh("fsdp", 1, None, "cpu"), precision="bf16", recompute="full")
        fill_initial(model, cfg, 0)
        got = _per_mode(model, cfg)
    torch._dynamo.reset()
    want = {m: model_bytes_per_token(cfg, m, 2, hf=True) for m in MODES}  # 11,828 / 6,324 / 1,044
    assert got == pytest.approx(want, rel=0.01), (got, want)


class _Workers:
    """Two workers of 'auto' recompute answering the driver with real measurements on their own model."""

    def __init__(self, models, times=(6.0, 8.0, 10.0)):
        self.models, self.times, self.said = models, list(times), []

    def call(self, method, *args):
        if method == "activation_bytes_per_token":
            out = []
            for model in self.models:
                set_activation_checkpointing(model, args[0])
                out.append(activation_bytes_per_token(model, CFG.vocab_size, tokens=TOKENS))
                set_activation_checkpointing(model, "full")
            return out
        assert method == "recompute_times"
        return [self.times for _ in self.models]


def _run_cfg():
    return SimpleNamespace(recompute="auto", pipelined=False, data=SimpleNamespace(max_context=4096))


def test_auto_recompute_reports_each_modes_bytes_and_the_budget_prices_groups_with_them():
    from flexorch.control.recompute_choice import with_recompute_ratios
    from flexorch.solver.plan import Group, MicroBatch, Plan
    from flexorch.solver.recompute import choose_modes, mode_bytes_profile
    from tests.solver_helpers import TINY

    workers = _Workers([build_model(CFG, 0), build_model(CFG, 1)])
    full = EXPECTED["own"]["full"]
    base = TINY.with_overrides(act_bytes_per_token=float(full), memory_budget_bytes=2e8, model_state_bytes=1e8)
    said = []
    profile = with_recompute_ratios(_run_cfg(), workers, base, say=said.append)
    none, selective = (EXPECTED["own"][m] / full for m in ("none", "selective"))
    assert profile.none_act_ratio == pytest.approx(none) and profile.selective_act_ratio == pytest.approx(selective)
    assert profile.none_time_ratio == pytest.approx(0.6) and profile.selective_time_ratio == pytest.approx(0.8)
    (line,) = said
    assert "which keeps 1.8 KiB per token" in line and "keeps 11.29x the activations (20.7 KiB)" in line
    assert "keeps 4.32x the activations (7.9 KiB)" in line and "no more than" not in line
    # the budget: a worker holds a mode's tokens at that mode's bytes, and each group runs in the fastest mode that fits
    room = 1e8
    caps = {m: mode_bytes_profile(profile, m).tokens_per_device for m in ("none", "selective", "full")}
    assert all(abs(caps[m] - room / EXPECTED["own"][m]) <= 1 for m in caps), caps  # full holds 11.29x none's
    lengths = [caps["none"], caps["none"] + 1, caps["selective"] + 1]
    groups = tuple(Group(1, "ulysses", (i,), (i,)) for i in range(3))
    plan = Plan.for_profile(num_devices=3, seq_lengths=lengths, micro_batches=[MicroBatch(groups)], profile=profile)
    assert choose_modes(plan, profile) == (("none", "selective", "full"),)


def test_auto_recompute_says_when_the_modes_did_not_change_what_the_model_keeps():
    from flexorch.control.recompute_choice import with_recompute_ratios
    from tests.solver_helpers import TINY

    model = build_model(CFG, 0)
    workers = _Workers([model])
    workers.call = lambda method, *args: (  # the H200 run's case: every mode measured as full recompute
        [activation_bytes_per_token(model, CFG.vocab_size, tokens=TOKENS)]
        if method != "recompute_times"
        else [[9, 10, 10]]
    )
    set_activation_checkpointing(model, "full")
    said = []
    profile = with_recompute_ratios(_run_cfg(), workers, TINY, say=said.append)
    assert profile.none_act_ratio == 1.0 and profile.selective_act_ratio == 1.0
    assert said[0].count("keeps 1.00x the activations (1.8 KiB), no more than with full recompute: the modes did") == 2


def test_a_recomputing_modes_budget_adds_what_the_backward_recomputes_for_one_layer():
    """The budget of 'full' and 'selective' is what the forward keeps plus one layer's recompute at the backward's
    peak, ``(none - kept) / layers``: for the test model's 4 layers, full's 1,876 bytes a token become 6,700 (none /
    that 3.16x, not the 11.29x of what is kept)."""
    from flexorch.workers.calibrate import with_recompute_transient

    model = build_model(CFG, 0)
    kept = _per_mode(model, CFG)
    assert kept == EXPECTED["own"]
    full = with_recompute_transient(kept["full"], kept["none"], model)
    assert full == 1876 + (21172 - 1876) / 4 == 6700
    selective = with_recompute_transient(kept["selective"], kept["none"], model)
    assert kept["selective"] < selective == 8100 + (21172 - 8100) / 4 < kept["none"]
    assert with_recompute_transient(kept["none"], kept["none"], model) == kept["none"]  # nothing recomputed
