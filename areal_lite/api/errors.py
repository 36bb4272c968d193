"""Errors that a restart of the trainer would meet again, and how the launchers learn of them.

A launcher restarts a failed trainer up to ``recover.retries`` times, which helps with a crash or
a lost node but not with a bad data row, a model directory without a tokenizer, a grader that fails
on every sample, a checkpoint without an intact copy or a full disk: those fail the same way
each time. Such errors derive from `RecurringError`. The launchers set ``STOP_FILE_ENV`` for the
trainer (the local and Slurm ones to ``logs/recurring_error``, the Ray one to a file on each
trainer node); an uncaught `RecurringError` in the trainer's main thread writes its one-line message
to that file before the usual traceback, and the launcher, finding it (`read_stop_file`), says the
line and does not restart the trainer.
"""

from __future__ import annotations

import os
import sys
from types import TracebackType

STOP_FILE_ENV = "AREAL_LITE_STOP_FILE"
"""Where an uncaught `RecurringError` writes its message (set by the launchers)."""


class RecurringError(Exception):
    """A failure that a restart of the trainer would meet again (see the module docstring)."""


def read_stop_file(path: str) -> str | None:
    """The line a `RecurringError` wrote to ``path``; None when there is none."""
    try:
        with open(path) as f:
            return f.read().strip() or None
    except OSError:
        return None


def _write_stop_file(kind: type[BaseException], error: BaseException, tb: TracebackType | None) -> None:
    path = os.environ.get(STOP_FILE_ENV)
    if path and isinstance(error, RecurringError):
        first = str(error).splitlines()[0] if str(error) else ""
        try:
            with open(path, "w") as f:
                f.write(f"{kind.__name__}: {first}\n")
        except OSError:
            pass  # the traceback below still says it
    _previous_hook(kind, error, tb)


_previous_hook = sys.excepthook
if os.environ.get(STOP_FILE_ENV):
    sys.excepthook = _write_stop_file
