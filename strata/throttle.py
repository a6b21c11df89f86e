"""Login throttling, one rule for every place a password is checked: a master's Login
(master/sessions.py) and ``strata replay``'s check before it starts an embedded cluster
(deploy/replay.py).

Failed logins are counted per user (``max_failures`` within ``lockout`` seconds of each other lock
the name for ``lockout`` s after the last) and per client host (``peer_max_failures``, default 4x: a
host may serve many users).  An attempt takes its slots *before* the password is checked, so
parallel guesses cannot all reach argon2; a success gives them back.  At most ``max_records``
records are kept, the least recently touched dropped first.

:class:`LoginThrottle` keeps its records in memory (a master: one process for its whole life).
:class:`FileThrottle` keeps them in a file beside the users file, so that the rule holds across
processes (each ``strata replay`` is a new one); its times are wall-clock seconds.
"""

from __future__ import annotations

import fcntl
import json
import os
import threading
import time
from collections import OrderedDict
from contextlib import contextmanager
from pathlib import Path

from .users import AuthError

__all__ = ["LoginThrottle", "FileThrottle", "MAX_USER_NAME", "MAX_PASSWORD", "LOGIN_FAILED"]

#: longer names are refused at once (no user can have one: the users file allows 64 characters)
MAX_USER_NAME = 128
#: longer passwords are refused before argon2 (which would otherwise hash up to a whole message)
MAX_PASSWORD = 4096
#: what every failed password check says, whether or not the user exists
LOGIN_FAILED = "login failed: unknown user or wrong password"


class LoginThrottle:
    """The counting rule of the module's doc, in memory.  :meth:`take` before checking a password
    (raises :class:`AuthError` when the user or host is locked out, or for a name no user can have),
    :meth:`give_back` after a success."""

    def __init__(self, max_failures: int = 5, lockout: float = 30.0, peer_max_failures: int | None = None,
                 max_records: int = 10_000, clock=time.monotonic):
        self.max_failures = max_failures
        self.lockout = lockout
        self.peer_max_failures = max_failures * 4 if peer_max_failures is None else peer_max_failures
        self.max_records = max_records
        self._clock = clock
        # "u:<user>" / "h:<host>" -> (attempts counted, time of the last), oldest first
        self.records: OrderedDict[str, tuple[int, float]] = OrderedDict()
        self._lock = threading.Lock()

    def take(self, user: str, host: str | None, now: float | None = None) -> tuple[str | None, str | None]:
        """Count this attempt against the user and the host, or refuse it if either is locked.

        A name longer than any user's cannot exist: refused (counted against the host only) with
        the generic message, and never kept as a key.  Returns the keys charged."""
        now = self._clock() if now is None else now
        with self._lock:
            return _take(self, self.records, user, host, now)

    def give_back(self, keys) -> None:
        """A successful login: the user starts afresh, the host gets its slot back."""
        with self._lock:
            _give_back(self.records, keys)


class FileThrottle(LoginThrottle):
    """:class:`LoginThrottle` whose records live in ``path`` (JSON, 0600, changed under an
    exclusive lock), so the rule spans processes; times are wall-clock seconds."""

    def __init__(self, path: str | Path, **kw):
        kw.setdefault("clock", time.time)
        super().__init__(**kw)
        self.path = Path(path)

    @contextmanager
    def _records(self):
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            raw = b""
            while chunk := os.read(fd, 65536):
                raw += chunk
            try:
                loaded = json.loads(raw or b"[]")
                records = OrderedDict((str(k), (int(n), float(t))) for k, n, t in loaded)
            except (ValueError, TypeError):
                records = OrderedDict()  # a damaged file starts afresh (it only ever slows logins down)
            yield records
            data = json.dumps([[k, n, t] for k, (n, t) in records.items()]).encode()
            os.lseek(fd, 0, os.SEEK_SET)
            os.ftruncate(fd, 0)
            os.write(fd, data)
        finally:
            os.close(fd)

    def take(self, user: str, host: str | None, now: float | None = None):
        now = self._clock() if now is None else now
        with self._records() as records:
            return _take(self, records, user, host, now)

    def give_back(self, keys) -> None:
        with self._records() as records:
            _give_back(records, keys)


def _take(t: LoginThrottle, records: OrderedDict, user: str, host: str | None, now: float):
    _forget_expired(records, t.lockout, now)
    ukey = "u:" + (user or "") if len(user or "") <= MAX_USER_NAME else None
    hkey = ("h:" + host) if host else None
    limits = ((ukey, t.max_failures), (hkey, t.peer_max_failures))
    wait = max((_locked_for(records, k, n, t.lockout, now) for k, n in limits if k is not None), default=0.0)
    if wait > 0:
        raise AuthError(f"login failed: too many failed attempts; retry in {wait:.0f} s")
    for k, _ in limits:
        if k is not None:
            n, _last = records.pop(k, (0, now))
            records[k] = (n + 1, now)  # to the end: the newest record
    while len(records) > t.max_records:
        records.popitem(last=False)  # a flood of names/hosts: the oldest go first
    if ukey is None:
        raise AuthError(LOGIN_FAILED)
    return ukey, hkey


def _locked_for(records, key: str, limit: int, lockout: float, now: float) -> float:
    n, last = records.get(key, (0, now))
    return lockout - (now - last) if n >= limit and now - last < lockout else 0.0


def _forget_expired(records: OrderedDict, lockout: float, now: float) -> None:
    """Drop the records nothing has touched for ``lockout`` seconds (the oldest are first)."""
    while records:
        key, (_n, last) = next(iter(records.items()))
        if now - last < lockout:
            return
        del records[key]


def _give_back(records: OrderedDict, keys) -> None:
    ukey, hkey = keys
    records.pop(ukey, None)
    if hkey in records:
        n, last = records[hkey]
        if n <= 1:
            del records[hkey]
        else:
            records[hkey] = (n - 1, last)
