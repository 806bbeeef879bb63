"""Which worker holds which parameters when pipeline stages keep only their own layers (pure: no torch, no Ray).

The model is cut into *parts*: ``"embed"`` (the token embedding), ``"layer:i"`` (decoder layer i) and ``"head"``
(final norm and LM head). With ``pipeline_params = "stage"`` a rank holds, with their optimizer state, exactly the
parts its stage runs: its layers, the embedding on stage 0, the head on the last stage (and, with tied embeddings,
the embedding there too, as Megatron keeps a second copy on the last stage whose gradient is summed with the
first's). Ranks left out of the stages hold nothing. Every holder of a part takes the same all-reduced gradient and
the same AdamW step, so the copies stay bitwise equal.

When the stage map changes (``pipeline_stages = "auto"`` choosing another split, a worker lost or joining), the
parts a rank needs and does not hold are copied from a rank that does (:func:`transfers`); a part no live worker
holds is lost and the run must roll back to its last checkpoint (:class:`PartsLostError`). Holdings are keyed by
the stable ``worker_id``, so they survive a change of world.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

__all__ = [
    "ALL",
    "PartsLostError",
    "model_parts",
    "part_of",
    "stage_parts",
    "placement",
    "holder_sets",
    "transfers",
    "missing_parts",
    "handoff_needs",
]

ALL = None
"""A holding of ``ALL`` (None) means the worker holds the whole model (a replica)."""


class PartsLostError(RuntimeError):
    """Parameters that no live worker holds any more (every holder was lost)."""

    def __init__(self, parts: Sequence[str], lost_workers: Sequence[int] = ()):
        self.parts = tuple(parts)
        self.lost_workers = tuple(lost_workers)
        shown = ", ".join(self.parts[:6]) + (", ..." if len(self.parts) > 6 else "")
        super().__init__(
            f"the parameters and optimizer state of {shown} were held only by lost workers "
            f"{sorted(self.lost_workers) or '(unknown)'}"
        )


def model_parts(num_layers: int) -> tuple[str, ...]:
    """Every part of a model of ``num_layers`` layers, in model order."""
    return ("embed", *(f"layer:{i}" for i in range(num_layers)), "head")


def part_of(param_name: str) -> str:
    """The part a parameter of ``flexorch.workers.model.Decoder`` (or, by Transformers' names, of a Hugging Face
    causal LM: ``model.embed_tokens``, ``model.layers.i``, ``model.norm``, ``lm_head``) belongs to."""
    if param_name.startswith(("tok_embeddings.", "model.embed_tokens.")):
        return "embed"
    if param_name.startswith(("layers.", "model.layers.")):
        return f"layer:{int(param_name.removeprefix('model.').split('.')[1])}"
    if param_name.startswith(("norm.", "output.", "model.norm.", "lm_head.")):
        return "head"
    raise ValueError(f"parameter {param_name!r} belongs to no model part (embed, layer:i, head)")


def stage_parts(layers: Sequence[int], stage: int, tied: bool) -> frozenset[str]:
    """The parts stage ``stage`` of a pipeline with ``layers[r]`` layers on stage r runs."""
    first = sum(layers[:stage])
    parts = {f"layer:{i}" for i in range(first, first + layers[stage])}
    if stage == 0:
        parts.add("embed")
    if stage == len(layers) - 1:
        parts.add("head")
        if tied:
            parts.add("embed")
    return frozenset(parts)


def placement(
    stage_ranks: Sequence[Sequence[int]], layers: Sequence[int], world_size: int, tied: bool
) -> list[frozenset[str]]:
    """The parts each rank of the world holds for this stage map (empty for ranks outside every stage)."""
    out = [frozenset()] * world_size
    for r, ranks in enumerate(stage_ranks):
        parts = stage_parts(layers, r, tied)
        for rank in ranks:
            out[rank] = parts
    return out


def holder_sets(held: Sequence[frozenset[str]]) -> list[tuple[tuple[int, ...], tuple[str, ...]]]:
    """Parts grouped by the exact set of ranks holding them: ``[(ranks, parts), ...]`` in a fixed order (by ranks),
    the same on every rank. Each group's gradients are all-reduced over its ranks."""
    by_part: dict[str, list[int]] = {}
    for rank, parts in enumerate(held):
        for part in parts:
            by_part.setdefault(part, []).append(rank)
    groups: dict[tuple[int, ...], list[str]] = {}
    for part, ranks in by_part.items():
        groups.setdefault(tuple(ranks), []).append(part)
    return [(ranks, tuple(sorted(parts))) for ranks, parts in sorted(groups.items())]


def missing_parts(held: Mapping[int, frozenset[str] | None], parts: Sequence[str]) -> list[str]:
    """The parts of ``parts`` no worker in ``held`` holds (``held[w]`` None: the whole model)."""
    if any(h is ALL for h in held.values()):
        return []
    have = set().union(*held.values()) if held else set()
    return [p for p in parts if p not in have]


def transfers(
    held: Mapping[int, frozenset[str] | None], needed: Mapping[int, frozenset[str]], parts: Sequence[str]
) -> dict[int, dict[int, tuple[str, ...]]]:
    """What to copy before a step: ``{destination worker: {source worker: parts}}`` for every part a worker needs
    and does not hold, each from a holder (the least loaded one, ties to the lowest id, so copies spread over
    the holders). Raises :class:`PartsLostError` when a needed part has no holder."""
    holders: dict[str, list[int]] = {p: [] for p in parts}
    for w in sorted(held):
        for p in parts if held[w] is ALL else sorted(held[w]):
            holders[p].append(w)
    lost = sorted({p for w, need in needed.items() for p in need if not holders.get(p)}, key=list(parts).index)
    if lost:
        raise PartsLostError(lost)
    load: dict[int, int] = dict.fromkeys(held, 0)
    out: dict[int, dict[int, list[str]]] = {}
    for w in sorted(needed):
        have = held.get(w, frozenset())
        for p in sorted(needed[w], key=list(parts).index):
            if have is ALL or p in have:
                continue
            src = min(holders[p], key=lambda s: (load[s], s))
            load[src] += 1
            out.setdefault(w, {}).setdefault(src, []).append(p)
    return {w: {s: tuple(ps) for s, ps in srcs.items()} for w, srcs in out.items()}


def handoff_needs(
    held: Mapping[int, frozenset[str] | None], members: Sequence[int], leaving: Sequence[int], parts: Sequence[str]
) -> list[frozenset[str]] | None:
    """Before ``leaving`` members go on notice (their node is being drained): what each of ``members`` (rank order)
    must hold so that no part leaves with them, for ``transfers``: the stayers' own parts plus each part only the
    leaving hold, given to the stayer holding fewest parts (ties to the lowest id); the leaving keep theirs. None
    when nothing needs to move (the stayers hold every part the leaving do, or no one stays)."""
    gone = set(leaving)
    stay = [w for w in members if w not in gone]
    has = {w: set(parts) if held[w] is ALL else set(held[w]) for w in members}
    covered = set().union(*(has[w] for w in stay)) if stay else set()
    orphans = [p for p in parts if p not in covered and any(p in has[w] for w in gone)]
    if not orphans or not stay:
        return None
    for p in orphans:
        has[min(stay, key=lambda w: (len(has[w]), w))].add(p)
    return [frozenset(has[w]) for w in members]
