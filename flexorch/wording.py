"""How counts are said in what flexorch prints."""

from __future__ import annotations

__all__ = ["count"]


def count(n: int, noun: str) -> str:
    """'1 worker', '4 workers' (``noun`` singular, its plural with an 's')."""
    return f"{n} {noun}{'' if n == 1 else 's'}"
