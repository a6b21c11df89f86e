"""Users, credentials (argon2id hashes) and principals.

The users file lives next to the configuration (``<config-stem>.users.json``),
mode 0600, and holds for each user a clearance, roles and an argon2id hash —
never a password.  A user may log in at any level its clearance dominates (a
*principal*, dissertation §4.1).

One broken entry never stops the others: an entry with an unknown clearance, a
missing hash, bad roles or no object at all loads as a user with
``clearance=None`` (no access at any level, no principals, every login refused);
the reason is logged once and kept in :attr:`UserStore.problems`.  Only a file
that is not a users file at all raises :class:`UserError` (callers then keep
the access they had).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from argon2 import PasswordHasher, extract_parameters
from argon2.exceptions import InvalidHashError, VerificationError, VerifyMismatchError

from .lattice import Lattice, LevelError
from .mlscql.authorize import may_read

__all__ = ["UserStore", "User", "Principal", "AuthError", "UserError", "principals", "check_roles", "ROLES", "DEFAULT_ROLES"]

#: what a session may do at its level, besides reading what its level dominates:
#: ``producer`` ingest, advance, finish; ``analyst`` register, subscribe to and cancel its own
#: queries; ``operator`` cluster status (workers, loads, timings, counters) and finish
ROLES = ("producer", "analyst", "operator")
DEFAULT_ROLES = frozenset({"analyst"})

_NAME = re.compile(r"[A-Za-z0-9_.@-]{1,64}")
_FORMAT = 1
# argon2id; parameters of RFC 9106's second recommended option (memory-constrained)
_HASHER = PasswordHasher(time_cost=3, memory_cost=64 * 1024, parallelism=4)
# verified against unknown names so that timing does not reveal which names exist: a hash with
# _HASHER's parameters (tests/test_users.py checks they agree), written out rather than computed
# at import, which cost every process (client, master, workers) ~0.2 s of CPU
_DUMMY_HASH = "$argon2id$v=19$m=65536,t=3,p=4$kLWuzu7ZWPIayTZU57R7Dw$5J65B4vy5BIyeDshHbIx7SmuL9xGlgtCe1/+fWmn3YI"
_LOGIN_FAILED = "login failed: unknown user or wrong password"
log = logging.getLogger("strata.users")


class UserError(ValueError):
    """Bad user administration request (unknown user, bad name, ...)."""


class AuthError(PermissionError):
    """Login refused.  The message never says whether the name or the password was wrong."""


@dataclass(frozen=True)
class User:
    name: str
    #: None: the users-file entry is broken (see ``UserStore.problems``); no access at any level
    clearance: str | None
    hash: str
    #: wall-clock time (epoch seconds); sessions created before it are ended (``strata users logout``)
    sessions_after: float = 0.0
    roles: frozenset = DEFAULT_ROLES


@dataclass(frozen=True)
class Principal:
    """A user logged in at one level (dominated by the user's clearance)."""

    user: str
    level: str
    roles: frozenset = field(default=frozenset(), compare=False)

    def __str__(self) -> str:
        return f"{self.user}.{self.level}"


def principals(user: User, lattice: Lattice) -> list[Principal]:
    """All principals of a user: one per level its clearance dominates (Table 4.1); none without one."""
    if user.clearance is None:
        return []
    return [Principal(user.name, lv, user.roles) for lv in lattice.levels if may_read(lattice, user.clearance, lv)]


def check_roles(roles) -> frozenset:
    """Roles as a frozenset of :data:`ROLES` names; accepts an iterable or ``"producer,analyst"``."""
    if isinstance(roles, str):
        roles = [r.strip() for r in roles.split(",") if r.strip()]
    out = frozenset(str(r).strip().lower() for r in roles)
    bad = sorted(out - set(ROLES))
    if bad:
        raise UserError(f"unknown role(s) {', '.join(bad)} (roles: {', '.join(ROLES)})")
    if not out:
        raise UserError(f"give at least one role ({', '.join(ROLES)})")
    return out


class UserStore:
    def __init__(self, path: str | Path, lattice: Lattice):
        self.path = Path(path)
        self.lattice = lattice
        #: user name → why that entry gives no access, as of the last :meth:`load`
        self.problems: dict[str, str] = {}
        self._loaded: dict[str, tuple[User, object]] = {}  # broken entries: (as loaded, raw record)
        self._logged: set[tuple[str, str]] = set()

    # -- persistence -------------------------------------------------------------
    def load(self) -> dict[str, User]:
        """All users; a broken entry loads with ``clearance=None`` (see the module doc)."""
        if not self.path.exists():
            self.problems, self._loaded = {}, {}
            return {}
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError, RecursionError) as e:
            raise UserError(f"{self.path}: unreadable users file: {e}") from None
        entries = data.get("users", {}) if isinstance(data, dict) else None
        if not isinstance(entries, dict):
            raise UserError(f'{self.path}: not a users file (expected {{"users": {{...}}}})')
        users, problems, loaded = {}, {}, {}
        for name, rec in entries.items():
            user, problem = self._entry(name, rec)
            users[name] = user
            if problem is not None:
                problems[name] = problem
                loaded[name] = (user, rec)
                if (name, problem) not in self._logged:
                    self._logged.add((name, problem))
                    log.warning("%s: user %r has no access: %s", self.path, name, problem)
        self.problems, self._loaded = problems, loaded
        return users

    def _entry(self, name: str, rec) -> tuple[User, str | None]:
        """One entry of the file, and what is wrong with it (None: nothing)."""
        if not isinstance(rec, dict):
            return User(name, None, "", 0.0, frozenset()), "the entry is not an object"
        bad: list[str] = []
        if not _NAME.fullmatch(name):
            bad.append("the name is not 1-64 characters of letters, digits, _ . @ -")
        clearance = rec.get("clearance")
        if not isinstance(clearance, str):
            bad.append("no clearance" if clearance is None else "the clearance is not a string")
            clearance = None
        else:
            try:
                clearance = self.lattice.parse(clearance)
            except LevelError as e:
                # never echo what may be a hash put in the wrong field
                echo = len(clearance) <= 64 and "$" not in clearance
                bad.append(f"clearance: {e}" if echo else "the clearance is not a level of the lattice")
                clearance = None
        pw_hash = rec.get("hash")
        if not isinstance(pw_hash, str) or not pw_hash:
            bad.append("no password hash" if pw_hash is None else "the password hash is not a string")
            pw_hash = ""
        else:
            try:
                extract_parameters(pw_hash)
            except (InvalidHashError, ValueError):
                bad.append("the password hash is not an argon2 hash")
                pw_hash = ""
        roles = rec.get("roles", sorted(DEFAULT_ROLES))
        try:
            if not isinstance(roles, list) or not all(isinstance(r, str) for r in roles):
                raise UserError("must be a list of role names")
            roles = check_roles(roles)
        except UserError as e:
            bad.append(f"roles: {e}")
            roles = frozenset()
        after = rec.get("sessions_after", 0.0)
        if isinstance(after, bool) or not isinstance(after, (int, float)) or not math.isfinite(after):
            bad.append("sessions_after is not a number")
            after = 0.0
        if bad:
            return User(name, None, pw_hash, float(after), roles), "; ".join(bad)
        return User(name, clearance, pw_hash, float(after), roles), None

    def _record(self, u: User):
        """The file's entry for ``u``: a broken entry that was not changed is written back as it was;
        a changed one keeps the fields it still lacks."""
        loaded, raw = self._loaded.get(u.name, (None, None))
        if loaded is u:
            return raw
        rec = dict(raw) if isinstance(raw, dict) else {}
        if u.clearance is not None:
            rec["clearance"] = u.clearance
        if u.hash:
            rec["hash"] = u.hash
        if u.roles:
            rec["roles"] = sorted(u.roles)
        rec.pop("sessions_after", None)
        if u.sessions_after:
            rec["sessions_after"] = u.sessions_after
        return rec

    def _save(self, users: dict[str, User]) -> None:
        data = {"format": _FORMAT, "users": {
            u.name: self._record(u) for u in sorted(users.values(), key=lambda u: u.name)
        }}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".users-", dir=self.path.parent)
        try:
            os.fchmod(fd, 0o600)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(data, f, indent=2)
                f.write("\n")
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        os.chmod(self.path, 0o600)

    # -- administration ------------------------------------------------------------
    def add(self, name: str, clearance: str, password: str, replace: bool = False,
            roles=None) -> User:
        """``roles``: some of :data:`ROLES` (default: ``analyst``; a replaced user keeps theirs)."""
        if not _NAME.fullmatch(name or ""):
            raise UserError(f"user name {name!r} must be 1-64 characters of letters, digits, _ . @ -")
        try:
            clearance = self.lattice.parse(clearance)
        except LevelError as e:
            raise UserError(f"clearance: {e}") from None
        if not password:
            raise UserError("empty password")
        if len(password) > 1024:
            raise UserError("password longer than 1024 characters")
        users = self.load()
        if name in users and not replace:
            raise UserError(f"user {name!r} already exists (use --replace to change it)")
        if roles is None:  # a replaced user keeps its roles (a broken entry's unusable ones: the default)
            roles = users[name].roles if name in users and users[name].roles else DEFAULT_ROLES
        roles = check_roles(roles)
        # replacing a user (a new password) ends the sessions opened with the old one
        users[name] = User(name, clearance, _HASHER.hash(password), time.time() if name in users else 0.0, roles)
        self._save(users)
        return users[name]

    def remove(self, name: str) -> None:
        users = self.load()
        if name not in users:
            raise UserError(f"no user {name!r}")
        del users[name]
        self._save(users)

    def end_sessions(self, name: str) -> User:
        """End every session ``name`` has now, on every master (they re-check the users file);
        clearance, password and queries stay as they are: the user may log in again."""
        users = self.load()
        if name not in users:
            raise UserError(f"no user {name!r}")
        u = users[name]
        users[name] = User(u.name, u.clearance, u.hash, max(time.time(), u.sessions_after), u.roles)
        self._save(users)
        return users[name]

    def set_clearance(self, name: str, clearance: str) -> User:
        users = self.load()
        if name not in users:
            raise UserError(f"no user {name!r}")
        try:
            clearance = self.lattice.parse(clearance)
        except LevelError as e:
            raise UserError(f"clearance: {e}") from None
        users[name] = User(name, clearance, users[name].hash, users[name].sessions_after, users[name].roles)
        self._save(users)
        return users[name]

    def set_roles(self, name: str, roles) -> User:
        """Replace a user's roles; running masters apply the change to open sessions within a second."""
        users = self.load()
        if name not in users:
            raise UserError(f"no user {name!r}")
        u = users[name]
        users[name] = User(u.name, u.clearance, u.hash, u.sessions_after, check_roles(roles))
        self._save(users)
        return users[name]

    # -- login -----------------------------------------------------------------------
    def authenticate(self, name: str, password: str, level: str | None = None) -> Principal:
        """Check the password and that ``level`` (default: the clearance) is allowed.

        An unknown user and a user without access (a broken entry) cost the same argon2 work as a
        wrong password and get the same message."""
        user = self.load().get(name)
        usable = user is not None and user.clearance is not None
        try:
            _HASHER.verify(user.hash if usable else _DUMMY_HASH, password or "")
        except (VerifyMismatchError, VerificationError, InvalidHashError):
            raise AuthError(_LOGIN_FAILED) from None
        if not usable:
            raise AuthError(_LOGIN_FAILED)
        if level is None:
            return Principal(user.name, user.clearance, user.roles)
        try:
            lv = self.lattice.parse(level)
        except LevelError as e:
            raise AuthError(f"login failed: {e}") from None
        if not may_read(self.lattice, user.clearance, lv):
            raise AuthError(f"login failed: {name} may not log in at level {lv}")
        return Principal(user.name, lv, user.roles)
