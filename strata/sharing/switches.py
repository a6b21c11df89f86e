"""Where privacy switches go in a shared plan: the placement algorithm of Zaki, Lee, Chrysanthis
(paper 004, Algorithm 2), as a pure function over an operator DAG.

For each query, traverse the DAG backwards from its output (depth first): a **terminal** switch at
its output; at an operator used by that query alone, continue to its inputs, and at a leaf (an
input stream) place an **initial** switch; at the first operator met that is shared with another
query (a "common-prefix" operator), place an **in-network** switch on the edge leaving it toward
the query's own operators, and do not go further down.

:func:`place_switches` works on any DAG given as query outputs, an inputs function, a common-prefix
predicate and a stream-of-leaf function (the paper's Fig. 2 network in tests/test_switches.py);
:func:`plan_switches` applies it to Strata's :class:`~strata.sharing.plan.SharedPlan` (window nodes
are its leaves, each reading one input stream; an operator is common-prefix when several queries
use it).  What each placement does at run time in Strata: docs/semantics.md §12.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Hashable, Iterable

from .optree import describe

__all__ = ["SwitchPlacement", "place_switches", "plan_switches"]


@dataclass(frozen=True)
class SwitchPlacement:
    """One switch: ``kind`` terminal | in-network | initial, for ``query``; ``at``: the query's output
    (terminal), the shared operator whose outgoing edge it sits on (in-network, ``to``: the operator
    of the query it leads to, None for the query's output), or the input stream (initial)."""

    kind: str
    query: str
    at: Hashable
    to: Hashable | None = None


def place_switches(outputs: dict[str, Hashable], inputs: Callable[[Hashable], Iterable[Hashable]],
                   common: Callable[[Hashable], bool],
                   stream_of: Callable[[Hashable], Hashable] = lambda v: v) -> list[SwitchPlacement]:
    """Algorithm 2: the switches of every query (``outputs``: query -> its root operator), each once."""
    out: list[SwitchPlacement] = []
    seen: set[SwitchPlacement] = set()

    def put(p: SwitchPlacement) -> None:
        if p not in seen:
            seen.add(p)
            out.append(p)

    for q, root in outputs.items():
        put(SwitchPlacement("terminal", q, root))
        stack: list[tuple[Hashable, Hashable | None]] = [(root, None)]
        visited: set = set()
        while stack:
            v, parent = stack.pop()
            if common(v):
                put(SwitchPlacement("in-network", q, v, parent))
                continue
            if v in visited:
                continue
            visited.add(v)
            children = list(inputs(v))
            if not children:
                put(SwitchPlacement("initial", q, stream_of(v)))
            for w in reversed(children):
                stack.append((w, v))
    return out


def plan_switches(plan) -> list[dict]:
    """The switch placement on a :class:`SharedPlan` (replicated or trusted), as JSON-able rows."""
    outputs = {qid: e.root for qid, e in plan.queries.items()}
    placed = place_switches(outputs, lambda n: n.inputs, lambda n: len(plan.users.get(n, ())) > 1,
                            lambda n: n.stream)
    lat = plan.lattice
    rows = []
    for p in placed:
        if p.kind == "initial":
            at = f"stream {p.at}"
        elif p.kind == "terminal":
            at = f"output of {p.query}"
        else:
            at = f"{describe(p.at, lat)} -> " + (describe(p.to, lat) if p.to is not None else f"output of {p.query}")
        rows.append({"kind": p.kind, "query": p.query, "at": at})
    return rows
