"""The run configuration: torch- and Ray-free nested tables, keys that moved into a table named in the error, unknown
keys refused, one word ("workers") for a device slot in both commands (fast, no Ray)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from flexorch.cli.main import _train_config, build_parser, main
from flexorch.config import (
    MOVED_KEYS,
    ConfigError,
    CorpusConfig,
    ElasticSettings,
    ModelConfig,
    OptimConfig,
    PipelineSettings,
    PlanSettings,
    TrainConfig,
    config_from_dict,
    load_train_config,
)
from tests.paths import REPO

RUN_FILES = sorted((REPO / "examples").glob("train_*.toml"))


def test_loading_a_run_file_imports_neither_ray_nor_torch():
    """Nor python-mip: the config checks pipeline stages with the solver's stage-count rule, and the solver package
    loads its names lazily, so that rule does not bring in the MILP planner."""
    code = (
        "import sys, pkgutil, importlib, flexorch.config as c\n"
        "for m in pkgutil.walk_packages(c.__path__, 'flexorch.config.'): importlib.import_module(m.name)\n"
        "for path in sys.argv[1:]:\n"
        "    cfg = c.load_train_config(path)\n"
        "    assert cfg.model.num_params() > 0 and cfg.optim.lr > 0 and cfg.data.max_context > 0, path\n"
        "    assert c.config_from_dict(cfg.to_dict()) == cfg, path\n"
        "bad = [m for m in sys.modules if m in ('ray', 'torch', 'mip') or m.startswith(('ray.', 'torch.', 'mip.'))]\n"
        "print(bad); sys.exit(1 if bad else 0)\n"
    )
    assert len(RUN_FILES) >= 4
    r = subprocess.run(
        [sys.executable, "-c", code, *map(str, RUN_FILES)], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_data_plane_builds_from_the_config_layer_classes():
    import flexorch.config as c
    from flexorch.data import corpus
    from flexorch.workers import model, optim

    assert model.ModelConfig is c.ModelConfig and optim.OptimConfig is c.OptimConfig
    assert corpus.CorpusConfig is c.CorpusConfig


@pytest.mark.parametrize("key", sorted(MOVED_KEYS))
def test_a_top_level_key_that_moved_into_a_table_names_its_new_place(tmp_path, key):
    table, new = MOVED_KEYS[key]
    value = {"max_workers": 8, "pipeline_params": "replicated"}.get(key, 2)
    path = tmp_path / "run.toml"
    path.write_text(f"steps = 3\n{key} = {value!r}\n".replace("'", '"'))
    with pytest.raises(ConfigError) as e:
        load_train_config(path)
    assert f"{key} is now [{table}] {new}" in str(e.value) and str(path) in str(e.value)
    path.write_text(f"steps = 3\n[{table}]\n{new} = {value!r}\n".replace("'", '"'))  # where it lives now
    assert getattr(getattr(load_train_config(path), table), new) == value


def test_unknown_keys_stay_errors_in_every_table():
    with pytest.raises(ConfigError, match=r"unknown keys \['stepz'\]; run keys are .* plus \[model\] .*\[pipeline\]"):
        config_from_dict({"stepz": 3})
    with pytest.raises(ConfigError, match=r"\[elastic\]: unknown keys \['min_worker'\]; known: .*'min_workers'"):
        config_from_dict({"elastic": {"min_worker": 2}})
    with pytest.raises(ConfigError, match=r"\[pipeline\]: unknown keys \['pipeline_stages'\]; known: .*'stages'"):
        config_from_dict({"pipeline": {"pipeline_stages": 2}})
    with pytest.raises(ConfigError, match=r"\[elastic\] must be a table of keys, got elastic = 3"):
        config_from_dict({"elastic": 3})


def test_tables_check_their_own_keys_with_the_numbers():
    with pytest.raises(ConfigError, match=r"elastic.wait_s must be >= 0, got -2"):
        ElasticSettings(wait_s=-2)
    with pytest.raises(ConfigError, match=r"elastic.min_workers <= elastic.max_workers, got 6 > 3"):
        ElasticSettings(min_workers=6, max_workers=3)
    with pytest.raises(ConfigError, match=r"pipeline.stages must be a positive integer or 'auto', got True"):
        PipelineSettings(stages=True)
    with pytest.raises(TypeError):
        ElasticSettings(2)  # keyword-only, like every table
    with pytest.raises(ConfigError, match=r"elastic must be ElasticSettings .*got \{'min_workers': 2\}"):
        TrainConfig(elastic={"min_workers": 2})
    with pytest.raises(ConfigError, match=r"worker_threads must be a positive integer, got 0"):
        config_from_dict({"worker_threads": 0})
    with pytest.raises(ConfigError, match=r"use_gpu must be true or false, got 'yes'"):
        config_from_dict({"use_gpu": "yes"})
    classes = (TrainConfig, ElasticSettings, PipelineSettings, PlanSettings, ModelConfig, OptimConfig, CorpusConfig)
    for cls in classes:  # every field documented in place
        src = Path(sys.modules[cls.__module__].__file__).read_text()
        for f in dataclasses.fields(cls):
            after = src.split(f"\n    {f.name}: ", 1)[1].split("\n", 2)[1]
            assert after.strip().startswith('"""'), f"{cls.__name__}.{f.name} has no docstring"


def test_train_flags_fill_the_tables():
    flags = ["--workers", "4", "--pipeline-stages", "auto", "--pipeline-params", "replicated", "--min-workers", "2"]
    args = build_parser().parse_args(["train", *flags])
    cfg = _train_config(args)
    assert (cfg.pipeline.stages, cfg.pipeline.params, cfg.elastic.min_workers, cfg.min_workers) == (
        "auto",
        "replicated",
        2,
        2,
    )


def test_plan_says_workers_and_refuses_the_old_word(tmp_path, capsys):
    assert main(["plan", "--devices", "8"]) == 2
    err = capsys.readouterr().err
    assert "--devices was renamed --workers" in err and "use --workers 8" in err
    conf = tmp_path / "plan.toml"
    conf.write_text("devices = 8\nsteps = 1\n")
    assert main(["plan", "--config", str(conf)]) == 2
    err = capsys.readouterr().err
    assert "'devices' was renamed 'workers'" in err and "write workers = 8" in err
    assert main(["plan", "--workers", "0"]) == 2
    assert "--workers must be >= 1, got 0" in capsys.readouterr().err
    assert "--devices" not in build_parser().format_help() + _plan_help()


def _plan_help() -> str:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return sub.choices["plan"].format_help()


def test_a_run_that_cannot_work_is_refused_when_its_config_is_built(tmp_path):
    # pure checks, moved out of the Ray driver tests: no worker, no Ray
    from tests.train_helpers import cpu_profile, train_config, write_corpus

    corpus_dir, profile = write_corpus(tmp_path / "corpus"), cpu_profile(tmp_path / "profile.json")
    with pytest.raises(ConfigError, match="max_context=8192 tokens cannot fit"):
        train_config(corpus_dir, tmp_path, profile, data=CorpusConfig(source=str(corpus_dir), max_context=8192))
    with pytest.raises(ConfigError, match="Ulysses degree 8 must divide model.num_heads=4"):
        train_config(corpus_dir, tmp_path, profile, workers=8, plan={"mode": "static-ulysses-8"})
    bad = tmp_path / "bad.toml"
    bad.write_text("steps = 3\n[plan]\nmode = 'sometimes'\n")
    with pytest.raises(ConfigError, match="plan.mode"):
        load_train_config(bad)
