"""What a long tool is doing, and when it will be done.

    progress = Progress(total=len(configs), label="bench_moe_layer")
    for config in configs:
        ...
        progress.done(config_name)   # one unit finished

On a terminal (stderr is a tty) one line is redrawn as a bar; otherwise (logs, pipes, CI) each
unit prints a plain line. Both say how many units are done, what the last one was, the time so
far and an ETA (the mean time per unit so far, times the units left). The tools print it on
one rank only.
"""

from __future__ import annotations

import sys
import time

WIDTH = 24


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 60}:{seconds % 60:02d}"


class Progress:
    def __init__(self, total: int, label: str, stream=None, enabled: bool = True):
        self.total, self.label, self.count = max(1, total), label, 0
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.tty = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.start = time.monotonic()

    def line(self, what: str) -> str:
        elapsed = time.monotonic() - self.start
        left = elapsed / self.count * (self.total - self.count) if self.count else 0.0
        return (f"{self.label} {self.count}/{self.total}: {what} | {_clock(elapsed)} elapsed, "
                f"ETA {_clock(left)}")

    def done(self, what: str) -> None:
        self.count = min(self.total, self.count + 1)
        if not self.enabled:
            return
        if self.tty:
            filled = WIDTH * self.count // self.total
            bar = "#" * filled + "." * (WIDTH - filled)
            end = "\n" if self.count == self.total else ""
            self.stream.write(f"\r\033[K[{bar}] {self.line(what)}{end}")
        else:
            self.stream.write(self.line(what) + "\n")
        self.stream.flush()
