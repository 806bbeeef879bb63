"""Tokenizers for the training data stream: byte-level by default, Hugging Face tokenizer directories optional.

`ByteTokenizer` needs nothing: ids 0..255 are the UTF-8 bytes and `BOS = 256` starts every document, so any text
or code trains without a download. `get_tokenizer("hf:<dir>")` wraps `transformers.AutoTokenizer` (imported only
then) on a local tokenizer directory, never downloading: a model's own tokenizer, or the byte-level BPE a run
trained on its corpus (`'bpe:<N>'` specs become `'hf:<run_dir>/tokenizer'` in `flexorch.data.bpe`).
Every tokenizer exposes `name`, `vocab_size` and `encode(data: bytes) -> np.ndarray[int32]` (BOS first); for
chat and prompt/completion records (`flexorch.data.record_kinds`) also `bos_id`, `eos_id`, `bos_text` (how BOS
appears in rendered text, or None), `chat_template` (None: flexorch's built-in one is used), `encode_text(str)`
(ids without BOS), `render_chat(messages, add_generation_prompt)` and, for a template with answer marks,
`chat_answer_mask(messages)` (Transformers' `return_assistant_tokens_mask`).
"""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path
from typing import Protocol

import numpy as np

from flexorch.data.errors import DataError

__all__ = ["Tokenizer", "ByteTokenizer", "HFTokenizer", "get_tokenizer"]

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


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
    bos_id, eos_id, bos_text, chat_template = BOS, None, None, None

    def encode_text(self, text: str) -> list[int]:
        """The UTF-8 bytes of ``text`` as ids (no BOS)."""
        return list(text.encode("utf-8", "surrogatepass"))

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
    """A local Hugging Face tokenizer directory (`transformers.AutoTokenizer`, never downloading); BOS is
    prepended when the tokenizer has one."""

    def __init__(self, path: str):
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise DataError(
                f"tokenizer 'hf:{path}' needs the transformers package: pip install transformers "
                "(or use the tokenizer 'byte', which needs nothing)"
            ) from None
        local = Path(path).expanduser()
        if not local.exists():
            if _HUB_ID.match(path) and not path.startswith((".", "~")):
                raise DataError(
                    f"tokenizer 'hf:{path}': no such local directory, and flexorch never downloads; {path!r} looks "
                    f"like a Hugging Face Hub id: fetch it first (`hf download {path} --local-dir "
                    f"tokenizers/{path.split('/')[-1]}`) and set tokenizer = 'hf:<that directory>'"
                )
            raise DataError(
                f"tokenizer 'hf:{path}': directory {path!r} does not exist (relative paths are from {Path.cwd()}); "
                "give a local tokenizer directory (as save_pretrained writes it), or 'byte' or 'bpe:<N>'"
            )
        if not local.is_dir():
            raise DataError(f"tokenizer 'hf:{path}' is a file; give the directory that holds the tokenizer files")
        try:
            self._tok = AutoTokenizer.from_pretrained(str(local), local_files_only=True)
        except Exception as e:  # noqa: BLE001 - any loading failure becomes one clear message
            raise DataError(
                f"could not load Hugging Face tokenizer {path!r}: {type(e).__name__}: {e} "
                "(give a local directory with tokenizer.json or tokenizer_config.json, or use tokenizer 'byte' or "
                "'bpe:<N>')"
            ) from e
        self.name = f"hf:{path}"
        self.vocab_size = len(self._tok)
        self.bos_id = self._tok.bos_token_id
        self.eos_id = getattr(self._tok, "eos_token_id", None)
        self.bos_text = getattr(self._tok, "bos_token", None) if self.bos_id is not None else None
        self.chat_template = getattr(self._tok, "chat_template", None) or None

    def encode_text(self, text: str) -> list[int]:
        """Ids of ``text`` without BOS (special tokens written in the text, e.g. a template's ``<|im_end|>``,
        become their ids)."""
        return list(self._tok(text, add_special_tokens=False)["input_ids"])

    def render_chat(self, messages: list[dict], add_generation_prompt: bool) -> str:
        """``messages`` rendered as text with the tokenizer's own chat template (Transformers'
        ``apply_chat_template``, not tokenized)."""
        return self._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    def chat_answer_mask(self, messages: list[dict]) -> tuple[list[int], list[int]]:
        """``messages`` rendered and tokenized whole (no BOS added) with Transformers' ``assistant_masks``: 1 on
        each token that overlaps the template's ``{% generation %}`` marks (``return_assistant_tokens_mask``)."""
        out = self._tok.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        return list(out["input_ids"]), list(out["assistant_masks"])

    def encode(self, data: bytes) -> np.ndarray:
        text = data.decode("utf-8")
        fast = getattr(self._tok, "backend_tokenizer", None)  # the same ids without Transformers' per-call wrapping
        ids = (
            fast.encode(text, add_special_tokens=False).ids
            if fast is not None
            else self._tok(text, add_special_tokens=False)["input_ids"]
        )
        if self.bos_id is not None:
            ids = [self.bos_id, *ids]
        return np.asarray(ids, dtype=np.int32)

    def decode(self, ids: np.ndarray) -> bytes:
        """The UTF-8 bytes of `ids`, special tokens (BOS) removed (the inverse of `encode` for a lossless
        tokenizer such as the byte-level BPE)."""
        text = self._tok.decode([int(i) for i in np.asarray(ids).reshape(-1)], skip_special_tokens=True)
        return text.encode("utf-8")

    def __repr__(self) -> str:
        return f"HFTokenizer({self.name!r})"


@lru_cache(maxsize=8)
def get_tokenizer(spec: str) -> Tokenizer:
    """`"byte"` -> ByteTokenizer; `"hf:<dir>"` -> HFTokenizer (cached per process). `"auto"` outside a run, where
    no model says otherwise, is "byte" (a run resolves it first: `TrainConfig`); `"bpe:<N>"` must be trained on
    the corpus first (`flexorch.data.bpe.prepare_tokenizer`, which `TrainingDriver.setup` calls)."""
    if spec in ("byte", "auto"):
        return ByteTokenizer()
    if spec.startswith("hf:") and len(spec) > 3:
        return HFTokenizer(spec[3:])
    if spec.startswith("bpe:"):
        raise ValueError(
            f"tokenizer {spec!r} is trained on the corpus before loading it: call flexorch.data.bpe."
            "prepare_tokenizer(cfg, run_dir), which gives the config tokenizer 'hf:<run_dir>/tokenizer'"
        )
    raise ValueError(f"unknown tokenizer {spec!r}: use 'byte' (the default), 'hf:<local dir>' or 'bpe:<N>'")
