"""Client sessions: password login at the master's level, bearer tokens, throttling, roles.

Sessions are looked up by a SHA-256 of their token; with a
:class:`~strata.master.store.MasterStore` they outlive a master restart (only
the digest is written to disk).

Every call but Login/Logout/Status needs a role of the session's user
(:data:`strata.users.ROLES`): :meth:`Sessions.require` checks the session *and*
the role on every call (and on every batch of an ingest stream, every message
of a result stream), so a revocation or a role change applied by the users-file
watcher (:meth:`Sessions.set_roles`) takes effect at the next message.  The
``owner`` of a private master (``strata master --owner NAME``, used by the
embedded runs a user starts for themself) has every role there.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import Counter
from dataclasses import dataclass, replace

from strata.users import ROLES, AuthError, Principal, UserStore

from .store import token_digest

__all__ = ["Sessions", "Session", "RoleError", "dominates"]


class RoleError(PermissionError):
    """A call outside the session's roles; the message names the role needed."""


def dominates(lattice, level: str, clearance) -> bool:
    """Whether ``clearance`` dominates ``level``; a missing or unknown clearance (a bad users-file
    entry) dominates nothing."""
    if clearance is None:
        return False
    try:
        return bool(lattice.leq(level, clearance))
    except Exception:  # noqa: BLE001 - e.g. a hand-edited clearance the lattice does not know
        return False


@dataclass
class Session:
    token: str
    principal: Principal
    created: float
    last_used: float
    created_wall: float = 0.0  # epoch seconds: compared with the user's ``sessions_after``


class Sessions:
    """Login level must equal the master's level; the clearance may be higher."""

    def __init__(self, store: UserStore, level: str, ttl: float = 12 * 3600,
                 max_failures: int = 5, lockout: float = 30.0, clock=time.monotonic, persist=None,
                 wall=time.time, owner: str | None = None):
        self.store = store
        self.owner = owner or None  # has every role on this master (a private, embedded master)
        self.denied: Counter = Counter()  # calls refused for a missing role (call name → n)
        self.persist = persist  # MasterStore or None
        self._wall = wall
        self.level = level
        self.ttl = ttl
        self.max_failures = max_failures
        self.lockout = lockout
        self._clock = clock
        self._by_token: dict[str, Session] = {}
        self._failures: dict[str, tuple[int, float]] = {}
        self._lock = threading.Lock()
        self.failed_logins = 0
        self.logouts = 0  # sessions ended by ``strata users logout`` or a replaced password

    def login(self, user: str, password: str, level: str) -> Session:
        now = self._clock()
        with self._lock:
            n, since = self._failures.get(user, (0, now))
            if n >= self.max_failures and now - since < self.lockout:
                self.failed_logins += 1
                raise AuthError(f"login failed: too many failed attempts; retry in {self.lockout - (now - since):.0f} s")
        try:
            lv = self.store.lattice.parse(level) if level else self.level
        except ValueError:
            lv = level
        try:
            if lv != self.level:
                raise AuthError(f"login failed: this master serves level {self.level}; log in at that level")
            try:
                principal = self.store.authenticate(user, password, lv)
            except AuthError:
                raise
            except Exception:  # noqa: BLE001 - a bad users-file entry (unknown clearance): no access
                raise AuthError("login failed: unknown user or wrong password") from None
        except AuthError:
            with self._lock:
                n, since = self._failures.get(user, (0, now))
                self._failures[user] = (n + 1, now if n == 0 or now - since >= self.lockout else since)
                self.failed_logins += 1
            raise
        principal = replace(principal, roles=self._roles_of(principal.user, getattr(principal, "roles", None)))
        with self._lock:
            self._failures.pop(user, None)
            s = Session(secrets.token_urlsafe(32), principal, now, now, self._wall())
            self._by_token[token_digest(s.token)] = s
        if self.persist is not None:
            self.persist.save_session(s.token, principal.user, principal.level, s.created_wall)
        return s

    def check(self, token: str | None) -> Session:
        now = self._clock()
        key = token_digest(token or "")
        with self._lock:
            s = self._by_token.get(key)
            if s is None or now - s.created > self.ttl:
                if s is not None:
                    del self._by_token[key]
                    if self.persist is not None:
                        self.persist.drop_session(key)
                raise AuthError("invalid or expired session token")
            s.last_used = now
            return s

    def _roles_of(self, user: str, roles) -> frozenset:
        if self.owner is not None and user == self.owner:
            return frozenset(ROLES)
        return frozenset(roles or ())

    def require(self, token: str | None, roles: tuple[str, ...], call: str) -> Session:
        """The session of ``token`` if it has one of ``roles``; raises AuthError (no session) or
        RoleError (counted under ``call``) with a one-line reason naming the role needed."""
        s = self.check(token)
        have = s.principal.roles
        if not any(r in have for r in roles):
            with self._lock:
                self.denied[call] += 1
            need = " or ".join(roles)
            raise RoleError(f"permission denied: {call} needs the {need} role; {s.principal} has "
                            f"{', '.join(sorted(have)) or 'no role'} (strata users set-roles)")
        return s

    def set_roles(self, user: str, roles) -> int:
        """Give every open session of ``user`` these roles (the users file changed); returns how many changed."""
        new = self._roles_of(user, roles)
        n = 0
        with self._lock:
            for t, s in self._by_token.items():
                if s.principal.user == user and s.principal.roles != new:
                    s.principal = replace(s.principal, roles=new)
                    n += 1
        return n

    def logout(self, token: str) -> None:
        key = token_digest(token)
        with self._lock:
            self._by_token.pop(key, None)
        if self.persist is not None:
            self.persist.drop_session(key)

    def restore(self) -> int:
        """Take back the sessions a previous run of this master persisted (expired ones are dropped)."""
        if self.persist is None:
            return 0
        now, wall = self._clock(), self._wall()
        users = self.store.load()
        n = 0
        for st in self.persist.sessions():
            age = wall - st.created
            u = users.get(st.user)  # the users file may have changed while the master was down
            if age > self.ttl or st.level != self.level or u is None or \
                    not dominates(self.store.lattice, st.level, u.clearance) or st.created < u.sessions_after:
                self.persist.drop_session(st.token_sha256)
                continue
            principal = Principal(st.user, st.level, self._roles_of(st.user, getattr(u, "roles", None)))
            with self._lock:
                self._by_token[st.token_sha256] = Session("", principal, now - age, now, st.created)
            n += 1
        return n

    def end_user(self, user: str) -> int:
        """End every session of a user (revocation); returns how many ended."""
        with self._lock:
            gone = [t for t, s in self._by_token.items() if s.principal.user == user]
            for t in gone:
                del self._by_token[t]
        if self.persist is not None:
            self.persist.drop_user_sessions(user)
        return len(gone)

    def end_before(self, user: str, wall: float) -> int:
        """End the sessions of ``user`` opened before ``wall`` (epoch seconds; ``strata users
        logout``, a replaced password); later ones stay.  Returns how many ended."""
        with self._lock:
            gone = [t for t, s in self._by_token.items() if s.principal.user == user and s.created_wall < wall]
            for t in gone:
                del self._by_token[t]
            self.logouts += len(gone)
        if self.persist is not None:
            for t in gone:
                self.persist.drop_session(t)
        return len(gone)

    def users(self) -> set[str]:
        with self._lock:
            return {s.principal.user for s in self._by_token.values()}
