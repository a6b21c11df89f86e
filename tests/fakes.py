"""Stand-ins for gRPC objects in tests that call a servicer's methods directly."""

from __future__ import annotations


class Context:
    """Just what the master's servicers ask of a gRPC context: the session token, aborts (as
    AssertionError, so a test sees the code and message) and the caller's peer."""

    def __init__(self, token: str, peer: str = "ipv4:127.0.0.1:5555"):
        self.md = [("authorization", f"Bearer {token}")]
        self._peer = peer

    def invocation_metadata(self):
        return self.md

    def abort(self, code, message):
        raise AssertionError(f"aborted: {code} {message}")

    def peer(self):
        return self._peer
