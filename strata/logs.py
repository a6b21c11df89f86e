"""Process logs that stay bounded: recurring warnings at most once per interval, and a log file that is
rotated at a size.

A master or worker runs for months; a warning in a loop (a heartbeat every 0.5 s, a dispatch step,
a datagram from the network) must not grow its log without bound.  :class:`RepeatLimiter` logs the
first occurrence of a recurring message, then at most one line per ``interval`` seconds saying how
many were held back.  :func:`capture_output` sends the process's stdout and stderr (Python's and its
children's, the Spark JVM's among them) through a pipe into a file rotated at ``max_bytes`` with
``backups`` old copies, so a process's log takes at most ``(backups + 1) * max_bytes`` on disk.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Callable

__all__ = ["RepeatLimiter", "capture_output", "flush_output", "LOG_MAX_BYTES", "LOG_BACKUPS", "REPEAT_INTERVAL"]

#: a process log is rotated when it reaches this size ...
LOG_MAX_BYTES = 16 * 1024 * 1024
#: ... keeping this many older files (name.log.1, name.log.2)
LOG_BACKUPS = 2
#: a recurring warning is logged at most once per this many seconds
REPEAT_INTERVAL = 60.0


class RepeatLimiter:
    """Log a recurring message at most once per ``interval`` seconds per key, with the count held back.

    ``limiter.warning("load", "load reading failed: %s", e)`` logs the first call at once; calls
    within the next ``interval`` seconds are only counted; the first call after it logs its message
    with ``(N more since the last report, M s ago)``.  Keys are few and fixed by the caller (a
    message kind, never data from the network), so the table stays small."""

    def __init__(self, logger: logging.Logger, interval: float = REPEAT_INTERVAL,
                 clock: Callable[[], float] = time.monotonic):
        self.logger = logger
        self.interval = interval
        self._clock = clock
        self._lock = threading.Lock()
        self._seen: dict[str, tuple[float, int]] = {}  # key -> (when last logged, calls held back since)

    def log(self, level: int, key: str, msg: str, *args, exc_info=None) -> bool:
        """Log ``msg % args`` unless ``key`` was logged less than ``interval`` s ago; True if logged."""
        now = self._clock()
        with self._lock:
            last, held = self._seen.get(key, (None, 0))
            if last is not None and now - last < self.interval:
                self._seen[key] = (last, held + 1)
                return False
            self._seen[key] = (now, 0)
        if held:
            msg = f"{msg} ({held} more since the last report, {now - last:.0f} s ago)"
        self.logger.log(level, msg, *args, exc_info=exc_info)
        return True

    def warning(self, key: str, msg: str, *args) -> bool:
        return self.log(logging.WARNING, key, msg, *args)

    def exception(self, key: str, msg: str, *args) -> bool:
        """An error with its traceback, at most once per interval (the later ones counted)."""
        return self.log(logging.ERROR, key, msg, *args, exc_info=True)

    def held(self, key: str) -> int:
        with self._lock:
            return self._seen.get(key, (None, 0))[1]


class _RotatingSink:
    """Bytes appended to ``path``; at ``max_bytes`` the file becomes ``path.1`` (``path.1`` becomes
    ``path.2`` ...) and a new one starts.  Files are created 0600: a level's log is that level's."""

    def __init__(self, path: Path, max_bytes: int, backups: int):
        self.path, self.max_bytes, self.backups = Path(path), max_bytes, backups
        self._f = self._open()

    def _open(self):
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        return os.fdopen(fd, "ab", buffering=0)

    def write(self, data: bytes) -> None:
        while data:  # a piece that would not fit starts a new file (a piece larger than a file is split)
            piece, data = data[:self.max_bytes], data[self.max_bytes:]
            if self._f.tell() and self._f.tell() + len(piece) > self.max_bytes:
                self._rotate()
            self._f.write(piece)

    def _rotate(self) -> None:
        self._f.close()
        for i in range(self.backups, 0, -1):
            src = self.path if i == 1 else self.path.with_name(f"{self.path.name}.{i - 1}")
            dst = self.path.with_name(f"{self.path.name}.{i}")
            try:
                os.replace(src, dst)
            except FileNotFoundError:
                pass
        if self.backups == 0:
            self.path.unlink(missing_ok=True)
        self._f = self._open()

    def close(self) -> None:
        self._f.close()


_captured: dict = {}


def capture_output(path: str | Path, max_bytes: int = LOG_MAX_BYTES, backups: int = LOG_BACKUPS) -> None:
    """From now on, this process's file descriptors 1 and 2 (and so every child's that inherits them,
    the Spark JVM's among them) write into ``path``, rotated at ``max_bytes`` (see the module's doc).

    A thread copies the pipe into the file; :func:`flush_output` (called by the roles before they
    exit) waits for what is in the pipe.  Called once, early in a process's life."""
    if _captured:
        return
    sink = _RotatingSink(Path(path), max_bytes, backups)
    r, w = os.pipe()
    for fd in (1, 2):
        os.dup2(w, fd)
    os.close(w)

    def pump() -> None:
        while True:
            try:
                data = os.read(r, 65536)
            except OSError:
                return
            if not data:
                return
            try:
                sink.write(data)
            except OSError:
                pass  # a full disk: the output is lost, the process goes on

    t = threading.Thread(target=pump, name="log-pump", daemon=True)
    t.start()
    _captured.update(thread=t, sink=sink)


def flush_output(timeout: float = 1.0) -> None:
    """Before exiting: flush Python's streams and let the pump copy what the pipe still holds."""
    import sys

    for s in (sys.stdout, sys.stderr):
        try:
            s.flush()
        except (OSError, ValueError):
            pass
    t = _captured.get("thread")
    if t is None:
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    for fd in (1, 2):  # our ends of the pipe closed: the pump ends once the children's are too
        os.dup2(devnull, fd)
    os.close(devnull)
    t.join(timeout)
