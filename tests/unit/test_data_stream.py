"""Document stream (epoch-exact seeded batches, resume) and tokenizers: pure, fast, no Ray."""

from __future__ import annotations

import importlib.util
import itertools
import json

import numpy as np
import pytest

from flexorch.data.errors import DataError
from flexorch.data.feistel import derive_key, feistel_permute
from flexorch.data.stream import Batch, DocumentStream
from flexorch.data.tokenizer import ByteTokenizer, get_tokenizer

_STATE_FIELDS = ("seed", "epoch", "position", "step", "num_docs", "batch_size")


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
    feistel = DocumentStream(100, 8, seed=1).permutation(4)
    assert np.array_equal(feistel, feistel_permute(np.arange(100), 100, derive_key(1, 4)))
    legacy = DocumentStream(100, 8, seed=1, order="rng").permutation(4)  # the order of states saved before "order"
    assert np.array_equal(legacy, np.random.default_rng([1, 4]).permutation(100))


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
    assert set(state) == {"seed", "epoch", "position", "step", "num_docs", "batch_size", "order"}
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


# --- the Feistel epoch order (flexorch.data.feistel): O(batch) per batch, legacy "rng" order for old states ---

PINNED_FEISTEL_0 = (801, 408, 580, 832, 721, 787, 253, 226)
PINNED_FEISTEL_1 = (656469273, 980326433, 419307290, 557370087, 532173164, 834557100, 764090899, 730699566)
SIZES = (1, 2, 3, 5, 7, 64, 100, 1000, 4097, 10**5 + 3)
BATCHES = (1, 3, 64, 1000, 4096)
SEEDS = (0, 1, 12345, -7, 2**40 + 3)


def _cases(max_batches: int = 256):
    """(N, batch_size) pairs, leaving out those with more than `max_batches` batches per epoch (slow, nothing new)."""
    cases = [(n, b) for n in SIZES for b in BATCHES if -(-n // b) <= max_batches]
    # the largest N is slow (seconds a case) and finds nothing the smaller ones miss
    return [pytest.param(n, b, marks=pytest.mark.slow) if n > 10**5 else (n, b) for n, b in cases]


@pytest.mark.parametrize("n", list(range(1, 130)) + [255, 256, 257, 4097, 65536, 10**5 + 3])
def test_feistel_is_a_bijection_of_range_n(n):
    for key in (0, 1, derive_key(3, 0), derive_key(3, 1), 2**64 - 1):
        ids = feistel_permute(np.arange(n), n, key)
        assert ids.dtype == np.int64 and ids.shape == (n,)
        assert np.array_equal(np.sort(ids), np.arange(n))
        assert np.array_equal(feistel_permute(np.arange(n), n, key), ids)  # a function of (n, key) only


@pytest.mark.slow
def test_feistel_small_domains_reach_every_order_and_keys_matter():
    for n in (2, 3, 5):
        keys = [derive_key(s, 0) for s in range(2000 if n == 5 else 60)]
        orders = {tuple(feistel_permute(np.arange(n), n, k).tolist()) for k in keys}
        assert len(orders) == len(list(itertools.permutations(range(n))))  # 2, 6, 120: every order is reachable
    assert feistel_permute(np.arange(1), 1, 42).tolist() == [0]
    a, b = (feistel_permute(np.arange(1000), 1000, derive_key(0, e)) for e in (0, 1))
    assert not np.array_equal(a, b) and not np.array_equal(a, np.arange(1000))


def test_feistel_slices_shapes_and_bad_input():
    n, key = 10**5 + 3, derive_key(5, 2)
    whole = feistel_permute(np.arange(n), n, key)
    assert np.array_equal(feistel_permute(np.arange(500, 900), n, key), whole[500:900])
    assert np.array_equal(feistel_permute(np.array([[7, 8], [n - 1, 0]]), n, key), whole[[[7, 8], [n - 1, 0]]])
    assert int(feistel_permute(np.int64(9), n, key)) == whole[9]
    assert feistel_permute(np.zeros(0, dtype=np.int64), n, key).shape == (0,)
    with pytest.raises(ValueError, match="0 .. 9"):
        feistel_permute(np.array([3, 10]), 10, key)
    with pytest.raises(ValueError, match="0 .. 9"):
        feistel_permute(np.array([-1]), 10, key)
    with pytest.raises(ValueError, match="n must"):
        feistel_permute(np.array([0]), 0, key)
    with pytest.raises(ValueError, match="integers"):
        feistel_permute(np.array([0.5]), 10, key)
    assert derive_key(1, 2) != derive_key(2, 1) and derive_key(-1, 0) == derive_key(2**64 - 1, 0)
    assert 0 <= derive_key(-(2**70), 3) < 2**64


@pytest.mark.parametrize(("n", "batch"), _cases())
def test_feistel_stream_every_document_once_per_epoch_and_batches_are_the_epoch_order(n, batch):
    for seed in SEEDS[:3]:
        s = DocumentStream(n, batch, seed)
        assert s.order == "feistel" and s.state_dict()["order"] == "feistel"
        ledger = _ledger(s, 2)
        for epoch, ids in enumerate(ledger):
            assert sorted(ids) == list(range(n))
            # the batches are consecutive slices of the epoch's order, a function of (seed, epoch) only
            assert ids == DocumentStream(n, 7, seed).permutation(epoch).tolist()
        if n >= 64:
            assert ledger[0] != ledger[1]  # each epoch is a fresh permutation


@pytest.mark.parametrize("n", SIZES)
def test_feistel_epochs_and_seeds_differ(n):
    s = DocumentStream(n, 4, seed=3)
    orders = {tuple(s.permutation(e).tolist()) for e in range(12)}
    assert len(orders) == 1 if n == 1 else len(orders) > 1  # n = 2 has only two orders, both are taken
    if n >= 7:
        assert len(orders) == 12  # twelve epochs, twelve different orders
        perms = [DocumentStream(n, 4, seed).permutation(0).tolist() for seed in SEEDS]
        assert len({tuple(p) for p in perms}) == len(SEEDS)
    if n >= 64:  # not the identity, nor a rotation of it
        p = s.permutation(0)
        assert not np.array_equal(np.diff(p) % n, np.full(n - 1, (p[1] - p[0]) % n))


@pytest.mark.parametrize(("n", "batch"), _cases())
@pytest.mark.parametrize("order", ["feistel", "rng"])
def test_resume_mid_epoch_gives_the_exact_continuation(n, batch, order):
    bpe = -(-n // batch)
    seeds = [s for s in SEEDS if s >= 0 or order == "feistel"]  # numpy's rng (legacy order) takes no negative seed
    for seed, cut in zip(itertools.cycle(seeds), sorted({0, 1, bpe // 2, bpe - 1, bpe, bpe + 1, 2 * bpe - 1})):
        ref = DocumentStream(n, batch, seed, order=order)
        for _ in range(cut):
            ref.next_batch()
        state = json.loads(json.dumps(ref.state_dict()))
        assert state["order"] == order
        after = ref.peek_after()
        expected = [ref.next_batch() for _ in range(min(bpe + 2, 40))]
        assert after == expected[1]
        resumed = DocumentStream(n, batch, seed=999, order="rng" if order == "feistel" else "feistel")
        resumed.load_state_dict(state)  # the saved seed and order win
        assert resumed.order == order and resumed.peek_after() == after
        assert [resumed.next_batch() for _ in range(len(expected))] == expected


def test_peek_after_does_not_advance_and_rolls_over():
    s = DocumentStream(10, 4, seed=5)
    for _ in range(7):
        state, p, pa = s.state_dict(), s.peek(), s.peek_after()
        assert s.state_dict() == state and pa.step == p.step + 1
        assert s.next_batch() == p and s.peek() == pa


def test_legacy_state_without_order_resumes_the_rng_order():
    """A state saved before the Feistel order (no "order" key) continues exactly as the old stream would have."""
    n, batch, seed = 23, 5, 7

    def old_stream_batches(epochs: int) -> list[tuple[int, ...]]:  # the pre-Feistel stream, written out
        out = []
        for e in range(epochs):
            perm = np.random.default_rng([seed, e]).permutation(n)
            out += [tuple(int(i) for i in perm[p : p + batch]) for p in range(0, n, batch)]
        return out

    old = old_stream_batches(4)
    legacy_state = {"seed": seed, "epoch": 1, "position": 10, "step": 7, "num_docs": n, "batch_size": batch}
    s = DocumentStream(n, batch, seed=0)  # a new run's default is "feistel"; the state's (absent) order wins
    s.load_state_dict(json.loads(json.dumps(legacy_state)))
    assert s.order == "rng" and s.state_dict() == legacy_state | {"order": "rng"}
    assert s.peek_after().doc_ids == old[8]
    got = [s.next_batch() for _ in range(8)]  # across the end of epoch 1 into epochs 2 and 3: still the old order
    assert [b.doc_ids for b in got] == old[7:15] and [b.step for b in got] == list(range(7, 15))
    again = DocumentStream(n, batch, seed=0)  # a later resume from the new state keeps the legacy order
    again.load_state_dict(json.loads(json.dumps(s.state_dict())))
    assert again.order == "rng" and [again.next_batch().doc_ids for _ in range(5)] == old[15:20]
    pinned = DocumentStream(100, 8, seed=1, order="rng")
    assert np.array_equal(pinned.permutation(4), np.random.default_rng([1, 4]).permutation(100))


def test_feistel_order_is_pinned():
    """Checkpoints resume by (seed, epoch, position): a change to the Feistel order would silently reorder a resumed
    run's data, so its first ids are pinned here (update only with a new order name)."""
    assert DocumentStream(1000, 8, seed=0).peek().doc_ids == PINNED_FEISTEL_0
    assert DocumentStream(10**9, 8, seed=1).peek().doc_ids == PINNED_FEISTEL_1


def test_unknown_order_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown stream order 'shuffle'"):
        DocumentStream(10, 2, order="shuffle")
    state = DocumentStream(10, 2).state_dict()
    s = DocumentStream(10, 2)
    with pytest.raises(ValueError, match="unknown stream order 'perm'"):
        s.load_state_dict(state | {"order": "perm"})
    assert s.state_dict() == state  # nothing changed


def test_state_is_a_handful_of_ints_even_for_a_billion_documents():
    s = DocumentStream(10**9, 512, seed=2**63 - 1)
    first = s.next_batch()
    assert len(first) == 512 and len(set(first.doc_ids)) == 512 and 0 <= min(first.doc_ids)
    assert max(first.doc_ids) < 10**9 and s.peek_after().index_in_epoch == 2
    state = s.state_dict() | {"epoch": 10**6, "step": 10**12}
    text = json.dumps(state)
    assert len(text.encode()) < 1024 and set(state) == {*_STATE_FIELDS, "order"}
    assert all(isinstance(v, int) for k, v in state.items() if k != "order")


def test_task_streams_pass_each_task_order_through():
    from types import SimpleNamespace

    from flexorch.data.task_corpus import TaskStreams

    corpus = SimpleNamespace(task_of=np.array([0] * 10 + [1] * 3, dtype=np.int32), task_names=("big", "small"))
    streams = TaskStreams(corpus, (4, 1), seed=7)
    for _ in range(3):
        streams.next_batch()
    state = json.loads(json.dumps(streams.state_dict()))
    assert {t["order"] for t in state["tasks"].values()} == {"feistel"}
    again = TaskStreams(corpus, (4, 1), seed=7)
    again.load_state_dict(state)
    assert again.peek() == streams.peek() and again.peek_after() == streams.peek_after()
    # a state saved before orders existed: every task continues in the legacy order
    legacy = {"step": 3, "tasks": {n: {k: v for k, v in t.items() if k != "order"} for n, t in state["tasks"].items()}}
    old = TaskStreams(corpus, (4, 1), seed=7)
    old.load_state_dict(legacy)
    assert {t["order"] for t in old.state_dict()["tasks"].values()} == {"rng"}
    big = np.random.default_rng([7, 1]).permutation(10)  # task 0 keeps the run's seed; 3 batches of 4 = epoch 1
    assert old.next_batch().doc_ids[:4] == tuple(int(i) for i in big[:4])


def test_every_stream_kind_answers_the_one_stream_interface_and_open_stream_picks_it():
    """Plain, mixture and task streams are ``BatchStream``s: the per-kind members answer None where they do not
    apply, so the driver reads any of them the same way; ``open_stream`` picks the kind from the config."""
    from types import SimpleNamespace

    from flexorch.data.mixture import MixtureStream
    from flexorch.data.run_stream import open_stream
    from flexorch.data.stream import BatchStream
    from flexorch.data.task_corpus import TaskStreams

    lengths = np.arange(1, 14)
    tasks = SimpleNamespace(task_of=np.array([0] * 10 + [1] * 3, dtype=np.int32), task_names=("big", "small"))
    mixed = SimpleNamespace(num_docs=13, mixture=(("a", "b"), [10, 3], [0.75, 0.25]))

    def cfg(tasks=(), sources=()):
        data = SimpleNamespace(sources=sources)
        return SimpleNamespace(tasks=tasks, data=data, task_counts=(4, 1), batch_size=4, seed=7)

    plain = open_stream(cfg(), SimpleNamespace(num_docs=13))
    mixture = open_stream(cfg(sources=("a", "b")), mixed)
    task = open_stream(cfg(tasks=("big", "small")), tasks)
    assert (type(plain), type(mixture), type(task)) == (DocumentStream, MixtureStream, TaskStreams)
    assert plain.state_dict() == DocumentStream(13, 4, 7).state_dict()
    assert mixture.state_dict() == MixtureStream([10, 3], [0.75, 0.25], 4, 7, ("a", "b")).state_dict()
    for stream in (plain, mixture, task):
        assert isinstance(stream, BatchStream) and stream.batches_per_epoch >= 1
        batch = stream.peek()
        assert stream.peek_after().step == batch.step + 1 and stream.next_batch() == batch
        again = type(stream).__new__(type(stream))
        again.__dict__.update(stream.__dict__)  # the same configuration, then the saved position
        again.load_state_dict(json.loads(json.dumps(stream.state_dict())))
        assert again.peek() == stream.peek()
    assert (
        plain.task_epochs() is None and mixture.task_epochs() is None and task.task_epochs() == {"big": 0, "small": 0}
    )
    assert plain.sources(batch, lengths) is None and task.sources(batch, lengths) is None
    got = mixture.sources(mixture.peek(), lengths)
    assert set(got) == {"a", "b"} and sum(s["docs"] for s in got.values()) == 4
    with pytest.raises(TypeError):
        BatchStream()
