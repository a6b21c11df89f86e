"""The reference for security punctuations and privacy switches (docs/semantics.md §11-12), written
from the semantics, tuple by tuple, independently of the engine (no import of master/, worker/,
chunking/ or strata.punctuations).

:func:`evaluate_access` filters one query's input streams (the policies in force at each tuple's
instant for its own level, then the query's switches), evaluates the query with the existing
reference evaluator, then drops the output rows at instants when a switch of the query is off
(the terminal switch).
"""

from __future__ import annotations

import dataclasses
from dataclasses import replace

from strata.mlscql import parse

from .evaluator import Outcome, evaluate_outcome

__all__ = ["evaluate_access", "shield_streams", "query_attributes", "terminal_rows"]


def _parts(text) -> list[str]:
    return [p.strip() for p in (text or "").split("|") if p.strip()]


def query_attributes(text: str, schema) -> set[str]:
    """The attributes of ``schema`` the query names anywhere (all of them with a SELECT *)."""
    names, star = set(), [False]

    def walk(x):
        if isinstance(x, (list, tuple, set, frozenset)):
            for y in x:
                walk(y)
        elif dataclasses.is_dataclass(x):
            kind = type(x).__name__
            if kind == "Column":
                names.add(x.name.lower())
            if kind == "Query" and x.select is None:
                star[0] = True
            if kind == "Window":
                names.update(p.lower() for p in (x.partition_by or ()))
            for f in dataclasses.fields(x):
                walk(getattr(x, f.name))

    walk(parse(text))
    return {c for c, _ in schema.columns if star[0] or c.lower() in names}


def _matches(sp: dict, stream: str, tup: dict) -> bool:
    """Whether the sp's stream and tuple patterns match the tuple."""
    if sp["stream"] != "*" and sp["stream"].lower() != stream.lower():
        return False
    pattern = (sp.get("tuples") or "").strip()
    if pattern in ("", "*"):
        return True
    attr, values = (x.strip() for x in pattern.split("=", 1))
    key = next((k for k in tup if k.lower() == attr.lower()), None)
    v = tup.get(key) if key is not None else None
    if v is None:
        return False
    if ".." in values:
        lo, hi = (float(x) for x in values.split(".."))
        return lo <= float(v) <= hi
    for want in _parts(values):
        if isinstance(v, bool):
            if want.lower() == str(v).lower():
                return True
        elif isinstance(v, (int, float)):
            if float(want) == float(v):
                return True
        elif want == v:
            return True
    return False


def _names_principal(sp: dict, user: str, roles: set[str]) -> bool:
    return user in _parts(sp.get("users")) or bool({r.lower() for r in _parts(sp.get("roles"))} & roles)


def _covers(sp: dict, attr: str) -> bool:
    a = (sp.get("attributes") or "*").strip()
    return a == "*" or attr.lower() in {x.lower() for x in _parts(a)}


def _visible(policy: list[dict], stream: str, tup: dict, user: str, roles: set[str], attrs: set[str]) -> bool:
    mine = [sp for sp in policy if _matches(sp, stream, tup) and _names_principal(sp, user, roles)]
    pos = [sp for sp in mine if sp["sign"] == "+"]
    neg = [sp for sp in mine if sp["sign"] == "-"]
    if not pos or any((sp.get("attributes") or "*").strip() == "*" for sp in neg):
        return False
    return all(any(_covers(sp, a) for sp in pos) and not any(_covers(sp, a) for sp in neg) for a in attrs)


def _policy(punctuations: list[dict], stream: str, level: str, ts: int) -> list[dict] | None:
    """The policy in force for (stream, level) at instant ts: all sps of the latest instant <= ts that
    has sps naming the stream (or *) at that level; None if there is none."""
    mine = [p for p in punctuations if p["level"] == level and (p["stream"] == "*" or p["stream"].lower() == stream.lower())
            and p["ts"] <= ts]
    if not mine:
        return None
    t = max(p["ts"] for p in mine)
    return [p for p in mine if p["ts"] == t]


def _off(switches: list[tuple], stream: str | None, ts: int) -> bool:
    """Whether a switch (stream, off_from, on_again or None) of ``stream`` (None: any) is off at ts."""
    return any((stream is None or s.lower() == stream.lower()) and a <= ts and (b is None or ts < b)
               for s, a, b in switches)


def shield_streams(config, text: str, streams: dict[str, list[dict]], punctuations: list[dict],
                   principal: tuple[str, set[str]], switches: list[tuple] = ()) -> dict[str, list[dict]]:
    """The query's input: each stream without the tuples the policies or the switches hide from it."""
    user, roles = principal
    out = {}
    for name, rows in streams.items():
        schema = config.stream(name)
        attrs = query_attributes(text, schema) if schema is not None else set()
        kept = []
        for r in rows:
            pol = _policy(punctuations, name, r["level"], r["ts"])
            if pol is not None and not _visible(pol, name, r, user, set(roles), attrs):
                continue
            if _off(switches, name, r["ts"]):
                continue
            kept.append(r)
        out[name] = kept
    return out


def terminal_rows(rows: list[tuple], switches: list[tuple]) -> list[tuple]:
    return [r for r in rows if not _off(switches, None, r[0])]


def evaluate_access(text: str, config, level: str, streams: dict[str, list[dict]], punctuations: list[dict],
                    principal: tuple[str, set[str]], switches: list[tuple] = ()) -> Outcome:
    """The query's outcome under the lattice (the evaluator), then policies, then switches."""
    lat = config.lattice
    punct = [dict(p, level=lat.parse(p["level"])) for p in punctuations]
    canon = {n: [dict(r, level=lat.parse(r["level"])) for r in rows] for n, rows in streams.items()}
    out = evaluate_outcome(text, config, level, shield_streams(config, text, canon, punct, principal, switches))
    return replace(out, rows=terminal_rows(out.rows, switches))
