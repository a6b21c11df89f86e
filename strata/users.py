"""Users, credentials (argon2id hashes) and principals.

The users file lives next to the configuration (``<config-stem>.users.json``),
mode 0600, and holds for each user a clearance and an argon2id hash — never a
password.  A user may log in at any level its clearance dominates (a
*principal*, dissertation §4.1).
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from argon2 import PasswordHasher
from argon2.exceptions import InvalidHashError, VerificationError, VerifyMismatchError

from .lattice import Lattice, LevelError

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
# verified against unknown names so that timing does not reveal which names exist
_DUMMY_HASH = _HASHER.hash("strata-dummy-password")


class UserError(ValueError):
    """Bad user administration request (unknown user, bad name, ...)."""


class AuthError(PermissionError):
    """Login refused.  The message never says whether the name or the password was wrong."""


@dataclass(frozen=True)
class User:
    name: str
    clearance: str
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
    """All principals of a user: one per level its clearance dominates (Table 4.1)."""
    return [Principal(user.name, lv) for lv in lattice.levels if lattice.leq(lv, user.clearance)]


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

    # -- persistence -------------------------------------------------------------
    def load(self) -> dict[str, User]:
        if not self.path.exists():
            return {}
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as e:
            raise UserError(f"{self.path}: unreadable users file: {e}") from None
        users = {}
        for name, rec in data.get("users", {}).items():
            users[name] = User(name, rec["clearance"], rec["hash"], float(rec.get("sessions_after", 0.0)),
                               frozenset(rec.get("roles", DEFAULT_ROLES)))
        return users

    def _save(self, users: dict[str, User]) -> None:
        data = {"format": _FORMAT, "users": {
            u.name: {"clearance": u.clearance, "hash": u.hash, "roles": sorted(u.roles),
                     **({"sessions_after": u.sessions_after} if u.sessions_after else {})}
            for u in sorted(users.values(), key=lambda u: u.name)
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
        if roles is None:
            roles = users[name].roles if name in users else DEFAULT_ROLES
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
        """Check the password and that ``level`` (default: the clearance) is allowed."""
        user = self.load().get(name)
        try:
            _HASHER.verify(user.hash if user else _DUMMY_HASH, password or "")
        except (VerifyMismatchError, VerificationError, InvalidHashError):
            raise AuthError("login failed: unknown user or wrong password") from None
        if user is None:
            raise AuthError("login failed: unknown user or wrong password")
        if level is None:
            return Principal(user.name, user.clearance, user.roles)
        try:
            lv = self.lattice.parse(level)
        except LevelError as e:
            raise AuthError(f"login failed: {e}") from None
        if not self.lattice.leq(lv, user.clearance):
            raise AuthError(f"login failed: {name} may not log in at level {lv}")
        return Principal(user.name, lv, user.roles)
