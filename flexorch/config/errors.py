"""The error a run configuration raises when it cannot work."""

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """A run configuration that cannot work; the message names the key, the numbers, and what to do."""
