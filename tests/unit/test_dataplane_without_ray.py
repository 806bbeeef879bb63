"""The data plane runs with torch alone (issue 18): the GPU machines have no Ray, so every data-plane module must
import, and attention, the model step and the gradient sync must run, with Ray (and Transformers, and python-mip
outside the planner's MILPs) impossible to import.

Each check runs in fresh interpreters (``sys.executable``) whose ``sys.meta_path`` starts with a finder that raises
ImportError for ``ray``/``ray.*``, ``transformers``/``transformers.*`` and, until the planner's modules load,
``mip``/``mip.*``. The modules are found by walking ``flexorch/`` on disk, minus :data:`EXCLUDED`; the runs call the
functions the worker actor calls (``flexorch.workers.actor.Worker._run_step``: ``ProcessGroupRegistry.ensure`` then
``run_step`` / ``run_sharded_step``) and compare with the single-process reference (``flexorch.testing.reference``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.paths import REPO

PACKAGE = REPO / "flexorch"

EXCLUDED = {
    # Not the data plane: the control plane and what feeds it. Each may import Ray (docs/architecture.md) and runs
    # on the driver's side, never alone on a GPU machine.
    "flexorch.__main__": "the `python -m flexorch` entry point (the CLI)",
    "flexorch.cli": "the `flexorch` commands (Ray)",
    "flexorch.control": "the control plane: driver, planner client, worker group, checkpoints (Ray)",
    "flexorch.dashboards": "plan viewer, SVGs, Grafana: read step records, never run on a worker",
    "flexorch.records": "the step-record schema, writer and metrics the driver writes (Ray)",
    "flexorch.data": "corpus readers, tokenizers, the document stream: the driver's side of the object store (Ray)",
    "flexorch.workers.actor": "the Ray actors around the data plane (`worker_actor(sharding)`)",
}
MIP_ALLOWED = "flexorch.solver."
"""The planner's MILPs need python-mip; only modules under here may, and only where they solve one."""
MIP_FREE_SOLVER = {
    "flexorch.solver.cost_model",
    "flexorch.solver.simulator",
    "flexorch.solver.profiles",
    "flexorch.solver.plan",
    "flexorch.solver.model_state",
    "flexorch.solver.pipeline.sim",
    "flexorch.solver.pipeline.stage_model",
}
"""The cost model and what the workers and benchmarks read of the solver: importable without python-mip."""
CORE = {
    "flexorch.workers.step_exec",
    "flexorch.workers.sharded_step",
    "flexorch.workers.fsdp",
    "flexorch.workers.process_groups",
    "flexorch.workers.attention.api",
    "flexorch.workers.attention.ulysses",
    "flexorch.workers.attention.ring",
    "flexorch.workers.pipeline.executor",
    "flexorch.work.step",
}

# Shared by every child: the import blocker, then helpers. A child prints one line "RESULT <json>" at its end.
PRELUDE = r"""
import importlib
import importlib.abc
import json
import sys

BLOCKED = {"ray", "transformers", "mip"}
assert not BLOCKED & {m.partition(".")[0] for m in sys.modules}, "a blocked package was loaded before the blocker"


class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {fullname!r} (blocked by the test)", name=fullname)
        return None


sys.meta_path.insert(0, Blocker())

import numpy as np
import torch
import torch.distributed as dist

torch.set_num_threads(1)


def loaded_blocked():
    return sorted(BLOCKED & {m.partition(".")[0] for m in sys.modules})


def tiny_run():
    from flexorch.config.model import ModelConfig
    from flexorch.config.optim import OptimConfig
    from flexorch.work.step import DocRef

    cfg = ModelConfig(vocab_size=61, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=48)
    optim_cfg = OptimConfig()  # warm-up: the first step moves a parameter by at most ~3e-4
    rng = np.random.default_rng(0)
    lengths = [10, 7, 12, 5, 8, 6]
    docs = [rng.integers(0, cfg.vocab_size, n).astype(np.int32) for n in lengths]
    starts = np.cumsum([0, *lengths])
    refs = [DocRef(100 + i, 0, int(starts[i]), n) for i, n in enumerate(lengths)]
    return cfg, optim_cfg, docs, refs, {0: np.concatenate(docs)}


def param_error(model_params, reference_state):
    model_params = dict(model_params)
    assert set(model_params) == set(reference_state)
    return max(float(np.abs(np.asarray(model_params[k]) - reference_state[k].numpy()).max()) for k in reference_state)


def attention_errors(kind, group, rank, degree):
    '''Max |difference| of out, dq, dk, dv (real tokens) of one SP attention against varlen attention on the whole
    batch, float64, GQA (4 query heads, 2 KV heads), per-document causal.'''
    from flexorch.workers.attention.api import (
        ulysses_attn_varlen_func,
        varlen_attn_func,
        zigzag_ring_attn_varlen_func,
    )
    from flexorch.workers.attention.sharding import contiguous_layout, shard, zigzag_layout

    lengths = [7, 12, 3, 9]
    cu = torch.tensor(np.cumsum([0, *lengths]), dtype=torch.int32)
    gen = torch.Generator().manual_seed(1)
    q, g = (torch.randn(int(cu[-1]), 4, 8, dtype=torch.float64, generator=gen) for _ in range(2))
    k, v = (torch.randn(int(cu[-1]), 2, 8, dtype=torch.float64, generator=gen) for _ in range(2))
    whole = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = varlen_attn_func(*whole, cu_seqlens=cu, max_seqlen=max(lengths))
    (ref * g).sum().backward()
    layout = (zigzag_layout if kind == "ring" else contiguous_layout)(cu, rank, degree)
    local = [shard(x, layout).requires_grad_() for x in (q, k, v)]
    fn = zigzag_ring_attn_varlen_func if kind == "ring" else ulysses_attn_varlen_func
    out = fn(*local, layout.cu_seqlens, layout.max_seqlen, group)
    keep = layout.loss_mask
    torch.where(keep[:, None, None], out * shard(g, layout), 0.0).sum().backward()
    idx = layout.index[keep]
    pairs = [(out, ref)] + [(a.grad, b.grad) for a, b in zip(local, whole)]
    return [float((a[keep] - b[idx]).abs().max()) for a, b in pairs]
"""

SINGLE = r"""
modules, store_path = json.loads(sys.argv[1]), sys.argv[2]
# 1. Everything outside the solver imports without Ray, Transformers or python-mip (solver modules they use too).
for name in modules:
    if not name.startswith("flexorch.solver."):
        importlib.import_module(name)
# 2. The solver: the cost model and simulator without python-mip; the MILP modules once it is allowed.
needs_mip = []
for name in (m for m in modules if m.startswith("flexorch.solver.")):
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as e:
        if (e.name or "").partition(".")[0] != "mip":
            raise
        needs_mip.append(name)
without_mip = loaded_blocked()
BLOCKED.discard("mip")
for name in needs_mip:
    importlib.import_module(name)
BLOCKED.add("mip")

# 3. Run: varlen attention, Ulysses and zigzag ring on a one-rank gloo world, one model step.
from flexorch.work.step import GroupWork, StepWork
from flexorch.workers.model_source import build_model
from flexorch.workers.optim import build_optimizer
from flexorch.workers.process_groups import ProcessGroupRegistry
from flexorch.testing.reference import reference_train
from flexorch.workers.step_context import StepContext
from flexorch.workers.step_exec import run_step

store = dist.FileStore(store_path, 1)
registry = ProcessGroupRegistry(store=store, rank=0, world_size=1, epoch=0, backend="gloo", timeout_s=30)
attention = {kind: attention_errors(kind, registry.world, 0, 1) for kind in ("ulysses", "ring")}

cfg, optim_cfg, docs, refs, blocks = tiny_run()
task = StepWork(
    0, 0, 1, (), (GroupWork(0, (0,), "ulysses", tuple(refs[:4])), GroupWork(1, (0,), "ring", tuple(refs[4:]))),
    sum(len(d) - 1 for d in docs), 2,
)
model = build_model(cfg, 7)
optimizer, scheduler = build_optimizer(model, optim_cfg)
registry.ensure(task.rank_sets)  # as Worker._run_step: the plan's groups, then the step (world None for one rank)
ctx = StepContext(model, optimizer, scheduler, registry.group, None, optim_cfg, vocab_size=cfg.vocab_size)
out = run_step(ctx, task, blocks)
registry.close()
losses, state = reference_train(cfg, optim_cfg, [docs], 7)
result = {
    "without_mip": without_mip,
    "needs_mip": needs_mip,
    "attention": attention,
    "loss": out.loss,
    "reference_loss": losses[0],
    "num_predicted": out.num_predicted,
    "param_error": param_error([(k, v.detach().numpy()) for k, v in model.state_dict().items()], state),
    "loaded": loaded_blocked(),
}
print("RESULT " + json.dumps(result))
"""

TWO_RANKS = r"""
rank, store_path, part = int(sys.argv[1]), sys.argv[2], sys.argv[3]
from flexorch.work.step import GroupWork, StepWork
from flexorch.workers.optim import build_optimizer
from flexorch.workers.process_groups import ProcessGroupRegistry
from flexorch.testing.reference import reference_train

cfg, optim_cfg, docs, refs, blocks = tiny_run()
n_pred = sum(len(d) - 1 for d in docs)
registry = ProcessGroupRegistry(
    store=dist.FileStore(store_path, 2), rank=rank, world_size=2, epoch=0, backend="gloo", timeout_s=30
)
result = {"rank": rank}
if part == "collectives":  # all-to-all (Ulysses), send/recv (ring), the gradient all-reduce (run_step)
    from flexorch.workers.model_source import build_model
    from flexorch.workers.step_context import StepContext
    from flexorch.workers.step_exec import run_step

    result["attention"] = {kind: attention_errors(kind, registry.world, rank, 2) for kind in ("ulysses", "ring")}
    mine = [GroupWork(2, (0,), "ulysses", tuple(refs[3:5])), GroupWork(2, (1,), "ring", (refs[5],))][rank]
    work = (GroupWork(0, (0, 1), "ulysses", tuple(refs[:2])), GroupWork(1, (0, 1), "ring", (refs[2],)), mine)
    task = StepWork(0, rank, 2, ((0, 1),), work, n_pred, 3)
    model = build_model(cfg, 7)
    optimizer, scheduler = build_optimizer(model, optim_cfg)
    registry.ensure(task.rank_sets)
    ctx = StepContext(model, optimizer, scheduler, registry.group, registry.world, optim_cfg, vocab_size=cfg.vocab_size)
    out = run_step(ctx, task, blocks)
    params = [(k, v.detach().numpy()) for k, v in model.state_dict().items()]
else:  # "sharded_torch_2_11": FSDP2 without FSDPModule.set_reduce_scatter_unused_params, as in torch 2.11;
    # "sharded_compiled": FSDP2 with every decoder layer compiled (flexorch.workers.compile), selective recompute
    import dataclasses

    from torch.distributed.fsdp import FSDPModule

    if part == "sharded_compiled":
        cfg = dataclasses.replace(cfg, compile=True)
    elif hasattr(FSDPModule, "set_reduce_scatter_unused_params"):
        del FSDPModule.set_reduce_scatter_unused_params
    from flexorch.workers import fsdp
    from flexorch.workers.shard_optim import build_shard_optimizer
    from flexorch.workers.sharded_step import run_sharded_step
    from flexorch.workers.step_context import StepContext

    # rank 1 sits out micro-batch 1 (an empty one under FSDP): its wk/wv get no gradient there
    work = (GroupWork(0, (0, 1), "ulysses", tuple(refs[:3])),)
    if rank == 0:
        work += (GroupWork(1, (0,), "ring", tuple(refs[3:])),)
    task = StepWork(0, rank, 2, ((0, 1),), work, n_pred, 2)
    registry.ensure(task.rank_sets)
    recompute = "selective" if part == "sharded_compiled" else "none"
    model = fsdp.sharded_decoder(cfg, fsdp.build_mesh("fsdp", 2, None, "cpu"), recompute=recompute)
    result["compiled"] = sum(bool(getattr(m, "_flexorch_compiled", False)) for m in model.layers)
    optimizer, scheduler = build_shard_optimizer(model, optim_cfg)
    fsdp.fill_initial(model, cfg, 7)
    result["has_api"] = hasattr(model, "set_reduce_scatter_unused_params")
    ctx = StepContext(model, optimizer, scheduler, registry.group, registry.world, optim_cfg, vocab_size=cfg.vocab_size)
    out = run_sharded_step(ctx, task, blocks)
    params = fsdp.gathered_parameters(model)
registry.close()
losses, state = reference_train(cfg, optim_cfg, [docs], 7)
result |= {
    "loss": out.loss,
    "reference_loss": losses[0],
    "num_predicted": out.num_predicted,
    "param_error": param_error(params, state),
    "loaded": loaded_blocked(),
}
print("RESULT " + json.dumps(result))
"""


def data_plane_modules() -> list[str]:
    """Every module under ``flexorch/`` (found on disk, nothing imported) except :data:`EXCLUDED`."""
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        if not any(name == ex or name.startswith(ex + ".") for ex in EXCLUDED):
            names.append(name)
    return names


def _env() -> dict:
    path = [str(REPO), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(path))
    env.pop("RAY_ADDRESS", None)
    return env


def _result(stdout: str, stderr: str, rc: int) -> dict:
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    assert rc == 0 and lines, f"child exited with {rc}:\n{stdout[-3000:]}\n{stderr[-6000:]}"
    return json.loads(lines[-1].removeprefix("RESULT "))


def _run_ranks(code: str, args_per_rank: list[list[str]], timeout_s: float = 180) -> list[dict]:
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, *args],
            cwd=REPO,
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for args in args_per_rank
    ]
    outs = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=timeout_s)
            outs.append((stdout, stderr, p.returncode))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [_result(*o) for o in outs]


def test_the_module_list_is_the_data_plane():
    modules = set(data_plane_modules())
    assert CORE <= modules and MIP_FREE_SOLVER <= modules, sorted((CORE | MIP_FREE_SOLVER) - modules)
    assert not any(m.startswith(("flexorch.control", "flexorch.cli")) for m in modules)
    assert "flexorch.workers.actor" not in modules


@pytest.mark.slow
def test_data_plane_imports_and_steps_on_one_rank_without_ray(tmp_path):
    modules = data_plane_modules()
    (res,) = _run_ranks(PRELUDE + SINGLE, [[json.dumps(modules), str(tmp_path / "store")]])
    assert res["without_mip"] == [], "Ray, Transformers or python-mip was imported outside the planner's MILPs"
    assert set(res["loaded"]) <= {"mip"}, "Ray or Transformers was imported"  # 'ray' not in sys.modules at the end
    assert all(m.startswith(MIP_ALLOWED) for m in res["needs_mip"]), res["needs_mip"]
    assert not MIP_FREE_SOLVER & set(res["needs_mip"]), "the cost model must not need python-mip"
    for kind, errors in res["attention"].items():  # out, dq, dk, dv
        assert max(errors) < 1e-10, (kind, errors)
    assert res["num_predicted"] == 42
    assert res["loss"] == pytest.approx(res["reference_loss"], rel=1e-6)
    assert 0 < res["loss"] < 10 and res["param_error"] < 2e-5


@pytest.mark.slow  # two fresh interpreters each: about 8 s a part on 2 cores (compiled: about 30 s)
@pytest.mark.parametrize("part", ["collectives", "sharded_torch_2_11", "sharded_compiled"])
def test_two_ranks_step_over_gloo_without_ray(tmp_path, part):
    """Two fresh processes, one gloo world (a FileStore): the SP collectives and the gradient sync really run.
    ``sharded_torch_2_11`` takes the FSDP2 path torch 2.11 needs (``flexorch.workers.fsdp._reduce_unused_params``)."""
    store = str(tmp_path / "store")
    results = _run_ranks(PRELUDE + TWO_RANKS, [[str(r), store, part] for r in range(2)])
    for res in results:
        assert res["loaded"] == [], f"rank {res['rank']} imported {res['loaded']}"
        assert res["num_predicted"] == 42
        assert res["loss"] == pytest.approx(res["reference_loss"], rel=1e-5)
        assert res["param_error"] < 2e-5, res
        for kind, errors in res.get("attention", {}).items():
            assert max(errors) < 1e-10, (res["rank"], kind, errors)
        if part == "sharded_torch_2_11":
            assert res["has_api"] is False
        if part == "sharded_compiled":
            assert res["compiled"] == 2
    assert results[0]["loss"] == results[1]["loss"]
