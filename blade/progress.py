"""The progress line on stderr while many clusters compile: "blade: compiled 3/12 clusters (4.1 s)".

Only worth a line when there is something to wait for: several jobs and a compile that has
already taken a while. A single tiny cluster, or a run served from the cache, prints nothing.
"""
from __future__ import annotations

import sys
import threading
import time

MIN_JOBS = 2          # fewer jobs: nothing to report progress on
MIN_SECONDS = 1.0     # quieter than this: not worth a line


class Progress:
    def __init__(self, total: int, enabled: bool = True, stream=None):
        self.total = total
        self.done = 0
        self.enabled = enabled and total >= MIN_JOBS
        self.stream = stream or sys.stderr
        self.started = time.monotonic()
        self.shown = False
        self._lock = threading.Lock()

    def __call__(self, _result=None) -> None:
        """One job finished (the driver's on_result callback)."""
        with self._lock:
            self.done += 1
            elapsed = time.monotonic() - self.started
            if self.enabled and elapsed >= MIN_SECONDS:
                end = "\n" if self.done == self.total else ""
                self.stream.write(f"\rblade: compiled {self.done}/{self.total} clusters ({elapsed:.1f} s){end}")
                self.stream.flush()
                self.shown = True

    def close(self) -> None:
        with self._lock:
            if self.shown and self.done < self.total:
                self.stream.write("\n")
