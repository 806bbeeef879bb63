"""Asynchronous checkpoints of a replicated state: the copy the write runs from is staged in host buffers kept from
save to save (``workers.host_staging``), and the files streamed from it (``workers.checkpoint_writes``) hold the state
of the save's step, whatever training does meanwhile, and load to what a synchronous save writes."""

from __future__ import annotations

import hashlib

import torch

from flexorch.config.model import ModelConfig
from flexorch.config.optim import OptimConfig
from flexorch.workers.host_staging import HostStaging
from flexorch.workers.model_state import StateSpec
from flexorch.workers.replicated_state import ReplicatedState

CFG = ModelConfig(vocab_size=64, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=64)


def _state() -> ReplicatedState:
    spec = StateSpec(
        0,
        CFG,
        OptimConfig(lr=1e-2, warmup_steps=1),
        7,
        {"mode": "replicate", "shard_size": None, "precision": "fp32", "recompute": "none"},
        None,
    )
    return ReplicatedState(spec, world=lambda: None, guard=lambda f, *a: f(*a))


def _train_step(s: ReplicatedState) -> None:
    s.model.zero_grad()
    sum(p.float().pow(2).sum() for p in s.model.parameters()).backward()  # every parameter and moment changes
    s.optimizer.step()
    s.scheduler.step()
    s.stepped()


def _assert_equal(a, b) -> None:
    """The same tree: keys, plain values, and tensors equal in dtype, shape and every value."""
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_equal(a[k], b[k])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_equal(x, y)
    else:
        assert a == b


def _files(d) -> dict[str, bytes]:
    return {f: (d / f).read_bytes() for f in ("model.pt", "train_state.pt")}


def test_staging_reuses_its_buffers_and_copies_every_tensor_of_the_tree():
    staging = HostStaging()
    a = {"x": torch.ones(3, 4), "opt": {"state": {0: {"step": torch.tensor(2.0), "m": torch.zeros(5)}}, "lr": 0.1},
         "l": [torch.arange(3), "plain"]}  # fmt: skip
    first = staging.copy(a)
    assert first["opt"]["lr"] == 0.1 and first["l"][1] == "plain"
    assert torch.equal(first["x"], a["x"]) and first["x"].data_ptr() != a["x"].data_ptr()
    a["x"].add_(1)
    assert torch.equal(first["x"], torch.ones(3, 4))  # a copy, not a view of the live tensor
    second = staging.copy(a)
    assert second["x"].data_ptr() == first["x"].data_ptr()  # the same buffer, rewritten
    assert torch.equal(second["x"], a["x"]) and torch.equal(second["opt"]["state"][0]["m"], torch.zeros(5))
    a["x"] = torch.ones(2, 2, dtype=torch.float64)  # another shape and dtype: a new buffer
    del a["l"]
    third = staging.copy(a)
    assert third["x"].dtype == torch.float64 and torch.equal(third["x"], a["x"])
    assert staging.nbytes == 2 * 2 * 8 + 4 + 5 * 4  # the list's buffer was released


def test_an_async_write_holds_the_saved_step_while_training_goes_on_and_equals_a_sync_write(tmp_path):
    sync, background = _state(), _state()
    for s in (sync, background):
        _train_step(s)
    want = {k: v.clone() for k, v in background.model.state_dict().items()}
    hashes = sync.write_state(str(tmp_path / "sync"), background=False)
    assert background.write_state(str(tmp_path / "async"), background=True) is None
    _train_step(background)  # the step after the save changes the live parameters while the write may still run
    got = background.finish_upload()
    for f, data in _files(tmp_path / "async").items():
        assert hashlib.sha256(data).hexdigest() == got[f]  # the SHA-256 taken as the bytes streamed out
        _assert_equal(
            torch.load(tmp_path / "sync" / f, weights_only=True), torch.load(tmp_path / "async" / f, weights_only=True)
        )
    assert set(hashes) == set(got)
    saved = torch.load(tmp_path / "async" / "model.pt", weights_only=True)
    assert all(torch.equal(saved[k], want[k]) for k in want)
    assert any(not torch.equal(background.model.state_dict()[k], want[k]) for k in want)
    buffers = background._staging.nbytes
    assert background.write_state(str(tmp_path / "again"), background=True) is None  # buffers reused, not re-made
    background.finish_upload()
    assert background._staging.nbytes == buffers
    again = torch.load(tmp_path / "again" / "model.pt", weights_only=True)
    assert all(torch.equal(again[k], v) for k, v in background.model.state_dict().items())
