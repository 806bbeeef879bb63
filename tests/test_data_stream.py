"""Document stream (epoch-exact seeded batches, resume) and tokenizers: pure, fast, no Ray."""

from __future__ import annotations

import importlib.util
import itertools
import json

import numpy as np
import pytest

from flexorch.data.lengths import DataError
from flexorch.data.stream import Batch, DocumentStream
from flexorch.data.tokenizer import ByteTokenizer, get_tokenizer


def test_byte_tokenizer_round_trip_and_range():
    tok = get_tokenizer("byte")
    assert isinstance(tok, ByteTokenizer) and tok.name == "byte" and tok.vocab_size == 257
    data = "héllo, wörld\n\tdef f(): return 1 # ✓".encode() + bytes(range(256))
    ids = tok.encode(data)
    assert ids.dtype == np.int32 and ids.shape == (len(data) + 1,)
    assert ids[0] == ByteTokenizer.BOS == 256
    assert ids[1:].min() >= 0 and ids[1:].max() <= 255 and (ids[1:] != 256).all()
    assert tok.decode(ids) == data
    assert tok.encode(b"").tolist() == [256]
    with pytest.raises(ValueError, match="0..256"):
        tok.decode(np.array([257]))


def test_tokenizer_specs():
    with pytest.raises(ValueError, match="'byte'"):
        get_tokenizer("bpe")
    if importlib.util.find_spec("transformers") is None:
        with pytest.raises(DataError, match="pip install transformers"):
            get_tokenizer("hf:gpt2")


def _ledger(stream: DocumentStream, epochs: int) -> list[list[int]]:
    per_epoch: list[list[int]] = [[] for _ in range(epochs)]
    for _ in range(epochs * stream.batches_per_epoch):
        b = stream.next_batch()
        per_epoch[b.epoch].extend(b.doc_ids)
    return per_epoch


def test_every_document_exactly_once_per_epoch_with_partial_last_batch():
    s = DocumentStream(num_docs=23, batch_size=5, seed=7)
    assert s.batches_per_epoch == 5
    sizes, steps = [], []
    for _ in range(3 * 5):
        b = s.next_batch()
        sizes.append(len(b))
        steps.append(b.step)
        assert b.index_in_epoch == b.step % 5 and b.epoch == b.step // 5
    assert sizes == [5, 5, 5, 5, 3] * 3 and steps == list(range(15))
    ledger = _ledger(DocumentStream(23, 5, seed=7), 3)
    for epoch_ids in ledger:
        assert sorted(epoch_ids) == list(range(23))
    assert ledger[0] != ledger[1]  # each epoch is a fresh permutation


def test_batch_size_larger_than_corpus_and_exact_division():
    big = DocumentStream(4, 10, seed=0)
    assert big.batches_per_epoch == 1
    assert [sorted(big.next_batch().doc_ids) for _ in range(2)] == [[0, 1, 2, 3]] * 2
    exact = DocumentStream(12, 4, seed=3)
    assert all(sorted(ids) == list(range(12)) for ids in _ledger(exact, 4))


def test_seed_reproducible_and_different_seed_differs():
    def run(seed: int) -> list[tuple[int, ...]]:
        return [b.doc_ids for b in itertools.islice(DocumentStream(100, 8, seed), 30)]

    assert run(1) == run(1)
    assert run(1) != run(2)
    assert np.array_equal(DocumentStream(100, 8, seed=1).permutation(4), np.random.default_rng([1, 4]).permutation(100))


def test_peek_does_not_advance():
    s = DocumentStream(10, 4, seed=0)
    p1, p2 = s.peek(), s.peek()
    assert p1 == p2 and s.state_dict()["step"] == 0
    assert s.next_batch() == p1
    for _ in range(2):
        s.next_batch()
    assert s.peek().epoch == 1 and s.peek().index_in_epoch == 0 and s.peek() == s.next_batch()


@pytest.mark.parametrize("cut", [0, 1, 3, 4, 5, 9])
def test_resume_from_state_dict_equals_uninterrupted(cut):
    ref = DocumentStream(17, 4, seed=11)
    expected = [ref.next_batch() for _ in range(12)]
    s = DocumentStream(17, 4, seed=11)
    for _ in range(cut):
        s.next_batch()
    state = json.loads(json.dumps(s.state_dict()))  # JSON-able
    assert set(state) == {"seed", "epoch", "position", "step", "num_docs", "batch_size"}
    resumed = DocumentStream(17, 4, seed=999)  # the saved seed wins
    resumed.load_state_dict(state)
    assert [resumed.next_batch() for _ in range(12 - cut)] == expected[cut:]


def test_load_state_rejects_other_corpus_or_batch_size():
    state = DocumentStream(17, 4, seed=0).state_dict()
    with pytest.raises(ValueError, match="corpus of 17 documents"):
        DocumentStream(18, 4).load_state_dict(state)
    with pytest.raises(ValueError, match="batch_size 4"):
        DocumentStream(17, 5).load_state_dict(state)
    with pytest.raises(ValueError, match="lacks"):
        DocumentStream(17, 4).load_state_dict({"seed": 0})
    with pytest.raises(ValueError, match="out of range"):
        DocumentStream(17, 4).load_state_dict(state | {"position": 17})


def test_invalid_stream_arguments():
    with pytest.raises(ValueError, match="num_docs"):
        DocumentStream(0, 4)
    with pytest.raises(ValueError, match="batch_size"):
        DocumentStream(4, 0)
    b = Batch(epoch=0, index_in_epoch=0, step=0, doc_ids=(1, 2))
    with pytest.raises(AttributeError):
        b.step = 1  # frozen
