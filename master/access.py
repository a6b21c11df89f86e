"""Privacy switches on the master (paper 004; docs/semantics.md §12): the checks of a grant or a
revocation, as plain logic the core calls under its lock.

``strata access revoke|grant --user U --query Q --stream S`` (an operator of the master's level)
turns U's access to S for Q off or on from the first instant not closed.  A query has one user,
its owner, so a switch is per (query, owner, stream): its access counter is 1 while on and 0 while
off, and both the initial switch (the chunker's input filter) and the terminal switch (output
suppression) act on it.  The switch changes are logged as ``access`` events, so a restart and a
standby reproduce them.
"""

from __future__ import annotations

from .admission import Refused
from .queries import QueryInfo

__all__ = ["check_switch", "access_event"]


def check_switch(info: QueryInfo | None, query_id: str, user: str, stream: str, streams_read: list[str]) -> str:
    """The canonical stream of a switch change, or :class:`Refused` (``bad_switch``) in one line: an unknown
    or stopped query, a user other than its owner, a stream it does not read."""
    if info is None:
        raise Refused(f"no query {query_id} at this level", "bad_switch")
    if info.state != "running" or info.ended:
        raise Refused(f"query {query_id} is {info.shown_state}: it has no access to switch", "bad_switch")
    if user != info.owner:
        raise Refused(f"user {user} is not the user of query {query_id} (a query has one user, its owner; "
                      "a switch is per query, owner and stream)", "bad_switch")
    by_lower = {s.lower(): s for s in streams_read}
    if not isinstance(stream, str) or stream.lower() not in by_lower:
        raise Refused(f"query {query_id} does not read stream {stream!r} (it reads {', '.join(streams_read)})",
                      "bad_switch")
    return by_lower[stream.lower()]


def access_event(query_id: str, user: str, stream: str, on: bool, at: int, by: str) -> tuple[str, dict, None]:
    """A switch change: ``user``'s access to ``stream`` for ``query_id`` on or off from instant ``at``,
    made by operator ``by``."""
    return "access", {"query_id": query_id, "user": user, "stream": stream, "on": bool(on), "at": int(at),
                      "by": by}, None
