"""The data plane's one error type, apart from the modules that raise it so that all of them can import it."""

from __future__ import annotations

__all__ = ["DataError"]


class DataError(ValueError):
    """Input data is missing or malformed; the message names the file and line."""
