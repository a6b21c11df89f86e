"""Directories that hold a level's data (state, logs, keys, certificates): this user's only.

A state directory holds a level's event log, keys, logs and ``cluster.json``; one a user made
beforehand with the usual 0755 would leave the logs and the cluster record readable by every local
user.  :func:`private_dir` makes a missing directory 0700 and tightens an existing one of this user
to 0700; a directory owned by another user is refused with one line (tightening it is not ours to do,
and its owner could read everything we wrote).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from .errors import EXIT_ERROR, CliError

__all__ = ["private_dir", "write_private", "open_private_log"]


def private_dir(path: str | Path, what: str = "state directory") -> Path:
    """``path`` as a directory only this user can enter (made 0700, or tightened to it); raises
    :class:`CliError` (one line) for something that is not a directory or belongs to another user."""
    p = Path(path)
    try:
        p.mkdir(parents=True, exist_ok=True, mode=0o700)
        st = p.stat()
    except FileExistsError:
        raise CliError(f"{what} {p} exists and is not a directory", EXIT_ERROR) from None
    except OSError as e:
        raise CliError(f"{what} {p}: {e.strerror or e}", EXIT_ERROR) from None
    if not stat.S_ISDIR(st.st_mode):
        raise CliError(f"{what} {p} exists and is not a directory", EXIT_ERROR)
    if st.st_uid != os.getuid():
        raise CliError(f"{what} {p} belongs to uid {st.st_uid}, not to this user (uid {os.getuid()}); "
                       f"use a directory of your own", EXIT_ERROR)
    if stat.S_IMODE(st.st_mode) & 0o077:
        try:
            p.chmod(0o700)
        except OSError as e:
            raise CliError(f"{what} {p} is readable by others (mode {stat.S_IMODE(st.st_mode):04o}) and cannot be "
                           f"made private: {e.strerror or e}", EXIT_ERROR) from None
    return p


def write_private(path: str | Path, text: str) -> None:
    """Replace ``path`` with ``text``, readable by this user only (0600), atomically (a reader sees the
    old or the new content, never half of it)."""
    p = Path(path)
    tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, p)


def open_private_log(path: str | Path):
    """``path`` opened for appending bytes, created 0600 (a process's log holds its level's details)."""
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab")
