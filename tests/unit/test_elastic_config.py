"""Elastic bounds in the run config and on the command line: defaults, flags, and clear errors (fast, no Ray)."""

from __future__ import annotations

import pytest

from flexorch.cli.main import _train_config, build_parser
from flexorch.config import ConfigError, load_train_config
from tests.paths import EXAMPLES


def _cfg(**overrides):
    base = {"workers": 4, "data.max_context": 512, "plan.tokens_per_worker": 128, "plan.profile": "gpt-7b-a100"}
    return load_train_config(None, {**base, **overrides})


def test_defaults_floor_is_the_smallest_group_holding_max_context_ceiling_is_workers():
    cfg = _cfg()
    assert (cfg.min_workers, cfg.max_workers) == (4, 4)  # 512 tokens need 4 x 128
    cfg = _cfg(**{"data.max_context": 200})
    assert (cfg.min_workers, cfg.max_workers) == (2, 4)
    cfg = _cfg(**{"data.max_context": 100, "plan.mode": "static-ulysses-2"})
    assert cfg.min_workers == 2, "a static layout of degree 2 needs 2 workers"


def test_flags_set_the_bounds():
    args = build_parser().parse_args(
        ["train", "--workers", "4", "--min-workers", "2", "--max-workers", "8", "--max-context", "256"]
    )
    cfg = _train_config(args)
    assert (cfg.workers, cfg.min_workers, cfg.max_workers) == (4, 2, 8)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"elastic.min_workers": 2},
            r"elastic.min_workers=2 is too few: a document of data.max_context=512.*elastic.min_workers >= 4",
        ),
        (  # the document's floor and the static layout's, each named for what it is
            {"data.max_context": 128, "plan.mode": "static-ulysses-4", "elastic.min_workers": 2},
            r"needs an SP group of 1 workers x plan.tokens_per_worker=.*\(and plan.mode='static-ulysses-4' needs 4\); "
            r"set elastic.min_workers >= 4",
        ),
        ({"elastic.min_workers": 0}, r"elastic.min_workers must be a positive integer, got 0"),
        ({"elastic.max_workers": 3}, r"need elastic.min_workers <= workers <= elastic.max_workers, got 4 <= 4 <= 3"),
        ({"workers": 2, "data.max_context": 128, "elastic.min_workers": 3}, r"got 3 <= 2 <= 2"),
        (
            {"elastic.min_workers": 5, "elastic.max_workers": 4},
            r"elastic.min_workers <= elastic.max_workers, got 5 > 4",
        ),
        ({"elastic.wait_s": -1.0}, r"elastic.wait_s must be >= 0, got -1.0"),
        ({"elastic.max_attempts": 0}, r"elastic.max_attempts must be a positive integer, got 0"),
        ({"elastic.collective_timeout_s": 0}, r"elastic.collective_timeout_s must be > 0, got 0"),
        ({"elastic.heartbeat_timeout_s": 1}, r"heartbeat_timeout_s must be 0 \(off\) or at least 2 .*got 1"),
        ({"elastic.sigterm_grace_s": 0}, r"elastic.sigterm_grace_s must be > 0 \(seconds\), got 0"),
        ({"elastic.driver_restarts": -1}, r"elastic.driver_restarts must be an integer >= 0, got -1"),
        ({"elastic.driver_restarts": 1.5}, r"elastic.driver_restarts must be an integer >= 0, got 1.5"),
    ],
)
def test_bad_bounds_say_what_to_set(overrides, message):
    with pytest.raises(ConfigError, match=message):
        _cfg(**overrides)


@pytest.mark.parametrize(
    "name", ["train_laptop.toml", "train_cluster.toml", "train_7b_gpu.toml", "train_pipeline.toml"]
)
def test_example_run_files_are_valid(name):

    cfg = load_train_config(EXAMPLES / name)
    assert cfg.min_workers <= cfg.workers <= cfg.max_workers
    if name == "train_pipeline.toml":
        assert (cfg.pipeline.stages, cfg.model.num_layers, cfg.min_workers) == (2, 4, 2)
    if name == "train_cluster.toml":
        assert (cfg.min_workers, cfg.max_workers, cfg.elastic.wait_s) == (2, 8, 120)
        assert (cfg.elastic.max_attempts, cfg.elastic.collective_timeout_s) == (5, 120)
        assert cfg.checkpoint.storage.startswith("s3://") and cfg.checkpoint.async_  # no NFS needed
