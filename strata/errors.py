"""The errors every part of Strata shares, and the command line's exit codes.

One module, imported by the core, the roles and the CLI alike (the core never
imports the CLI): an error that should end a command carries its exit code, and
``strata.cli.main`` prints its message as one line and exits with that code.
"""

from __future__ import annotations

__all__ = ["StrataError", "CliError", "ConfigError", "EXIT_OK", "EXIT_ERROR", "EXIT_REJECTED", "EXIT_LOGIN", "EXIT_FAILED",
           "EXIT_DENIED", "one_line", "ONE_LINE_LIMIT"]

#: success
EXIT_OK = 0
#: an operational error (bad config, I/O) and a query literal beyond a limit (``strata explain``)
EXIT_ERROR = 1
#: a refused query, input or advance, or bad usage
EXIT_REJECTED = 2
#: a failed login or an ended session
EXIT_LOGIN = 3
#: a query failed while it ran (``strata query``, ``strata replay``)
EXIT_FAILED = 4
#: the call needs a role the session does not have
EXIT_DENIED = 5


class StrataError(Exception):
    """Base of Strata's own errors that end a command: a one-line message and an exit code."""

    def __init__(self, message: str, code: int = EXIT_ERROR):
        super().__init__(message)
        self.code = code


class CliError(StrataError):
    """An error a command reports to its user (one line on stderr, exit ``code``)."""


class ConfigError(ValueError):
    """A configuration (file, section, key or value) Strata cannot use; the message names where."""


#: the longest error text :func:`one_line` returns (the ellipsis included)
ONE_LINE_LIMIT = 300


def one_line(text, limit: int = ONE_LINE_LIMIT) -> str:
    """An error text as the one line a user is shown, whichever side (CLI, master, worker) formats it.

    Every run of whitespace, newlines included, becomes one space (so a multi-line error, a Spark
    message with its plan, say, keeps its later lines' content on the one line) and the ends are
    stripped; a text longer than ``limit`` characters keeps its first ``limit - 3`` and ends in
    ``...``.  ``None`` is the empty text; an exception whose message is empty is named by its type.
    """
    if text is None:
        return ""
    line = " ".join(str(text).split())
    if not line and isinstance(text, BaseException):
        line = type(text).__name__
    return line if len(line) <= limit else line[: max(0, limit - 3)] + "..."
