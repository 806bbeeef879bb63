"""``benchmarks/gpu/gpu_throughput.py``'s plain Transformers loop trains what a flexorch run trains: the same
initial weights, documents, loss, AdamW, schedule and clipping, so its losses are the run's up to rounding (the
"loss gap" column of a lent GPU's table). Checked without Ray or a GPU, against flexorch's single-process reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")


def test_the_plain_loop_trains_the_single_process_reference(tmp_path):
    from benchmarks.gpu.gpu_throughput import loss_gap, plain_loop, plain_model, write_model
    from flexorch.config.load import load_train_config
    from flexorch.testing.reference import reference_train
    from flexorch.workers.model_source import build_model

    write_model(tmp_path / "model", "tiny", 256)
    model_dir = tmp_path / "model"
    (tmp_path / "run.toml").write_text(
        f'seed = 3\n[data]\ntokenizer = "byte"\n[model]\nhf = "{model_dir}"\n'
        "[optim]\nlr = 3e-3\nwarmup_steps = 2\ngrad_clip = 0.5\n"
    )
    cfg = load_train_config(tmp_path / "run.toml")
    rng = np.random.default_rng(0)
    docs = [[rng.integers(0, 512, n) for n in lengths] for lengths in ([40, 7, 90], [1, 64], [33, 33, 12, 5])]

    model = plain_model(cfg, tmp_path / "model", torch.device("cpu"), recompute=False)
    plain = plain_loop(model, cfg.optim, docs, torch.device("cpu"))
    losses, state = reference_train(cfg.model, cfg.optim, docs, cfg.seed)

    assert plain["losses"] == pytest.approx([round(x, 4) for x in losses], abs=2e-4)
    assert loss_gap(plain["losses"], [round(x, 4) for x in losses]) < 1e-4
    params = dict(model.named_parameters())
    off = max(float((params[n].detach() - v).abs().max()) for n, v in state.items() if n in params)
    init = build_model(cfg.model, cfg.seed).state_dict()
    moved = max(float((v - init[n]).abs().max()) for n, v in state.items())
    # Adam normalises each update, so an element with a near-zero gradient turns float reordering into up to ~lr
    # of difference; a wrong optimizer setting (decay, betas, schedule, clipping) moves the weights by ~lr everywhere
    assert moved > 5e-3, "the three steps moved the weights: the loops were compared on training, not on init"
    assert off < 0.01 * moved, f"parameters after 3 steps differ by {off} (moved {moved})"
