"""Data: what is trained on, and in which order.

* :mod:`~flexorch.data.store`: a corpus prepared once, in parallel, into memory-mapped token blocks with an index and
  a manifest (``prepare``: the Ray Data job; ``blocks``: what workers read; ``remote``: ``s3://`` and ``gs://``).
* :mod:`~flexorch.data.readers`: records -> tokenized, split documents and their index (what a prepare runs).
* :mod:`~flexorch.data.listing`: which files a source holds, and their format (no Ray).
* :mod:`~flexorch.data.source_records`: a source's records: JSONL lines parsed, texts, malformed-record errors.
* :mod:`~flexorch.data.corpus`: a corpus opened from its store (lengths, keys, block specs; nothing per document).
* :mod:`~flexorch.data.stream`: the seeded epoch order (a keyed Feistel bijection, :mod:`~flexorch.data.feistel`),
  every document exactly once, with a resumable position of a few integers.
* :mod:`~flexorch.data.mixture`: ``[[data.sources]]``: batches blended from several corpora by weight.
* :mod:`~flexorch.data.tokenizer`: the byte tokenizer (Hugging Face tokenizers optional).
* :mod:`~flexorch.data.lengths`: length files for ``flexorch plan`` (a Wikipedia sample is bundled).
"""
