"""Client sessions: password login at the master's level, bearer tokens, throttling, roles.

Sessions are looked up by a SHA-256 of their token; with a
:class:`~strata.master.store.MasterStore` they outlive a master restart (only
the digest is written to disk).

Every call but Login/Logout/Status needs a role of the session's user
(:data:`strata.users.ROLES`): :meth:`Sessions.require` checks the session *and*
the role on every call (and on every batch of an ingest stream, every message
of a result stream), so a revocation or a role change applied by the users-file
watcher (:class:`~strata.master.users_watch.UsersWatch`, :meth:`Sessions.set_roles`) takes
effect at the next message.  The ``owner`` of a private master (``strata master --owner NAME``,
used by the embedded runs a user starts for themself) has every role there.

Open result and ingest streams are limited per session and per user (:class:`StreamLimits`,
``[limits] max_streams_per_session`` and ``max_streams_per_user``).
"""

from __future__ import annotations

import ipaddress
import secrets
import threading
import time
from collections import Counter
from dataclasses import dataclass, replace

from strata.config import Limits
from strata.throttle import LOGIN_FAILED, MAX_PASSWORD, MAX_USER_NAME, LoginThrottle
from strata.users import ROLES, AuthError, Principal, UserStore

from .store import token_digest

__all__ = ["Sessions", "Session", "RoleError", "StreamLimits", "dominates", "MAX_USER_NAME", "MAX_PASSWORD",
           "LOGIN_FAILED", "DEFAULT_MAX_STREAMS_PER_SESSION", "DEFAULT_MAX_STREAMS_PER_USER"]

#: the defaults of ``[limits] max_streams_per_session`` and ``max_streams_per_user`` (strata/config.py)
DEFAULT_MAX_STREAMS_PER_SESSION = Limits.max_streams_per_session
DEFAULT_MAX_STREAMS_PER_USER = Limits.max_streams_per_user


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


def _peer_host(peer: str | None) -> str | None:
    """The client host of a gRPC peer string (``ipv4:10.0.0.5:5555`` → ``10.0.0.5``); IPv6 by
    its /64 (one host may hold all of it), IPv4-mapped IPv6 as the IPv4 address; other
    transports (unix sockets) as their kind."""
    if not peer:
        return None
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return kind[:32]
    addr = rest.rsplit(":", 1)[0].strip("[]")
    try:
        ip = ipaddress.ip_address(addr.split("%", 1)[0])
    except ValueError:
        return addr[:64]
    if ip.version == 6 and ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    if ip.version == 6:
        return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(ip)


class Sessions:
    """Login level must equal the master's level; the clearance may be higher.

    Failed logins are throttled per user (``max_failures`` within ``lockout`` seconds of each
    other lock the name for ``lockout`` s after the last) and per client host
    (``peer_max_failures``, default 4x: a host may serve many users); at most ``max_records``
    failure records are kept, the least recently touched dropped first."""

    def __init__(self, store: UserStore, level: str, ttl: float = 12 * 3600,
                 max_failures: int = 5, lockout: float = 30.0, clock=time.monotonic, persist=None,
                 wall=time.time, owner: str | None = None, peer_max_failures: int | None = None,
                 max_records: int = 10_000):
        self.store = store
        self.owner = owner or None  # has every role on this master (a private, embedded master)
        self.denied: Counter = Counter()  # calls refused for a missing role (call name → n)
        self.persist = persist  # MasterStore or None
        self._wall = wall
        self.level = level
        self.ttl = ttl
        self._clock = clock
        self._by_token: dict[str, Session] = {}
        self.throttle = LoginThrottle(max_failures, lockout, peer_max_failures, max_records, clock)
        self._lock = threading.Lock()
        self.failed_logins = 0
        self.logouts = 0  # sessions ended by ``strata users logout`` or a replaced password

    def login(self, user: str, password: str, level: str, peer: str | None = None) -> Session:
        """A session for ``user`` at ``level``, or AuthError with a message that never says
        whether the user exists.

        The attempt takes a slot (counted as a failure) under the lock *before* the password
        is checked, per user and per client host (``peer``: the gRPC peer string), so parallel
        guesses cannot all reach argon2; a success gives the slots back.  argon2 runs outside
        the lock, so one slow check never holds up other logins."""
        now = self._clock()
        keys = self._take_slot(user, _peer_host(peer), now)
        try:
            principal = self._verify(user, password, level)
        except AuthError:
            with self._lock:
                self.failed_logins += 1
            raise
        principal = replace(principal, roles=self._roles_of(principal.user, getattr(principal, "roles", None)))
        self._give_back(keys)
        with self._lock:
            s = Session(secrets.token_urlsafe(32), principal, now, now, self._wall())
            self._by_token[token_digest(s.token)] = s
        if self.persist is not None:
            self.persist.save_session(s.token, principal.user, principal.level, s.created_wall)
        return s

    def _take_slot(self, user: str, host: str | None, now: float) -> tuple[str | None, str | None]:
        """Count this attempt against the user and the host (strata/throttle.py), or refuse it."""
        try:
            return self.throttle.take(user, host, now)
        except AuthError:
            with self._lock:
                self.failed_logins += 1
            raise

    def _give_back(self, keys) -> None:
        self.throttle.give_back(keys)

    # the throttle's settings and records, as tests and status read them
    max_failures = property(lambda self: self.throttle.max_failures)
    lockout = property(lambda self: self.throttle.lockout)
    peer_max_failures = property(lambda self: self.throttle.peer_max_failures)
    max_records = property(lambda self: self.throttle.max_records)
    _failures = property(lambda self: self.throttle.records)

    def _verify(self, user: str, password: str, level: str) -> Principal:
        """The principal if the password and level are right (argon2; called outside the lock)."""
        try:
            lv = self.store.lattice.parse(level) if level else self.level
        except ValueError:
            lv = level
        if lv != self.level:
            raise AuthError(f"login failed: this master serves level {self.level}; log in at that level")
        if len(password or "") > MAX_PASSWORD:  # no user has one: the generic failure, no argon2 work
            raise AuthError(LOGIN_FAILED)
        try:
            return self.store.authenticate(user, password, lv)
        except AuthError:
            raise
        except Exception:  # noqa: BLE001 - a bad users-file entry (unknown clearance): no access
            raise AuthError(LOGIN_FAILED) from None

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

    def holds(self, token: str | None) -> bool:
        """Whether ``token`` is a session of this object (expired or not; a trusted master routes a
        call to the level whose sessions hold its token: master/trusted.py)."""
        key = token_digest(token or "")
        with self._lock:
            return key in self._by_token

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

    def denied_counts(self) -> dict[str, int]:
        """The calls refused for a missing role so far (call name -> n; operators see them)."""
        with self._lock:
            return dict(self.denied)

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


class StreamLimits:
    """Open streams per session and per user: one more than allowed is refused (counted under
    ``too_many_streams``), so no one user can hold the master's streams."""

    def __init__(self, per_session: int = DEFAULT_MAX_STREAMS_PER_SESSION,
                 per_user: int = DEFAULT_MAX_STREAMS_PER_USER, count=None):
        self.per_session = int(per_session)
        self.per_user = int(per_user)
        self._count = count  # reason -> None: counts a refusal (the core's rejected counts)
        self._lock = threading.Lock()
        self.sessions: Counter = Counter()  # session token -> open streams
        self.users: Counter = Counter()

    @classmethod
    def of(cls, config, count=None) -> "StreamLimits":
        return cls(config.limits.max_streams_per_session, config.limits.max_streams_per_user, count)

    def open(self, session, call: str) -> str | None:
        """Take a stream slot for ``session``; None, or the one-line reason it is refused."""
        key, user = session.token, session.principal.user
        with self._lock:
            if self.sessions[key] >= self.per_session:
                why = (f"too many open streams: this session already has {self.sessions[key]} open (limit "
                       f"{self.per_session}, [limits] max_streams_per_session); {call} refused, close one first")
            elif self.users[user] >= self.per_user:
                why = (f"too many open streams: user {user} already has {self.users[user]} open across its "
                       f"sessions (limit {self.per_user}, [limits] max_streams_per_user); {call} refused")
            else:
                self.sessions[key] += 1
                self.users[user] += 1
                return None
        if self._count is not None:
            self._count("too_many_streams")
        return why

    def close(self, session) -> None:
        key, user = session.token, session.principal.user
        with self._lock:
            for c, k in ((self.sessions, key), (self.users, user)):
                c[k] -= 1
                if c[k] <= 0:
                    del c[k]

    def open_streams(self) -> int:
        with self._lock:
            return sum(self.sessions.values())
