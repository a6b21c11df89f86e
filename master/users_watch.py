"""The users-file watcher: the administrator's privacy switches applied while the master runs.

Beside :mod:`strata.master.sessions` (the sessions it ends and whose roles it changes): every
``interval`` :class:`UsersWatch` re-reads the users file if it changed; a user who was removed, or
whose clearance no longer dominates this master's level (or is missing or unknown: a bad entry
means no access), loses their sessions and their queries stop from the next instant
(:meth:`MasterCore.revoke_user <strata.master.core.MasterCore.revoke_user>`).  Role changes
(``strata users set-roles``) apply to open sessions at their next call or message; ``strata users
logout`` (or a replaced password) ends the sessions opened before it.  :meth:`UsersWatch.check` is
plain logic over the file's contents; the thread only calls it.
"""

from __future__ import annotations

import logging
import threading

from strata.errors import one_line
from strata.logs import RepeatLimiter

from .core import MasterCore
from .sessions import Sessions, dominates

__all__ = ["UsersWatch"]

log = logging.getLogger("strata.master")
#: a warning that may repeat every check (an unreadable file): once a minute, with a count
limited = RepeatLimiter(log)


class UsersWatch:
    """Applies changes of the users file while the master runs (privacy switches).

    Every ``interval`` it re-reads the file if it changed; a user who was
    removed, or whose clearance no longer dominates this master's level (or is
    missing or unknown: a bad entry means no access), loses their sessions and
    their queries stop from the next instant (:meth:`MasterCore.revoke_user`).
    Role changes (``strata users set-roles``) apply to open sessions at their
    next call or message.  ``strata users remove``, ``set-clearance``,
    ``set-roles`` and ``logout`` are the administrator's switches.  The thread
    never dies: an error is logged and the next check runs as usual.
    """

    def __init__(self, core: MasterCore, sessions: Sessions, users, interval: float = 0.5):
        self.core = core
        self.sessions = sessions
        self.users = users
        self.interval = interval
        self._stamp = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="users-watch", daemon=True)

    def start(self):
        self._thread.start()
        return self

    def stop(self):
        self._stop.set()
        self._thread.join(timeout=5)

    def check(self) -> list[str]:
        """Revoke whoever lost access since the last check and apply role changes; returns the
        users revoked."""
        try:
            st = self.users.path.stat()
            stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        except FileNotFoundError:
            stamp = None
        if stamp == self._stamp:
            return []
        try:
            known = self.users.load()
        except Exception as e:  # noqa: BLE001 - a half-edited file must not revoke everyone
            limited.warning("users-file", "users file unreadable, keeping current access: %s", one_line(e))
            self._stamp = stamp
            return []
        self._stamp = stamp
        lat = self.users.lattice
        gone = []
        for user in sorted(self.sessions.users()):
            u = known.get(user)
            if u is not None and u.sessions_after:  # strata users logout / a replaced password
                n = self.sessions.end_before(user, u.sessions_after)
                if n:
                    log.warning("ended %d session(s) of %s opened before %s", n, user, u.sessions_after)
        for user in sorted(self.core.owners() | self.sessions.users()):
            u = known.get(user)
            if u is None or not dominates(lat, self.core.level, getattr(u, "clearance", None)):
                why = "removed" if u is None else (f"clearance {u.clearance}" if u.clearance is not None
                                                   else "bad users-file entry")
                self.sessions.end_user(user)  # first: a subscriber stops before its queries end
                qids = self.core.revoke_user(user, why)
                log.warning("revoked %s (%s): queries %s stop after instant %s", user, why, qids,
                            self.core.last_closed())
                gone.append(user)
            else:
                n = self.sessions.set_roles(user, getattr(u, "roles", ()))
                if n:
                    log.warning("roles of %s now %s (%d open session(s))", user,
                                ", ".join(sorted(getattr(u, "roles", ()))), n)
        return gone

    def _run(self):
        while not self._stop.wait(self.interval):
            try:
                self.check()
            except Exception:  # noqa: BLE001 - revocation must keep working: log, check again later
                limited.exception("users", "users-file check failed; will check again")
                self._stamp = None
