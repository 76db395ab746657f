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
    valid. A ``ConfigError`` (hence a ``ValueError``). `rule`: which rule, in words without the numbers (the
    planner counts rejected layouts by key and rule)."""

    def __init__(self, key: str, value, valid: str, rule: str = ""):
        super().__init__(key, value, valid)
        self.rule = rule or valid


class DataError(ConfigError):
    """A bad document under data.on_bad_sample=stop (or a file that changed after the scan): one line naming the
    document (file:line) and the problem. A ConfigError, so the entry point reports it as one line and exits 2."""

    def __init__(self, where: str, problem: str):
        self.key, self.value, self.valid = "data.paths", where, problem
        self.where, self.problem = where, problem
        ValueError.__init__(self, f"bad document {where}: {problem}")


class BadDocument(Exception):
    """Raised while reading or scanning one document of data=multimodal; the message is the problem."""


def one_line(e: BaseException) -> str:
    """An error's message on one line (exceptions from libraries and the OS often span several)."""
    return " ".join(str(e).split())


def report_error(e: BaseException, status: int, every_rank: bool = True) -> int:
    """Say `e` in one line on stderr and return the exit status. Under torchrun the line also goes to the worker's
    error file (TORCHELASTIC_ERROR_FILE), which torchrun shows as the failure's root cause at the end of its
    summary, in place of "To enable traceback see: ...". every_rank=False (an error every rank finds alike, such as
    the composed config's): under torchrun only global rank 0 prints it as well (the summary has it whichever rank
    torchrun saw fail first, also when it stopped rank 0 before it printed); under other launchers every rank does,
    as one may stop the others before rank 0 got to it."""
    line = f"error: {one_line(e)}"
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if every_rank or not path or os.environ.get("RANK", "0") == "0":
        # one write: print() makes two (the text, then its newline), and under PYTHONUNBUFFERED each goes to the
        # shared stderr at once, so torchrun's own warning could land between them, on the error's line
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    if path:
        try:
            with open(path, "w") as f:
                json.dump({"message": line, "timestamp": int(time.time())}, f)
        except OSError:
            pass  # the line is on stderr; torchrun falls back to its own text
    return status


__all__ = ["ConfigError", "ParallelConfigError", "DataError", "BadDocument", "one_line", "report_error"]
