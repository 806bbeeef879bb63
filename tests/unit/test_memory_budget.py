"""``[plan] tokens_per_worker = "auto"``: the activation budget from the devices' memory (flexorch.control.
memory_budget), the config's placeholder until it is measured, and the planner's budget in bytes as measured."""

from __future__ import annotations

import pytest

from flexorch.config import CorpusConfig, ModelConfig, PlanSettings, TrainConfig
from flexorch.config.errors import ConfigError
from flexorch.config.plan import AUTO_CPU_TOKENS
from flexorch.control.memory_budget import MARGIN_BYTES, MARGIN_SHARE, device_budget, resolve_device_budget
from flexorch.solver.profiles import get_profile
from flexorch.solver.step_planner import planner_profile

GIB = 2**30


def test_auto_is_the_default_and_means_1024_on_cpu_workers():
    cfg = TrainConfig(workers=2)
    assert cfg.plan.tokens_per_worker == "auto" and cfg.tokens_per_worker == AUTO_CPU_TOKENS
    assert not cfg.budget_from_device
    gpu = TrainConfig(workers=1, use_gpu=True, data=CorpusConfig(max_context=16384),
                      sharding=_bf16_fsdp())  # fmt: skip
    assert gpu.budget_from_device and gpu.tokens_per_worker == 16384  # a placeholder until measured
    assert TrainConfig(plan=PlanSettings(tokens_per_worker=4096)).tokens_per_worker == 4096
    for bad in (8, "lots", True, 1.5):
        with pytest.raises(ConfigError, match="plan.tokens_per_worker must be 'auto' or an integer >= 16"):
            PlanSettings(tokens_per_worker=bad)


def _bf16_fsdp():
    from flexorch.config.sharding import ShardingSettings

    return ShardingSettings(mode="fsdp", precision="bf16")


def test_the_budget_is_the_free_memory_after_the_state_less_the_margin():
    b = device_budget(free_bytes=138 * GIB, total_bytes=139 * GIB, state_bytes=16.4 * GIB, act_bytes_per_token=2**20)
    after = (138 - 16.4) * GIB
    assert b.margin_bytes == pytest.approx(MARGIN_SHARE * after + MARGIN_BYTES)
    assert b.activation_bytes == pytest.approx(after - b.margin_bytes)
    assert b.tokens == int(b.activation_bytes // 2**20)
    assert 0.8 <= b.share_of_free < 0.9  # the bar: at least 80 % of the free memory after the state
    text = b.describe()
    assert "138.0 GiB free of 139.0" in text and f"{b.tokens:,} tokens per worker" in text
    with pytest.raises(ConfigError, match="not 16 tokens.*Shard the model state over more workers"):
        device_budget(free_bytes=20 * GIB, total_bytes=24 * GIB, state_bytes=19 * GIB, act_bytes_per_token=2**20)


class _Group:
    """The two worker calls the budget makes (``RayWorkerGroup.call``; the real one runs in the Ray tests)."""

    def __init__(self, free, act):
        self.free, self.act, self.calls = free, act, []

    def call(self, method):
        self.calls.append(method)
        if method == "device_memory":
            return [{"free_at_start": f, "total": 80 * GIB} for f in self.free]
        return [self.act] * len(self.free)


def _gpu_cfg(max_context, workers=2):
    model = ModelConfig(vocab_size=32000, dim=1024, num_layers=8, num_heads=8, num_kv_heads=4, ffn_dim=2816)
    return TrainConfig(workers=workers, use_gpu=True, model=model, data=CorpusConfig(max_context=max_context),
                       sharding=_bf16_fsdp())  # fmt: skip


def test_the_driver_measures_the_least_free_worker_and_rechecks_the_run():
    events = []
    cfg, budget = resolve_device_budget(_gpu_cfg(8192), _Group([70 * GIB, 60 * GIB], 2**20), events.append)
    assert budget.free_bytes == 60 * GIB and cfg.plan.tokens_per_worker == budget.tokens > 8192
    assert not cfg.budget_from_device and cfg.tokens_per_worker == budget.tokens
    assert events and events[0]["message"].startswith("memory budget from the device: 60.0 GiB free")
    # the loss head's chunk (4,096 tokens x 32,000 ids x 10 bytes) is kept free beside the share and the fixed part
    head = 10 * 4096 * 32000
    assert budget.head_bytes == head and "the loss head's chunk 1.2 of it" in events[0]["message"]
    assert budget.margin_bytes == pytest.approx(MARGIN_SHARE * (60 * GIB - budget.state_bytes) + MARGIN_BYTES + head)
    # a budget too small for the longest document on the run's workers: the run's own error, with the measurement
    with pytest.raises(ConfigError, match=r"data.max_context=.*measured"):
        resolve_device_budget(_gpu_cfg(2**22, workers=1), _Group([60 * GIB], 2**20), events.append)
    cpu = TrainConfig(workers=2)
    assert resolve_device_budget(cpu, None, events.append) == (cpu, None)  # CPU workers: nothing is measured


def test_the_planner_budgets_the_measured_bytes_as_they_are():
    base = get_profile("gpt-7b-a100")
    p = planner_profile(base, num_heads=32, num_kv_heads=8, tokens_per_worker=1000, activation_budget_bytes=5e9)
    assert p.memory_budget_bytes == pytest.approx(p.model_state_bytes + 5e9)
    q = planner_profile(base, num_heads=32, num_kv_heads=8, tokens_per_worker=1000)
    assert q.memory_budget_bytes > q.model_state_bytes + 1000 * base.act_bytes_per_token * 0.99


def test_a_cpu_worker_reports_no_device_memory():
    from flexorch.workers.devices import device_memory

    assert device_memory(None) is None


def test_out_of_memory_is_a_retry_with_a_cut_budget_not_a_crash():
    from flexorch.control.failures import Failure
    from flexorch.control.membership import ElasticPolicy, Retry, Shrink
    from flexorch.control.memory_budget import OOM_CUT, lowered_after_oom
    from flexorch.solver.refit import with_time_terms

    policy = ElasticPolicy(1, 4)
    d = policy.on_failure([0, 1, 2, 3], Failure(frozenset(), frozenset({0, 2}), out_of_memory=frozenset({1})), 0)
    assert isinstance(d, Retry) and "workers [1] ran out of device memory" in d.reason
    # a worker lost in the same attempt still shrinks the world (the budget is cut all the same)
    d = policy.on_failure([0, 1, 2, 3], Failure(frozenset({3}), out_of_memory=frozenset({1})), 0)
    assert isinstance(d, Shrink)
    base = planner_profile(get_profile("gpt-7b-a100"), num_heads=32, num_kv_heads=8, tokens_per_worker=4096)
    lowered, record, message = lowered_after_oom(base, {1}, 7)
    before = base.memory_budget_bytes - base.model_state_bytes
    assert lowered.memory_budget_bytes == pytest.approx(base.model_state_bytes + OOM_CUT * before)
    assert record["tokens_per_worker_after"] < record["tokens_per_worker_before"] == base.tokens_per_device
    assert message.startswith("step 7: workers [1] ran out of device memory") and record["errors"] == []
    # the worker's own words (what it tried to allocate, what was free) go into the record and the console line
    oom = "worker 1 ran out of device memory: CUDA out of memory. Tried to allocate 3.92 GiB. GPU 0 has 1.2 GiB free."
    _, record, message = lowered_after_oom(base, {1}, 7, ((1, oom),))
    assert record["errors"] == [[1, oom]] and message.endswith(f"planned again ({oom})")
    # a refit taken up after the cut (its time terms from a profile fitted before it) keeps the cut budget
    refit = base.with_overrides(a1_ms=base.a1_ms * 1.5)
    taken = with_time_terms(lowered, refit)
    assert taken.memory_budget_bytes == lowered.memory_budget_bytes and taken.a1_ms == refit.a1_ms != lowered.a1_ms
