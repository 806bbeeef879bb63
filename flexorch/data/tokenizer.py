"""Tokenizers for the training data stream: byte-level by default, Hugging Face optional.

`ByteTokenizer` needs nothing: ids 0..255 are the UTF-8 bytes and `BOS = 256` starts every document, so any text
or code trains without a download. `get_tokenizer("hf:<name_or_path>")` wraps `transformers.AutoTokenizer`
(imported only then; it may download the tokenizer files the first time, which is the caller's choice).
Every tokenizer exposes `name`, `vocab_size` and `encode(data: bytes) -> np.ndarray[int32]` (BOS first).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Protocol

import numpy as np

from flexorch.data.lengths import DataError

__all__ = ["Tokenizer", "ByteTokenizer", "HFTokenizer", "get_tokenizer"]


class Tokenizer(Protocol):
    """What the corpus loader needs from a tokenizer."""

    name: str
    vocab_size: int

    def encode(self, data: bytes) -> np.ndarray:
        """Token ids (int32, BOS first) of one document given as UTF-8 bytes."""
        ...


class ByteTokenizer:
    """Byte-level tokenizer: ids 0..255 are the bytes, `BOS = 256` is prepended to every document."""

    BOS = 256
    name = "byte"
    vocab_size = 257

    def encode(self, data: bytes) -> np.ndarray:
        out = np.empty(len(data) + 1, dtype=np.int32)
        out[0] = self.BOS
        out[1:] = np.frombuffer(data, dtype=np.uint8)
        return out

    def decode(self, ids: np.ndarray) -> bytes:
        """The bytes of `ids`, BOS tokens removed (the inverse of `encode`)."""
        ids = np.asarray(ids)
        if ids.size and (ids.min() < 0 or ids.max() > self.BOS):
            raise ValueError(f"byte token ids must lie in 0..{self.BOS}, got {int(ids.min())}..{int(ids.max())}")
        return ids[ids != self.BOS].astype(np.uint8).tobytes()

    def __repr__(self) -> str:
        return "ByteTokenizer()"


class HFTokenizer:
    """A Hugging Face tokenizer (`transformers.AutoTokenizer`); BOS is prepended when the tokenizer has one."""

    def __init__(self, name_or_path: str):
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise DataError(
                f"tokenizer 'hf:{name_or_path}' needs the transformers package: pip install transformers "
                "(or use the default tokenizer 'byte', which needs nothing)"
            ) from None
        try:
            self._tok = AutoTokenizer.from_pretrained(name_or_path)
        except Exception as e:  # noqa: BLE001 - any loading failure becomes one clear message
            raise DataError(
                f"could not load Hugging Face tokenizer {name_or_path!r}: {type(e).__name__}: {e} "
                "(give a local tokenizer directory or a model name on the Hub, or use tokenizer 'byte')"
            ) from e
        self.name = f"hf:{name_or_path}"
        self.vocab_size = len(self._tok)
        self.bos_id = self._tok.bos_token_id

    def encode(self, data: bytes) -> np.ndarray:
        ids = self._tok(data.decode("utf-8"), add_special_tokens=False)["input_ids"]
        if self.bos_id is not None:
            ids = [self.bos_id, *ids]
        return np.asarray(ids, dtype=np.int32)

    def __repr__(self) -> str:
        return f"HFTokenizer({self.name!r})"


@lru_cache(maxsize=8)
def get_tokenizer(spec: str) -> Tokenizer:
    """`"byte"` -> ByteTokenizer; `"hf:<name_or_path>"` -> HFTokenizer (cached per process)."""
    if spec == "byte":
        return ByteTokenizer()
    if spec.startswith("hf:") and len(spec) > 3:
        return HFTokenizer(spec[3:])
    raise ValueError(f"unknown tokenizer {spec!r}: use 'byte' (the default) or 'hf:<name_or_path>'")
