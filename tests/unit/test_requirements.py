"""The versions a run's optional parts need are checked from package metadata when the run file is read, before
Ray starts: a too-old or missing package is a one-line error naming the package, the version there and the version
needed (a user with Transformers 5.10 on a GPU image learned it only when the first world formed)."""

from __future__ import annotations

from importlib import metadata

import pytest

import flexorch.cli.train as cli_train
from flexorch.cli.main import main
from flexorch.config import ConfigError
from flexorch.config.load import load_train_config
from flexorch.config.requirements import check_requirements, installed_version, requirements_of, version_tuple
from tests.paths import EXAMPLES
from tests.train_helpers import write_corpus


def _env(**versions):
    """An environment whose installed distributions are ``versions`` (None: not installed)."""

    def installed(name: str) -> str:
        v = versions.get(name.replace("-", "_"), metadata.version(name))
        if v is None:
            raise metadata.PackageNotFoundError(name)
        return v

    return installed


def test_version_tuples_compare_releases():
    assert version_tuple("2.13.0+cpu") == (2, 13, 0)
    assert version_tuple("5.17.0") < version_tuple("5.24") < version_tuple("5.24.1")
    assert version_tuple("2.11.0a0+git1234") == (2, 11, 0)
    with pytest.raises(ValueError):
        version_tuple("main")


def test_the_installed_environment_meets_every_example():
    for toml in sorted(EXAMPLES.glob("train_*.toml")):
        check_requirements(load_train_config(toml))  # the real metadata of this venv


def test_an_hf_run_with_old_transformers_names_package_versions_and_fix():
    cfg = load_train_config(EXAMPLES / "train_hf_tiny.toml")
    assert {r.package for r in requirements_of(cfg)} >= {"transformers", "tokenizers", "torch"}
    with pytest.raises(ConfigError) as e:
        check_requirements(cfg, _env(transformers="5.10.2"))
    msg = str(e.value)
    assert "[model] hf" in msg and "transformers >= 5.17" in msg and "transformers 5.10.2" in msg, msg
    assert "pip install -U 'transformers>=5.17'" in msg, msg
    with pytest.raises(ConfigError, match="transformers >= 5.17, which is not installed: pip install"):
        check_requirements(cfg, _env(transformers=None))
    check_requirements(cfg, _env(transformers="5.17.0"))  # the oldest the suite has passed with


def test_fsdp_needs_a_torch_with_fsdp2_and_our_own_model_needs_no_transformers():
    cfg = load_train_config(EXAMPLES / "train_laptop.toml")
    check_requirements(cfg, _env(transformers=None, tokenizers=None))  # bytes tokenizer, our decoder
    with pytest.raises(ConfigError, match=r"needs torch >= 2.11; this environment has torch 2.9.1"):
        check_requirements(cfg, _env(torch="2.9.1"))


def test_the_cli_refuses_before_ray_starts(tmp_path, monkeypatch, capsys):
    def refuse(*a, **k):
        raise AssertionError("Ray started before the version check")

    monkeypatch.setattr(cli_train, "ray_session", refuse)
    real = metadata.version
    monkeypatch.setattr("flexorch.config.requirements.metadata.version", lambda n: "2.9.1" if n == "torch" else real(n))
    corpus = write_corpus(tmp_path / "corpus")
    code = main(["train", "--data", str(corpus), "--run-dir", str(tmp_path / "run"), "--sharding", "fsdp"])
    err = capsys.readouterr().err
    assert code == 2 and "torch >= 2.11" in err and "torch 2.9.1" in err, err


def test_a_package_without_metadata_is_asked_its_version(tmp_path, monkeypatch):
    # an image with torch built from source may ship no dist-info: the check imports it and reads __version__
    # rather than call it missing; a package that is neither installed nor importable is missing
    (tmp_path / "fx_no_dist_info").mkdir()
    (tmp_path / "fx_no_dist_info" / "__init__.py").write_text('__version__ = "5.30.0"\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    assert installed_version("fx_no_dist_info") == "5.30.0"
    assert installed_version("torch") == metadata.version("torch")
    with pytest.raises(metadata.PackageNotFoundError):
        installed_version("fx_not_there_at_all")
