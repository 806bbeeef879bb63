"""`flexorch plan --window / --window-share`: a sliding-window model's window pattern for the planner's profile.

A windowed layer's attention over s tokens costs ``2 s w - w^2`` key-query pairs instead of ``s^2``
(``flexorch.solver.cost_model.attention_square``); the flags set ``Profile.attention_window`` and
``Profile.window_fraction`` on whatever profile the plan uses (a profile JSON may carry them itself).
"""

from __future__ import annotations

import argparse

from flexorch.data.errors import DataError
from flexorch.data.lengths import parse_tokens

__all__ = ["add_window_flags", "with_window"]


def add_window_flags(p: argparse.ArgumentParser) -> None:
    """``--window`` and ``--window-share`` (config keys ``window``, ``window_share``)."""
    p.add_argument(
        "--window",
        help="the model's sliding attention window in tokens, e.g. 4K (default: the profile's): windowed "
        "layers are priced by their window, not s^2",
    )
    p.add_argument(
        "--window-share",
        help="the share of layers that use --window, e.g. 5/6 (Gemma 3) or 1 (Mistral) (default 1 with --window)",
    )


def with_window(profile, v: dict):
    """``profile`` with ``--window`` / ``--window-share`` (config keys ``window``, ``window_share``) set."""
    if v.get("window") is None:
        if v.get("window_share") is not None:
            raise DataError("--window-share needs --window (the window those layers use)")
        return profile
    try:
        window = parse_tokens(str(v["window"]))
    except ValueError as e:
        raise DataError(f"--window: {e}") from None
    share = v.get("window_share", 1)
    try:
        num, _, den = str(share).partition("/")
        fraction = float(num) / float(den) if den else float(num)
    except (ValueError, ZeroDivisionError):
        raise DataError(f"--window-share must be a fraction like 5/6 or 0.5, got {share!r}") from None
    if not 0 < fraction <= 1:
        raise DataError(f"--window-share must be in (0, 1], got {share!r}")
    return profile.with_overrides(attention_window=window, window_fraction=fraction)
