"""Stage-local parameters inside one worker: dropping parts frees their tensors and AdamW state, a part copied from
another worker continues training bitwise like the original, a partial state loads as exactly its parts."""

from __future__ import annotations

import pytest
import torch

from flexorch.config import ModelConfig, OptimConfig
from flexorch.work.placement import ALL
from flexorch.workers.model import init_model
from flexorch.workers.optim import build_optimizer
from flexorch.workers.pipeline.held_params import HeldParams

CFG = ModelConfig(num_layers=3)


def _worker(seed: int = 0):
    model = init_model(CFG, seed)
    opt, sched = build_optimizer(model, OptimConfig(lr=1e-2, warmup_steps=1))
    return model, opt, HeldParams(model, opt)


def _train(model, opt, steps: int = 2, seed: int = 1):
    """AdamW steps on random gradients, the same per parameter whatever the worker holds."""
    shapes = {n: p.shape for n, p in init_model(CFG, 0).named_parameters()}
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for name, p in model.named_parameters():
            grad = torch.randn(shapes[name], generator=g)
            p.grad = grad if p.numel() else None  # a released part has no gradient
        opt.step()


def test_release_frees_the_parts_and_their_optimizer_state():
    model, opt, held = _worker()
    _train(model, opt)
    whole = held.nbytes()
    keep = frozenset({"embed", "layer:0"})
    held.release(keep)
    assert held.held == keep and held.holds("layer:0") and not held.holds("head")
    for name, p in model.named_parameters():
        kept = name.startswith(("tok_embeddings.", "layers.0."))
        assert (p.numel() > 0) == kept, name
        assert (p in opt.state) == kept, name
    per_param = {n: p.numel() for n, p in init_model(CFG, 0).named_parameters()}
    kept_bytes = sum(16 * v + 4 for n, v in per_param.items() if n.startswith(("tok_embeddings.", "layers.0.")))
    assert held.nbytes() == kept_bytes < whole  # parameter, gradient, two moments (float32), step
    with pytest.raises(RuntimeError, match=r"holds no copy of \['head'\]"):
        held.require(frozenset({"head", "embed"}), "rank 3")


def test_a_copied_part_trains_on_bitwise_like_its_source():
    src_model, src_opt, src = _worker()
    _train(src_model, src_opt)
    dst_model, dst_opt, dst = _worker(seed=7)  # other initial values: everything must come from the source
    dst.release(frozenset({"embed"}))
    dst.load(src.export({"layer:1", "head"}))
    assert dst.held == {"embed", "layer:1", "head"}
    _train(src_model, src_opt, steps=1, seed=5)
    _train(dst_model, dst_opt, steps=1, seed=5)  # same gradients: the copies must stay identical
    src_params, dst_params = dict(src_model.named_parameters()), dict(dst_model.named_parameters())
    for name in dst.held_names():
        if name.startswith(("layers.1.", "norm.", "output.")):
            torch.testing.assert_close(dst_params[name], src_params[name], rtol=0, atol=0)
    dst.load(src.export({"layer:0", "layer:2"}))
    assert dst.held is ALL  # every part held again


def test_a_partial_state_loads_as_exactly_its_parts():
    model, opt, held = _worker()
    state = {k: v for k, v in model.state_dict().items() if k.startswith(("layers.2.", "norm.", "output."))}
    other_model, _, other = _worker(seed=3)
    other.set_from(state)
    assert other.held == {"layer:2", "head"}
    assert all(p.numel() == 0 for n, p in other_model.named_parameters() if n.startswith("layers.0."))
    other.set_from(model.state_dict())
    assert other.held is ALL
    bad = dict(state)
    bad["norm.weight"] = torch.zeros(3)
    with pytest.raises(ValueError, match="norm.weight: the state has shape"):
        other.set_from(bad)
