"""Waiting without sleeping for synchronisation: poll a condition until a deadline."""

from __future__ import annotations

import time


def poll(predicate, timeout: float = 30.0, interval: float = 0.1):
    """The first truthy value of ``predicate()`` within ``timeout`` s (else its last value)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    return predicate()


def wait_for(predicate, timeout: float, what: str, interval: float = 0.05) -> None:
    """Like :func:`poll`, but a timeout fails the test naming ``what``."""
    if not poll(predicate, timeout, interval):
        raise AssertionError(f"timed out waiting for {what}")
