"""A progress line for long work (quantization, calibration): "what i/N, elapsed, ETA".

On a terminal the line is redrawn in place on stderr; otherwise (logs, CI, pipes) it goes to the logger at
most every ``every`` seconds and once at the end, so a user can read an ETA either way. The ETA is the
elapsed time per finished item times the items left (items are assumed alike: layers of one model); time
spent between ``pause`` and ``resume`` (work with its own line) is left out of both.
"""

from __future__ import annotations

import logging
import sys
import time


def _duration(seconds: float) -> str:
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


class Progress:
    def __init__(self, what: str, total: int, unit: str, log: logging.Logger, *, every: float = 5.0):
        self.what, self.total, self.unit, self.log, self.every = what, total, unit, log, every
        self.t0 = self.last = time.perf_counter()
        self.done = 0
        self.tty = sys.stderr.isatty() and log.isEnabledFor(logging.INFO)
        self.detail = ""
        self.paused_at: float | None = None

    def pause(self) -> None:
        """Stop the clock (other work with its own progress line runs in between)."""
        self.paused_at = time.perf_counter()

    def resume(self) -> None:
        if self.paused_at is not None:
            shift = time.perf_counter() - self.paused_at
            self.t0 += shift
            self.last += shift
            self.paused_at = None

    def line(self) -> str:
        elapsed = time.perf_counter() - self.t0
        text = f"{self.what}: {self.unit} {self.done}/{self.total} ({self.done / max(self.total, 1):.0%}), {_duration(elapsed)}"
        if 0 < self.done < self.total:
            text += f", ETA {_duration(elapsed / self.done * (self.total - self.done))}"
        return text + (f" - {self.detail}" if self.detail else "")

    def update(self, done: int, detail: str = "") -> None:
        self.done, self.detail = done, detail
        now = time.perf_counter()
        if self.tty:
            sys.stderr.write("\r\033[K" + self.line())
            sys.stderr.flush()
        elif now - self.last >= self.every and done < self.total:
            self.log.info("%s", self.line())
            self.last = now

    def close(self) -> None:
        if self.tty:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()
        self.detail = ""
        self.log.info("%s", self.line())
