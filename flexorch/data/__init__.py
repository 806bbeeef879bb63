"""Data: what is trained on, and in which order.

* :mod:`~flexorch.data.readers`: Ray Data readers for a directory of text/code files, JSONL and Parquet.
* :mod:`~flexorch.data.listing`: which files a source holds, and their format (no Ray).
* :mod:`~flexorch.data.source_records`: a source's records: JSONL lines parsed, texts, malformed-record errors.
* :mod:`~flexorch.data.corpus`: a loaded corpus (lengths, keys, token blocks in the object store).
* :mod:`~flexorch.data.stream`: the seeded epoch order, every document exactly once, with a resumable position.
* :mod:`~flexorch.data.tokenizer`: the byte tokenizer (Hugging Face tokenizers optional).
* :mod:`~flexorch.data.lengths`: length files for ``flexorch plan`` (a Wikipedia sample is bundled).
"""
