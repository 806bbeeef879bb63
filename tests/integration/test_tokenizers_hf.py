"""Tokenizer specs: 'auto' resolved by the run config, local 'hf:<dir>' directories (never a download) and 'bpe:<N>'
trained on the run's own corpus (flexorch.data.bpe). Fast: no Ray cluster, except the one end-to-end driver test."""

from __future__ import annotations

import json
import os
import random
import sys
import types
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

from flexorch.config import ConfigError, CorpusConfig, TrainConfig, config_from_dict  # noqa: E402
from flexorch.control import run_setup  # noqa: E402
from flexorch.control.driver import TrainingDriver  # noqa: E402
from flexorch.data.bpe import META_FILE, prepare_tokenizer, sample_documents  # noqa: E402
from flexorch.data.lengths import DataError  # noqa: E402
from flexorch.data.tokenizer import HFTokenizer, get_tokenizer  # noqa: E402

N = 400
WORDS = (
    "def class return import from self value tokens batch worker model layer attention train step plan corpus "
    "the of and to in is for with data shard stream elastic flexorch héllo wörld ✓ 数据"
).split()


def _write_corpus(root: Path, files: int = 12, lines: int = 60) -> Path:
    """A small deterministic corpus of code-like text files (a few tens of KB)."""
    rng = random.Random(0)
    root.mkdir(parents=True, exist_ok=True)
    for i in range(files):
        body = []
        for j in range(lines):
            ws = rng.choices(WORDS, k=rng.randint(3, 9))
            body.append(f"{'    ' * (j % 3)}{ws[0]} {'_'.join(ws[1:3])}({', '.join(ws[3:])}) = {rng.randint(0, 999)}")
        (root / f"doc_{i:02d}.py").write_text("\n".join(body) + "\n")
    return root


def _hf_model_dir(d: Path) -> Path:
    transformers.LlamaConfig(
        vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1,
    ).save_pretrained(d)  # fmt: skip
    return d


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory) -> Path:
    return _write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def trained(corpus_dir, tmp_path_factory) -> tuple[CorpusConfig, Path]:
    """('hf:<dir>' config, tokenizer dir) of a BPE of N ids trained once for the module."""
    run_dir = tmp_path_factory.mktemp("run")
    cfg = prepare_tokenizer(CorpusConfig(source=str(corpus_dir), tokenizer=f"bpe:{N}"), run_dir)
    return cfg, run_dir / "tokenizer"


# ------------------------------------------------------------------ specs and 'auto'


def test_spec_validation():
    assert CorpusConfig().tokenizer == "auto"
    for ok in ("auto", "byte", "hf:some/dir", "bpe:260", "bpe:2048", "bpe:1000000"):
        assert CorpusConfig(tokenizer=ok).tokenizer == ok
    for bad in ("bpe:259", "bpe:1000001", "bpe:", "bpe:2k", "bpe:-300", "bpe", "hf:", "hf: ", "gpt2", 3):
        with pytest.raises(ValueError, match="tokenizer"):
            CorpusConfig(tokenizer=bad)
    with pytest.raises(ConfigError, match=r"\[data\].*260 <= N <= 1_000_000"):
        config_from_dict({"data": {"tokenizer": "bpe:12"}})


def test_auto_is_byte_for_flexorch_decoder():
    assert TrainConfig().data.tokenizer == "byte"
    cfg = config_from_dict({})
    assert cfg.data.tokenizer == "byte" and cfg.to_dict()["data"]["tokenizer"] == "byte"
    bpe = {"model": {"vocab_size": 300}, "data": {"tokenizer": "bpe:300"}}
    assert config_from_dict(bpe).data.tokenizer == "bpe:300"
    assert get_tokenizer("auto").name == "byte"  # outside a run, with no model to ask
    # a saved config read back keeps its resolved spec
    assert config_from_dict(cfg.to_dict()).data.tokenizer == "byte"


def test_auto_uses_the_hf_model_directory_tokenizer(tmp_path, trained):
    d = _hf_model_dir(tmp_path / "model")
    for f in trained[1].iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    cfg = config_from_dict({"model": {"hf": str(d)}})
    assert cfg.model.hf == str(d.resolve()) and cfg.data.tokenizer == f"hf:{cfg.model.hf}"
    tok = get_tokenizer(cfg.data.tokenizer)
    assert tok.vocab_size == N <= cfg.model.vocab_size and tok.encode(b"def f")[0] == 0
    assert config_from_dict(cfg.to_dict()).data.tokenizer == cfg.data.tokenizer


def test_auto_without_tokenizer_files_is_a_clear_error(tmp_path):
    d = _hf_model_dir(tmp_path / "model")
    with pytest.raises(ConfigError, match=r"has none.*'bpe:N'.*model.vocab_size = 512.*'byte'"):
        config_from_dict({"model": {"hf": str(d)}})
    for spec in ("byte", "bpe:512"):  # an explicit spec needs no tokenizer files in the model directory
        assert config_from_dict({"model": {"hf": str(d)}, "data": {"tokenizer": spec}}).data.tokenizer == spec


# ------------------------------------------------------------------ hf:<dir>, never a download


def test_hf_missing_path_and_hub_id_never_download(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        get_tokenizer(f"hf:{tmp_path / 'nothing'}")
    with pytest.raises(DataError, match=r"never downloads.*hf download org/name --local-dir"):
        get_tokenizer("hf:org/name")
    (tmp_path / "file").write_text("x")
    with pytest.raises(DataError, match="is a file"):
        get_tokenizer(f"hf:{tmp_path / 'file'}")
    with pytest.raises(DataError, match="could not load Hugging Face tokenizer"):
        get_tokenizer(f"hf:{_hf_model_dir(tmp_path / 'model')}")  # a directory without tokenizer files
    with pytest.raises(ValueError, match="prepare_tokenizer"):
        get_tokenizer("bpe:400")  # trained first, never loaded as such


def test_hf_tokenizer_wrapper_loads_local_files_only(monkeypatch, tmp_path):
    calls = []

    class FakeAutoTokenizer:
        bos_token_id = 1

        @classmethod
        def from_pretrained(cls, path, **kwargs):
            calls.append((path, kwargs))
            return cls()

        def __len__(self) -> int:
            return 300

        def __call__(self, text, add_special_tokens=True):
            assert add_special_tokens is False
            return {"input_ids": [ord(c) for c in text]}

    monkeypatch.setitem(sys.modules, "transformers", types.SimpleNamespace(AutoTokenizer=FakeAutoTokenizer))
    tok = HFTokenizer(str(tmp_path))
    assert calls == [(str(tmp_path), {"local_files_only": True})]
    assert tok.name == f"hf:{tmp_path}" and tok.vocab_size == 300
    assert tok.encode("h\u00e9".encode()).tolist() == [1, ord("h"), ord("\u00e9")]


# ------------------------------------------------------------------ bpe:<N>


def test_bpe_trains_vocab_n_with_bos_zero_and_round_trips(trained, capsys):
    cfg, tok_dir = trained
    assert cfg.tokenizer == f"hf:{tok_dir}" and os.path.isabs(tok_dir)
    meta = json.loads((tok_dir / META_FILE).read_text())
    assert meta["spec"] == f"bpe:{N}" and meta["trained_vocab"] == N and meta["sample_documents"] == 12
    assert meta["seconds"] < 30
    tok = get_tokenizer(cfg.tokenizer)
    assert tok.vocab_size == N and tok.bos_id == 0
    text = "def train_step(self, batch) = 42\n    héllo wörld ✓ 数据  \t tabs and  spaces . , ?\n"
    ids = tok.encode(text.encode())
    assert ids.dtype == np.int32 and ids[0] == 0 and (ids[1:] != 0).all() and ids.max() < N
    assert len(ids) < len(text.encode())  # merges learned: fewer tokens than bytes
    assert tok.decode(ids) == text.encode()
    auto = transformers.AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)
    assert len(auto) == N and auto.bos_token_id == 0
    assert auto(text)["input_ids"] == ids.tolist()  # Transformers users get the BOS first as well
    assert auto.decode(auto(text, add_special_tokens=False)["input_ids"]) == text


def test_bpe_training_is_deterministic(corpus_dir, trained, tmp_path):
    again = prepare_tokenizer(CorpusConfig(source=str(corpus_dir), tokenizer=f"bpe:{N}"), tmp_path / "run2")
    first_dir = trained[1]
    assert (first_dir / "tokenizer.json").read_bytes() == (tmp_path / "run2/tokenizer/tokenizer.json").read_bytes()
    sample = "\n".join(p.read_text() for p in sorted(corpus_dir.iterdir())[:2]).encode()
    a, b = get_tokenizer(trained[0].tokenizer), get_tokenizer(again.tokenizer)
    assert a.encode(sample).tolist() == b.encode(sample).tolist()


def test_bpe_reused_on_resume_and_mismatch_is_an_error(corpus_dir, trained, capsys):
    cfg, tok_dir = trained
    run_dir = tok_dir.parent
    before = (tok_dir / "tokenizer.json").stat().st_mtime_ns
    capsys.readouterr()
    spec = CorpusConfig(source=str(corpus_dir), tokenizer=f"bpe:{N}")
    assert prepare_tokenizer(spec, run_dir) == cfg
    assert (tok_dir / "tokenizer.json").stat().st_mtime_ns == before and "trained" not in capsys.readouterr().err
    with pytest.raises(DataError, match=rf"trained for 'bpe:{N}'.*asks for 'bpe:500'"):
        prepare_tokenizer(CorpusConfig(source=str(corpus_dir), tokenizer="bpe:500"), run_dir)
    other = CorpusConfig(source=str(corpus_dir), tokenizer="byte")
    assert prepare_tokenizer(other, run_dir) is other  # other specs pass through


def test_bpe_dir_not_ours_is_an_error(corpus_dir, tmp_path):
    (tmp_path / "tokenizer").mkdir()
    with pytest.raises(DataError, match="no tokenizer flexorch trained"):
        prepare_tokenizer(CorpusConfig(source=str(corpus_dir), tokenizer=f"bpe:{N}"), tmp_path)


def test_bpe_prints_one_line(corpus_dir, tmp_path, capsys):
    prepare_tokenizer(CorpusConfig(source=str(corpus_dir), tokenizer="bpe:300"), tmp_path)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "trained tokenizer bpe:300" in err[0] and "300 ids" in err[0] and " s " in err[0]


def test_sample_is_bounded_and_in_listing_order(corpus_dir, tmp_path):
    docs, n, source = sample_documents(CorpusConfig(source=str(corpus_dir)), budget=5000)
    files = sorted(corpus_dir.iterdir())
    assert source == str(corpus_dir) and n == 5000 == sum(len(d.encode()) for d in docs)
    assert docs[0] == files[0].read_text() and files[len(docs) - 1].read_text().startswith(docs[-1])
    jl = tmp_path / "docs.jsonl"
    jl.write_text("\n".join(json.dumps({"text": f"record {i} ✓"}) for i in range(5)) + "\nnot json\n")
    docs, n, _ = sample_documents(CorpusConfig(source=str(jl)), budget=1 << 20)
    assert docs == [f"record {i} ✓" for i in range(5)]
    empty = tmp_path / "bin"
    empty.mkdir()
    (empty / "x.bin").write_bytes(b"\0\1\2")
    with pytest.raises(DataError, match="no UTF-8 text"):
        prepare_tokenizer(CorpusConfig(source=str(empty), tokenizer="bpe:300"), tmp_path / "run")


# ------------------------------------------------------------------ the driver


def test_driver_trains_before_loading_and_checks_vocab(corpus_dir, tmp_path, monkeypatch):
    """setup() trains 'bpe:N', loads the corpus with 'hf:<run_dir>/tokenizer', and refuses a vocabulary larger than
    the model's before any worker starts (no Ray: load_corpus is replaced by one that builds the tokenizer and
    reports one id more than it has, as a tokenizer directory larger than the model would)."""
    seen = []

    def fake_load_corpus(data, publish=None):
        tok = get_tokenizer(data.tokenizer)
        seen.append(data.tokenizer)
        return types.SimpleNamespace(vocab_size=tok.vocab_size + 1, tokenizer_name=tok.name)

    monkeypatch.setattr(run_setup, "load_corpus", fake_load_corpus)  # the driver reads its data at setup
    run_dir = tmp_path / "run"
    data = {"source": str(corpus_dir), "tokenizer": f"bpe:{N}"}
    d = TrainingDriver({"run_dir": str(run_dir), "model": {"vocab_size": N}, "data": data})
    with pytest.raises(ConfigError, match=rf"has {N + 1} ids but model.vocab_size={N}; raise model.vocab_size"):
        d.setup()
    assert seen == [f"hf:{os.path.abspath(run_dir)}/tokenizer"] and d.cfg.data.tokenizer == seen[0]
    assert (run_dir / "tokenizer" / META_FILE).is_file()


@pytest.mark.slow
def test_driver_vocab_check_with_a_real_corpus(corpus_dir, tmp_path, ray_cluster):
    """A tokenizer directory larger than the model's embedding (here a BPE of 300 ids for the 257-id default model)
    is refused after the corpus is tokenized, before any worker starts."""
    spec = prepare_tokenizer(CorpusConfig(source=str(corpus_dir), tokenizer="bpe:300"), tmp_path / "tok").tokenizer
    d = TrainingDriver({"run_dir": str(tmp_path / "run"), "data": {"source": str(corpus_dir), "tokenizer": spec}})
    with pytest.raises(ConfigError, match=r"has 300 ids but model.vocab_size=257"):
        d.setup()
    assert d.corpus.tokenizer_name == d.cfg.data.tokenizer == f"hf:{os.path.abspath(tmp_path / 'tok')}/tokenizer"
    assert d.corpus.stats["files"] == 12 and d.corpus.get_tokens([0])[0][0] == 0  # BOS <s> = 0


def test_a_bpe_vocabulary_larger_than_the_model_and_relative_hf_paths(tmp_path, monkeypatch):
    from flexorch.config import ConfigError, config_from_dict

    with pytest.raises(ConfigError, match=r"'bpe:4096' trains 4096 ids but the model's embedding has vocab_size = 257"):
        config_from_dict({"data": {"tokenizer": "bpe:4096"}})
    (tmp_path / "tok").mkdir()
    monkeypatch.chdir(tmp_path)
    cfg = config_from_dict({"data": {"tokenizer": "hf:tok"}})
    assert cfg.data.tokenizer == f"hf:{(tmp_path / 'tok').resolve()}"


def test_encode_gives_transformers_own_ids_with_special_tokens_in_the_text(tmp_path):
    from tests.chat_helpers import chat_tokenizer_dir

    tok_dir = chat_tokenizer_dir(tmp_path / "tok")
    ours = get_tokenizer(f"hf:{tok_dir}")
    auto = transformers.AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)
    specials = " ".join(auto.all_special_tokens)
    for text in ["plain words", f"a {specials} b", "héllo wörld ✓ 数据\n\t x", "", "<|im_start|>user\nhi<|im_end|>"]:
        want = auto(text, add_special_tokens=False)["input_ids"]
        bos = [auto.bos_token_id] if auto.bos_token_id is not None else []
        assert ours.encode(text.encode()).tolist() == bos + want, text
