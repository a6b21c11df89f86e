"""The trusted architecture's levels (``[cluster] mode = "trusted"``, docs/trusted.md): which levels one
master process and one worker group serve, checked once at the edge for the commands that start them
(``strata master``, ``strata worker``, ``strata up``).

A trusted process serves a set of levels with a *top*: the one level of the set that dominates all the
others (the level whose group it joins: heartbeats, group key).  It holds the certificate of each of
its levels (``master-L``, ``worker-L``: ``strata certs``), so a client or master of level L meets, on
the same address, a server that proves it is of level L, as with a process of level L alone.
"""

from __future__ import annotations

from .commands import split_levels
from .errors import EXIT_REJECTED, CliError

__all__ = ["trusted_levels", "top_of", "bottom_of", "MODES"]

#: the deployment architectures (``[cluster] mode``; ``strata up --mode``)
MODES = ("replicated", "trusted")


def top_of(lattice, levels) -> str | None:
    """The level of ``levels`` that dominates every other one, or None if there is none."""
    for lv in levels:
        if all(lattice.leq(other, lv) for other in levels):
            return lv
    return None


def bottom_of(lattice, levels) -> str | None:
    """The level of ``levels`` that every other one dominates, or None if there is none."""
    for lv in levels:
        if all(lattice.leq(lv, other) for other in levels):
            return lv
    return None


def trusted_levels(config, level: str, text: str | None, flag: str = "--trusted-levels") -> tuple[str, ...]:
    """The levels a trusted process of ``level`` serves, from ``text`` (comma-separated; ``level`` is
    added): ``level`` first, then the others in the lattice's order; ``()`` when ``text`` is empty (a
    process of one level, the replicated mode).  A level ``level`` does not dominate, or an unknown
    one, is refused with one line (exit 2)."""
    if not text or not text.strip():
        return ()
    lattice = config.lattice
    try:
        named = [lattice.parse(x) for x in split_levels(text)]
    except ValueError as e:
        raise CliError(f"{flag}: {e}", EXIT_REJECTED) from None
    above = [lv for lv in named if not lattice.leq(lv, level)]
    if above:
        raise CliError(f"{flag}: {', '.join(above)} not dominated by --level {level} (a trusted process's level is "
                       f"the top of the levels it serves)", EXIT_REJECTED)
    return (level, *lattice.sort(lv for lv in named if lv != level))

