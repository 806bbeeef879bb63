"""A mixture of prepared corpora (``[[data.sources]]`` with weights): each global batch draws its documents from
the sources in those proportions, exactly and reproducibly, and each source keeps its own epochs.

Blending rule (Megatron-Core's ``BlendedDataset``, ``megatron/core/datasets/helpers.cpp`` ``build_blending_
indices``): document slot k of the run goes to the source with the largest sampling error
``weight_s * (k + 1) - taken_s``, ties to the lower index. So after any number of documents, every source's
count is within one of ``weight_s * k``, and a batch of B documents takes ``weight_s * B`` of source s to within
one. The state is the counts taken so far (one integer per source) plus each source's position in its own
epoch-order (a keyed Feistel permutation of its documents, ``flexorch.data.feistel``): a few integers, however
large the sources.

The combined :class:`~flexorch.data.corpus.Corpus` is a view: document ids of source s are
``first[s] .. first[s] + n_s - 1``; the per-document arrays index the sources' own memory-mapped arrays
(:class:`IdRanges`), so nothing is concatenated or copied.

Pure numpy: no Ray.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from flexorch.data.doc_keys import DocKeys
from flexorch.data.feistel import derive_key, feistel_permute
from flexorch.data.stream import Batch, BatchStream

__all__ = [
    "IdRanges",
    "MixtureStream",
    "blend_counts",
    "combine_sources",
    "load_mixture",
    "mixture_tokenizer",
]


class IdRanges:
    """One read-only per-document array over several sources' arrays, each shifted by ``add[s]`` (block indices)."""

    def __init__(self, arrays: Sequence, add: Sequence[int] | None = None):
        self.arrays = list(arrays)
        self.first = np.concatenate([[0], np.cumsum([len(a) for a in self.arrays])]).astype(np.int64)
        self.add = list(add) if add is not None else [0] * len(self.arrays)
        self.dtype = np.result_type(*[np.asarray(a[:0]).dtype for a in self.arrays], np.int64 if any(self.add) else 0)

    def __len__(self) -> int:
        return int(self.first[-1])

    def __getitem__(self, ids):
        if isinstance(ids, slice):
            ids = np.arange(*ids.indices(len(self)))
        scalar = np.ndim(ids) == 0
        ids = np.atleast_1d(np.asarray(ids, dtype=np.int64))
        if ids.size and (ids.min() < 0 or ids.max() >= len(self)):
            raise IndexError(f"document id out of range 0..{len(self) - 1}")
        src = np.searchsorted(self.first, ids, side="right") - 1
        out = np.empty(ids.shape, dtype=self.dtype)
        for s in np.unique(src):
            m = src == s
            out[m] = np.asarray(self.arrays[s][ids[m] - self.first[s]]) + self.add[s]
        return out[0] if scalar else out

    def __array__(self, dtype=None, copy=None):
        out = np.concatenate([np.asarray(a) + k for a, k in zip(self.arrays, self.add, strict=True)])
        return out.astype(dtype) if dtype is not None else out

    def sum(self) -> int:
        return int(sum(int(np.asarray(a).sum()) + k * len(a) for a, k in zip(self.arrays, self.add, strict=True)))


def combine_sources(corpora, names: Sequence[str]):
    """One corpus over the sources' corpora (a view, see the module doc) with ``stats["sources"]``."""
    from flexorch.data.corpus import Corpus

    corpora, names = list(corpora), tuple(names)
    tok = {c.tokenizer_name for c in corpora}
    if len(tok) > 1:
        raise ValueError(f"the sources were tokenized differently ({sorted(tok)}); a mixture shares one tokenizer")
    blocks_before = np.cumsum([0] + [len(c.blocks) for c in corpora])[:-1]
    masked = any(c.targets is not None for c in corpora)
    targets = [c.targets if c.targets is not None else _minus_one(c.lengths) for c in corpora]
    stats: dict = {"sources": {n: c.stats for n, c in zip(names, corpora, strict=True)}}
    for key in ("documents", "tokens", "records", "split_docs", "bad_records", "skipped_binary", "skipped_empty"):
        stats[key] = sum(int(c.stats.get(key, 0)) for c in corpora)
    stats["source"] = ", ".join(f"{n}: {c.stats.get('source')}" for n, c in zip(names, corpora, strict=True))
    stats["max_doc_tokens"] = max(int(c.stats.get("max_doc_tokens", 0)) for c in corpora)
    return Corpus(
        keys=_MixedKeys([c.keys for c in corpora], names),
        lengths=IdRanges([c.lengths for c in corpora]),
        doc_blocks=IdRanges([c.doc_blocks for c in corpora], [int(b) for b in blocks_before]),
        doc_offsets=IdRanges([c.doc_offsets for c in corpora]),
        blocks=[s for c in corpora for s in c.blocks],
        stats=stats,
        tokenizer_name=corpora[0].tokenizer_name,
        vocab_size=max(c.vocab_size for c in corpora),
        targets=IdRanges(targets) if masked else None,
    )


class _minus_one:
    """``lengths - 1`` per document without materialising it (plain text: every token after the first)."""

    def __init__(self, lengths):
        self.lengths = lengths

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, ids):
        return np.asarray(self.lengths[ids]) - 1


class _MixedKeys(DocKeys):
    """``name/key`` of each document of a mixture, formatted on demand."""

    def __init__(self, keys: list, names: Sequence[str]):
        self.keys, self.names, self.fmt = keys, list(names), "mixture"
        self.first = np.concatenate([[0], np.cumsum([len(k) for k in keys])]).astype(np.int64)

    def __len__(self) -> int:
        return int(self.first[-1])

    def _key(self, j: int) -> str:
        s = int(np.searchsorted(self.first, j, side="right") - 1)
        return f"{self.names[s]}/{self.keys[s][j - int(self.first[s])]}"


def blend_counts(weights: Sequence[float], taken: Sequence[int], k: int) -> np.ndarray:
    """How many of the next ``k`` document slots go to each source under the blending rule (module doc), given
    the counts ``taken`` so far."""
    w = np.asarray(weights, dtype=np.float64)
    w = w / w.sum()
    taken = np.asarray(taken, dtype=np.int64).copy()
    start = int(taken.sum())
    out = np.zeros(len(w), dtype=np.int64)
    for slot in range(start, start + k):
        s = int(np.argmax(w * (slot + 1) - taken))
        taken[s] += 1
        out[s] += 1
    return out


class MixtureStream(BatchStream):
    """A :class:`~flexorch.data.stream.BatchStream` over a mixture: batches of ``batch_size`` documents,
    ``blend_counts`` of each source, each source read in its own seeded epoch order (``derive_key(seed_s, epoch)``)."""

    def __init__(self, sizes: Sequence[int], weights: Sequence[float], batch_size: int, seed: int = 0, names=()):
        if len(sizes) != len(weights) or not sizes or min(sizes) < 1 or min(weights) <= 0:
            raise ValueError(f"need a size >= 1 and a weight > 0 per source, got sizes {sizes}, weights {weights}")
        self.sizes = [int(n) for n in sizes]
        self.weights = [float(w) for w in weights]
        self.first = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)
        self.names = tuple(names) or tuple(f"source{s}" for s in range(len(sizes)))
        self.batch_size, self.seed = int(batch_size), int(seed)
        self.step = 0
        self.taken = [0] * len(sizes)  # documents drawn from each source so far (the blending state)
        self.epoch = [0] * len(sizes)
        self.position = [0] * len(sizes)

    @classmethod
    def for_corpus(cls, corpus, batch_size: int, seed: int = 0) -> MixtureStream:
        """The stream over a corpus :func:`load_mixture` built."""
        names, sizes, weights = corpus.mixture
        return cls(sizes, weights, batch_size, seed, names)

    @property
    def batches_per_epoch(self) -> int:
        """Batches until the source that takes longest to see all its documents once has (informational)."""
        w = np.asarray(self.weights) / sum(self.weights)
        return int(max(np.ceil(n / (wi * self.batch_size)) for n, wi in zip(self.sizes, w, strict=True)))

    def _seed(self, s: int) -> int:
        return self.seed + 1_000_033 * s

    def _draw(self, state: dict) -> tuple[Batch, dict]:
        counts = blend_counts(self.weights, state["taken"], self.batch_size)
        ids, state = [], {k: list(v) if isinstance(v, list) else v for k, v in state.items()}
        for s, k in enumerate(counts):
            k = int(k)
            while k:
                n, pos = self.sizes[s], state["position"][s]
                take = min(k, n - pos)
                order = feistel_permute(np.arange(pos, pos + take), n, derive_key(self._seed(s), state["epoch"][s]))
                ids.extend(int(self.first[s]) + order)
                pos += take
                k -= take
                if pos == n:
                    state["epoch"][s], pos = state["epoch"][s] + 1, 0
                state["position"][s] = pos
            state["taken"][s] += int(counts[s])
        lead = int(np.argmax(self.weights))
        batch = Batch(
            epoch=state["epoch"][lead],
            index_in_epoch=state["step"],
            step=state["step"],
            doc_ids=tuple(int(i) for i in ids),
        )
        state["step"] += 1
        return batch, state

    def _state(self) -> dict:
        return {
            "step": self.step,
            "taken": list(self.taken),
            "epoch": list(self.epoch),
            "position": list(self.position),
        }

    def peek(self) -> Batch:
        return self._draw(self._state())[0]

    def peek_after(self) -> Batch:
        _, after = self._draw(self._state())
        return self._draw(after)[0]

    def next_batch(self) -> Batch:
        batch, state = self._draw(self._state())
        self.step, self.taken, self.epoch, self.position = (
            state["step"],
            state["taken"],
            state["epoch"],
            state["position"],
        )
        return batch

    def sources(self, batch: Batch, lengths) -> dict:
        """``{name: {"docs", "tokens", "epoch"}}`` of a batch (what the step record says came from each source)."""
        ids = np.asarray(batch.doc_ids, dtype=np.int64)
        src = np.searchsorted(self.first, ids, side="right") - 1
        lens = np.asarray(lengths[ids]) if len(ids) else np.zeros(0, np.int64)
        return {
            n: {"docs": int((src == s).sum()), "tokens": int(lens[src == s].sum()), "epoch": int(self.epoch[s])}
            for s, n in enumerate(self.names)
        }

    def state_dict(self) -> dict:
        """A few integers: ``{"mixture": names, "sizes", "weights", "seed", "batch_size", "step", "taken", "epoch",
        "position"}``."""
        return {
            "mixture": list(self.names),
            "sizes": list(self.sizes),
            "weights": list(self.weights),
            "seed": self.seed,
            "batch_size": self.batch_size,
            **self._state(),
        }

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or "mixture" not in state:
            raise ValueError(
                "the stream state was saved by a run without [[data.sources]]; resume with the run's own [data]"
            )
        for key, mine in (
            ("mixture", list(self.names)),
            ("sizes", self.sizes),
            ("weights", self.weights),
            ("batch_size", self.batch_size),
        ):
            if state[key] != mine:
                raise ValueError(
                    f"the stream state was saved with {key} {state[key]}, this run has {mine}; resume with the same "
                    "[[data.sources]] (the same prepared stores, weights) and batch size"
                )
        self.seed = int(state["seed"])
        self.step, self.taken = int(state["step"]), [int(x) for x in state["taken"]]
        self.epoch, self.position = [int(x) for x in state["epoch"]], [int(x) for x in state["position"]]


def load_mixture(cfg, publish=None, *, parallelism: int | None = None):
    """Each ``[[data.sources]]`` source's corpus (prepared or opened: ``load_corpus``, ``parallelism`` as there),
    combined; its ``mixture`` attribute is (names, sizes, weights) for :class:`MixtureStream`."""
    from flexorch.data.corpus import load_corpus
    from flexorch.data.errors import DataError

    corpora = []
    for i, src in enumerate(cfg.sources):
        say = None
        if publish is not None:
            say = lambda ev, name=src.name: publish({**ev, "message": f"[source {name}] {ev.get('message', '')}"})  # noqa: E731
        try:
            corpora.append(load_corpus(cfg.source_config(i), publish=say, parallelism=parallelism))
        except DataError as e:
            raise DataError(f"[[data.sources]] {src.name!r}: {e}") from None
    names = [s.name for s in cfg.sources]
    corpus = combine_sources(corpora, names)
    corpus.mixture = (names, [c.num_docs for c in corpora], [float(s.weight) for s in cfg.sources])
    return corpus


def mixture_tokenizer(cfg, run_dir):
    """``cfg`` with a ``bpe:N`` tokenizer trained on the first source (or reused from ``run_dir``), shared by all."""
    import dataclasses

    from flexorch.data.bpe import prepare_tokenizer

    spec = prepare_tokenizer(cfg.source_config(0), run_dir).tokenizer
    return cfg if spec == cfg.tokenizer else dataclasses.replace(cfg, tokenizer=spec)
