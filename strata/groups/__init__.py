"""Per-level group settings and the group key that authenticates group members.

From the configuration::

    [groups."S"]
    address = "239.255.10.3"     # multicast group of the S level (default: derived from the level)
    port = 47000                 # multicast port (default [cluster] multicast_port, 47000)
    interface = "127.0.0.1"      # interface heartbeats go out on (default loopback only)
    ttl = 0                      # 0: this host only; 1: one hop (a bridge between hosts)
    key_file = "keys/S.key"      # 32+ random bytes, hex; relative to the config file

A deployment may override ``address``, ``interface`` and ``ttl`` per process through
the environment (``STRATA_GROUP_ADDRESS``, ``STRATA_GROUP_INTERFACE``,
``STRATA_GROUP_TTL``): ``strata deploy`` gives every host its own interface.

Without a key in the configuration, ``strata up`` generates one per level in
its state directory.  The key is never used directly: HKDF-SHA256 derives one
key per purpose from it (:func:`derive_key`): ``heartbeat-aead`` encrypts and
authenticates heartbeats (AES-256-GCM, :mod:`strata.groups.membership`) and ``request-mac``
authenticates master→worker calls (HMAC-SHA256 over the request).  So a process
of another level, or one without the key, can neither join, read nor drive a
group.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import os
import re
import time
from pathlib import Path

from strata.config import Config, ConfigError
from strata.private import private_dir

__all__ = ["execute_wire", "group_spec", "load_or_create_key", "sign_request", "verify_request", "level_slug", "AUTH_HEADER",
           "derive_key", "KEY_PURPOSES", "execute_digest"]

AUTH_HEADER = "x-strata-group-auth"
MAX_SKEW = 60.0


def level_slug(level: str) -> str:
    """A file-name-safe spelling of a level ([1,B] → 1_B)."""
    return re.sub(r"[^A-Za-z0-9]+", "_", level.replace("⊥", "bot")).strip("_") or "level"


def load_or_create_key(path: Path, create: bool) -> bytes:
    if path.exists():
        text = path.read_text().strip()
        try:
            key = bytes.fromhex(text)
        except ValueError:
            raise ConfigError(f"{path}: group key must be hex") from None
        if len(key) < 16:
            raise ConfigError(f"{path}: group key must have at least 16 bytes")
        return key
    if not create:
        raise ConfigError(f"{path}: group key file missing (strata up creates one)")
    private_dir(path.parent, "key directory")
    key = os.urandom(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key.hex() + "\n")
    return key


def group_spec(config: Config, level: str, state_dir: Path | None = None, create_key: bool = False):
    """The group of ``level``: its ``[groups."L"]`` settings with the ``[cluster]`` defaults
    (:meth:`~strata.config.Config.group`), the environment's per-process overrides, and its key
    (the configuration's, else the one in ``state_dir``, made with ``create_key``)."""
    # deferred: strata.groups loads with the CLI; the heartbeat machinery only when a process joins its group
    from strata.groups.membership import GroupSpec

    g = config.group(level)
    level = g.level
    address, interface, ttl = _env_overrides(g.address, g.interface, g.ttl)
    if g.key is not None:
        key = g.key
    else:
        kf = g.key_path(config.path)
        if kf is None and state_dir is not None:
            kf = Path(state_dir) / "keys" / f"{level_slug(level)}.key"
        elif kf is None:
            raise ConfigError(f"no group key for level {level}: set [groups.\"{level}\"] key_file, or use --state-dir")
        key = load_or_create_key(kf, create_key)
    return GroupSpec(level=level, address=address, port=g.port, key=key, interface=interface, ttl=ttl,
                     interval=config.cluster.heartbeat_seconds)


def _env_overrides(address: str, interface: str, ttl: int) -> tuple[str, str, int]:
    """Per-process overrides from the environment (``strata deploy`` sets them per host).

    ``STRATA_GROUP_ADDRESS`` (the level's multicast group), ``STRATA_GROUP_INTERFACE``
    (this host's interface address: where heartbeats go out and the group is joined)
    and ``STRATA_GROUP_TTL``.  A process serves one level, so they apply to its group.
    """
    import ipaddress

    env = os.environ
    if env.get("STRATA_GROUP_ADDRESS"):
        address = env["STRATA_GROUP_ADDRESS"].strip()
        try:
            ok = ipaddress.IPv4Address(address).is_multicast
        except ValueError:
            ok = False
        if not ok:
            raise ConfigError(f"STRATA_GROUP_ADDRESS={address!r} is not an IPv4 multicast address")
    if env.get("STRATA_GROUP_INTERFACE"):
        interface = env["STRATA_GROUP_INTERFACE"].strip()
        try:
            ipaddress.IPv4Address(interface)
        except ValueError:
            raise ConfigError(f"STRATA_GROUP_INTERFACE={interface!r} is not an IPv4 interface address") from None
    if env.get("STRATA_GROUP_TTL"):
        try:
            ttl = int(env["STRATA_GROUP_TTL"])
        except ValueError:
            ttl = -1
        if not 0 <= ttl <= 255:
            raise ConfigError(f"STRATA_GROUP_TTL={env['STRATA_GROUP_TTL']!r} must be 0..255")
    return address, interface, ttl


#: what a level's group key is used for; each purpose gets its own derived key
KEY_PURPOSES = ("heartbeat-aead", "request-mac")


@functools.lru_cache(maxsize=64)
def derive_key(group_key: bytes, purpose: str) -> bytes:
    """The 32-byte key of ``purpose`` (:data:`KEY_PURPOSES`) derived from a level's group key (HKDF-SHA256)."""
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    if purpose not in KEY_PURPOSES:
        raise ValueError(f"unknown key purpose {purpose!r}")
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=b"strata group key v2",
                info=b"strata/" + purpose.encode()).derive(bytes(group_key))


def sign_request(key: bytes, level: str, payload_digest: bytes, now: float | None = None) -> str:
    """The ``x-strata-group-auth`` header of a master→worker call: time and HMAC under the
    group key's ``request-mac`` key."""
    ts = f"{(now if now is not None else time.time()):.3f}"
    mac = hmac.new(derive_key(key, "request-mac"), b"|".join([level.encode(), ts.encode(), payload_digest]),
                   hashlib.sha256).hexdigest()
    return f"{ts}:{mac}"


def verify_request(key: bytes, level: str, payload_digest: bytes, header: str | None) -> bool:
    if not header or ":" not in header:
        return False
    ts, mac = header.split(":", 1)
    if not mac.isascii():
        return False
    try:
        t = float(ts)
    except ValueError:
        return False
    if not abs(time.time() - t) <= MAX_SKEW:  # also refuses nan and inf
        return False
    want = hmac.new(derive_key(key, "request-mac"), b"|".join([level.encode(), ts.encode(), payload_digest]),
                    hashlib.sha256).hexdigest()
    return hmac.compare_digest(want, mac)


def execute_digest(req, chunk: bytes | None = None) -> bytes:
    """What the group MAC of an Execute call (a ``pb.ExecuteRequest``) covers: level, queries, the
    master's epoch (a master with standbys; none: 0, not hashed, the digest of before) and chunk
    bytes.  The master signs it (:func:`sign_request`), the worker checks it (and fences an epoch
    below the highest it has seen).  ``chunk``: the request's chunk bytes when the caller has them
    already (reading ``req.chunk`` copies them: ~45 ms for a 44 MB unit); ``req`` then needs only
    ``level``, ``queries`` and ``epoch``."""
    h = hashlib.sha256()
    h.update(req.level.encode())
    for q in req.queries:
        h.update(b"\x00" + q.query_id.encode() + b"\x00" + q.level.encode() + b"\x00" + q.text.encode())
    epoch = int(getattr(req, "epoch", 0) or 0)
    if epoch:
        h.update(b"\x02" + epoch.to_bytes(8, "big"))
    h.update(b"\x01")
    h.update(req.chunk if chunk is None else chunk)
    return h.digest()


def execute_wire(head, chunk: bytes) -> bytes:
    """The serialized ``pb.ExecuteRequest`` of ``head`` (its level and queries, no chunk) with ``chunk``
    as its field 3, the bytes ``SerializeToString`` gives for the whole message (a non-empty chunk), built with one copy of
    the chunk instead of three (into the message, into its serialization, out for the digest)."""
    n, length = len(chunk), bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        length.append(low | (0x80 if n else 0))
        if not n:
            break
    return b"".join([head.SerializeToString(), b"\x1a", bytes(length), chunk])
