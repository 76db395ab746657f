"""The errors a user sees for a bad setting: one line naming the key, the value and what would be valid.

They live here, below everything else, so that the layout rules, the config schema and the parallel state can
all raise them without importing each other.
"""

from __future__ import annotations

import json
import os
import sys
import time


class ConfigError(ValueError):
    """A configuration value is invalid. The message names the key, the value and what is valid."""

    def __init__(self, key: str, value, valid: str):
        self.key, self.value, self.valid = key, value, valid
        super().__init__(f"invalid config: {key}={value!r}: {valid}")


class ParallelConfigError(ConfigError):
    """A parallel layout is impossible or breaks a rule; the message names the key, the value and what is
    valid. A ``ConfigError`` (hence a ``ValueError``)."""


def one_line(e: BaseException) -> str:
    """An error's message on one line (exceptions from libraries and the OS often span several)."""
    return " ".join(str(e).split())


def report_error(e: BaseException, status: int, every_rank: bool = True) -> int:
    """Say `e` in one line on stderr and return the exit status. every_rank=False: only global rank 0 prints (an
    error every rank finds alike, such as the composed config's). Under torchrun the line also goes to the worker's
    error file (TORCHELASTIC_ERROR_FILE), which torchrun shows as the failure's root cause at the end of its
    summary, in place of "To enable traceback see: ..."."""
    line = f"error: {one_line(e)}"
    if every_rank or os.environ.get("RANK", "0") == "0":
        print(line, file=sys.stderr, flush=True)
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        try:
            with open(path, "w") as f:
                json.dump({"message": line, "timestamp": int(time.time())}, f)
        except OSError:
            pass  # the line is on stderr; torchrun falls back to its own text
    return status


__all__ = ["ConfigError", "ParallelConfigError", "one_line", "report_error"]
