"""Fingerprints that decide whether a prepared store fits a run: the source files, the tokenizer, and every setting
that changes the stored tokens. Pure Python, no Ray.

- source: each listed file's path relative to the source, size and modification time (ns); stat only, no reads;
- tokenizer: 'byte', or a hash of a tokenizer directory's files (weights excluded: a model directory's tokenizer
  is its small files);
- settings: the storage format, record kind, field names, ``loss_on``, ``max_context``, ``over_long``,
  ``min_tokens``, ``bad_files``, ``on_bad_record``, ``extensions`` and ``split``, plus the store format; for chat
  records whose template has ``{% generation %}`` marks, ``chat_targets`` (those marks decide the loss targets, not
  the prefix rule a store prepared before them used: ``flexorch.data.chat``).

A store in the cache is found by its key (source path + tokenizer + settings); its manifest's source fingerprint
then says whether the files changed since. :func:`describe_change` names what differs, for the console.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import TYPE_CHECKING

from flexorch.data.store.layout import FORMAT

if TYPE_CHECKING:
    from flexorch.config.data import CorpusConfig
    from flexorch.data.listing import Listing

__all__ = ["describe_change", "fingerprints", "same_fingerprints", "store_key", "tokenizer_fingerprint"]

_WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".gguf", ".onnx", ".ckpt")
_SETTINGS = (
    "text_field",
    "messages_field",
    "prompt_field",
    "completion_field",
    "input_ids_field",
    "labels_field",
    "loss_mask_field",
    "loss_on",
    "split",
    "max_context",
    "over_long",
    "bad_files",
    "on_bad_record",
    "min_tokens",
)


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:24]


def tokenizer_fingerprint(spec: str) -> str:
    """'byte' ('auto' too), or ``hf:<sha>`` of a tokenizer directory's non-weight files (names and bytes; a
    trained BPE's timing notes, ``flexorch_bpe.json``, excluded: the same training gives the same fingerprint)."""
    if not spec.startswith("hf:"):
        return "byte" if spec == "auto" else spec
    root = os.path.abspath(os.path.expanduser(spec[3:]))
    h = hashlib.sha256()
    if os.path.isdir(root):
        for name in sorted(os.listdir(root)):
            path = os.path.join(root, name)
            if os.path.isfile(path) and not name.endswith(_WEIGHTS) and name != "flexorch_bpe.json":
                h.update(name.encode() + b"\0")
                with open(path, "rb") as f:
                    h.update(f.read())
    return f"hf:{h.hexdigest()[:24]}"


def _chat_rule(spec: str) -> str | None:
    """``flexorch.data.chat.target_rule`` of a tokenizer directory; None for one that does not load (preparing
    says why)."""
    if not spec.startswith("hf:"):
        return None
    from flexorch.data.chat import target_rule
    from flexorch.data.errors import DataError
    from flexorch.data.tokenizer import get_tokenizer

    try:
        return target_rule(get_tokenizer(spec))
    except (DataError, ValueError):
        return None


def source_files(listing: Listing) -> list[list]:
    """``[relative path, size, mtime_ns]`` per listed file, in listing order."""
    out = []
    for f in listing.files:
        st = os.stat(f)
        out.append([os.path.relpath(f, listing.base), st.st_size, st.st_mtime_ns])
    return out


def fingerprints(cfg: CorpusConfig, listing: Listing, kind: str) -> dict:
    """Everything a store records about what it was prepared from (JSON-able); ``"key"`` names the store."""
    settings = {k: getattr(cfg, k) for k in _SETTINGS}
    settings |= {"format": listing.fmt, "records": kind, "store_format": FORMAT}
    settings["extensions"] = list(cfg.extensions) if cfg.extensions is not None else None
    files = source_files(listing)
    spec = "byte" if cfg.tokenizer == "auto" else cfg.tokenizer  # 'auto' outside a run: bytes (CorpusConfig)
    if kind == "chat" and cfg.loss_on == "answers" and _chat_rule(spec) == "marks":
        settings["chat_targets"] = "marks"  # only here: every other store keeps its key
    tok = "pre-tokenized" if kind == "tokenized" else tokenizer_fingerprint(spec)
    out = {
        "source": listing.source,
        "source_files": len(files),
        "source_bytes": int(sum(f[1] for f in files)),
        "source_digest": _digest(files),
        "tokenizer": spec if kind != "tokenized" else "pre-tokenized",
        "tokenizer_digest": tok,
        "settings": settings,
    }
    out["key"] = store_key(out)
    return out


def same_fingerprints(a: dict, b: dict) -> bool:
    """Whether a store prepared under ``a`` holds exactly the tokens ``b`` asks for (the tokenizer by its files,
    not by where they are)."""
    return all(a.get(k) == b.get(k) for k in ("source", "source_digest", "tokenizer_digest", "settings"))


def store_key(fp: dict) -> str:
    """The cache directory name of a store: source path, tokenizer and settings (not the files' state)."""
    base = os.path.basename(fp["source"].rstrip("/")) or "source"
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in base)[:40]
    return f"{safe}-{_digest([fp['source'], fp['tokenizer_digest'], fp['settings']])[:16]}"


def describe_change(old: dict, new: dict, old_files: list | None = None, new_files: list | None = None) -> str:
    """What differs between two fingerprints, in words ("" when nothing does)."""
    parts = []
    if old.get("source") != new.get("source"):
        parts.append(f"source {old.get('source')} -> {new.get('source')}")
    if old.get("tokenizer_digest") != new.get("tokenizer_digest"):
        parts.append(f"tokenizer {old.get('tokenizer')} ({old.get('tokenizer_digest')}) -> {new.get('tokenizer')}")
    for k in sorted(set(old.get("settings", {})) | set(new.get("settings", {}))):
        a, b = old.get("settings", {}).get(k), new.get("settings", {}).get(k)
        if a != b:
            parts.append(f"{k} {a!r} -> {b!r}")
    if old.get("source_digest") != new.get("source_digest"):
        parts.append(_files_change(old, new, old_files, new_files))
    return "; ".join(parts)


def _files_change(old: dict, new: dict, old_files, new_files) -> str:
    if old_files is None or new_files is None:
        return (
            f"the source files changed ({old.get('source_files')} files, {old.get('source_bytes'):,} bytes -> "
            f"{new.get('source_files')} files, {new.get('source_bytes'):,} bytes)"
        )
    a, b = {f[0]: f[1:] for f in old_files}, {f[0]: f[1:] for f in new_files}
    changed = [
        f"{n} (size {a[n][0]:,} -> {b[n][0]:,})" if a[n][0] != b[n][0] else f"{n} (modified)"
        for n in sorted(a.keys() & b.keys())
        if a[n] != b[n]
    ]
    changed += [f"{n} (new)" for n in sorted(b.keys() - a.keys())]
    changed += [f"{n} (removed)" for n in sorted(a.keys() - b.keys())]
    more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
    return f"the source changed since it was prepared: {', '.join(changed[:3])}{more}"
