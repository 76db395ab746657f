"""The errors a user sees for a bad setting: one line naming the key, the value and what would be valid.

They live here, below everything else, so that the layout rules, the config schema and the parallel state can
all raise them without importing each other.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value is invalid. The message names the key, the value and what is valid."""

    def __init__(self, key: str, value, valid: str):
        self.key, self.value, self.valid = key, value, valid
        super().__init__(f"invalid config: {key}={value!r}: {valid}")


class ParallelConfigError(ConfigError):
    """A parallel layout is impossible or breaks a rule; the message names the key, the value and what is
    valid. A ``ConfigError`` (hence a ``ValueError``)."""


__all__ = ["ConfigError", "ParallelConfigError"]
