"""FlexDraft's log lines: `[distill] 640 prompts in 11 shards ...`, one format for every stage and command.

`get(name)` is the logger of one part ("distill", "attention", "bench", ...); its lines go to stderr through one
handler on the "flexdraft" logger, which does not propagate: Ray Train patches print and adds handlers of its
own in its workers, and a line that reached two of them was shown twice.
"""
from __future__ import annotations

import logging
import sys


class _Stderr(logging.StreamHandler):
    """Writes to whatever sys.stderr is when a line is logged (Ray and pytest replace it after import)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):  # StreamHandler.__init__ sets it; the property always answers sys.stderr
        pass


class _Format(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = f"[{record.name.removeprefix('flexdraft.')}] {record.getMessage()}"
        if record.exc_info:  # log.exception(...): the traceback under the line
            line += "\n" + self.formatException(record.exc_info)
        return line


def setup(level: int = logging.INFO) -> None:
    """Idempotent: the one handler on "flexdraft", at `level`."""
    root = logging.getLogger("flexdraft")
    if not any(isinstance(h, _Stderr) for h in root.handlers):
        handler = _Stderr()
        handler.setFormatter(_Format())
        root.addHandler(handler)
    root.setLevel(level)
    root.propagate = False


def get(name: str) -> logging.Logger:
    """The logger of one part of FlexDraft (its lines read `[name] ...`), set up at INFO on first use."""
    if not logging.getLogger("flexdraft").handlers:
        setup()
    return logging.getLogger(f"flexdraft.{name}")
