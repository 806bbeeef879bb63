"""Which tokens carry loss: the mask travels inside the token ids themselves.

Chat, prompt/completion and pre-tokenized data train on some tokens only (the answers), yet every token is still fed
to the model (a masked prompt conditions its answer). flexorch stores a document as one run of ids in a block of the
prepared store (read back as int32), and a token that is *not* a loss target is stored as ``~id`` (``-id - 1``,
always negative); a target keeps its id. So the mask rides with the tokens through every path that moves them (Ray
Data blocks, the stream, each SP shard, pipeline units, checkpoints of the stream) without a second array to keep in
step, and a reader that forgot to decode fails loudly (a negative id is outside every vocabulary:
``check_token_range``) instead of training on the wrong tokens.

Token ``i`` being a target means the loss includes predicting it from tokens ``0..i-1`` (the Hugging Face
convention: ``labels[i] = input_ids[i]`` where it is a target, ``-100`` where not). Token 0 of a document is never
predicted, whatever its flag. Text documents store plain ids: every token is a target.

Pure numpy: no Ray, no torch.
"""

from __future__ import annotations

import numpy as np

__all__ = ["encode_targets", "token_ids", "target_flags", "count_targets", "hf_labels"]


def encode_targets(ids, targets) -> np.ndarray:
    """int32 array of ``ids`` with every position whose ``targets`` flag is False stored as ``~id``.

    ``targets`` None: every token is a target (the ids themselves). ids must be >= 0."""
    ids = np.asarray(ids, dtype=np.int32)
    if targets is None:
        return ids
    flags = np.asarray(targets, dtype=bool)
    if flags.shape != ids.shape:
        raise ValueError(f"targets must have the shape of ids {ids.shape}, got {flags.shape}")
    return np.where(flags, ids, ~ids).astype(np.int32, copy=False)


def token_ids(stored: np.ndarray) -> np.ndarray:
    """The token ids of a stored document: ``~x`` where ``x < 0`` (workers decode torch tensors the same way:
    ``flexorch.workers.model.stored_token_ids``)."""
    stored = np.asarray(stored)
    return np.where(stored < 0, ~stored, stored)


def target_flags(stored):
    """True where the stored token is a loss target (``stored >= 0``)."""
    return stored >= 0


def count_targets(stored: np.ndarray) -> int:
    """Positions of one document that carry loss: targets after the first token (token 0 is never predicted)."""
    return int((np.asarray(stored)[1:] >= 0).sum())


def hf_labels(stored: np.ndarray, ignore_index: int = -100) -> tuple[np.ndarray, np.ndarray]:
    """(input_ids, labels) of one stored document in Transformers' convention (``labels`` aligned with the ids,
    ``ignore_index`` where a token is not a target; the model shifts them): what a user would pass to
    ``model(input_ids, labels=labels)`` to get the same loss."""
    stored = np.asarray(stored)
    ids = token_ids(stored).astype(np.int64)
    labels = np.where(stored >= 0, ids, ignore_index)
    labels[:1] = ignore_index
    return ids, labels
