"""Security punctuations (Nehme, Rundensteiner, Bertino, ICDE 2008; docs/semantics.md §11): what they
are, how they are read, and which tuples a policy lets a query see.

A security punctuation (sp) is an access-control rule that travels in the input like data: the
reserved stream :data:`STREAM` (``_punctuations``; a name the name rule refuses for user streams, so
it can never collide with one, and no query can read it).  Its rows go through the ordinary ingest
path (shepherd, event log, exactly-once, checkpoints, standby log shipping) and have the columns of
:data:`SCHEMA`:

=============  ===========================================================================
``ts``         the instant from which the policy holds
``level``      the punctuation's level: it governs only tuples of exactly that level
``stream``     a stream name, or ``*`` (every stream)
``tuples``     the tuple pattern: empty or ``*`` (every tuple), ``ATTR=LO..HI`` (a closed
               numeric range, the paper's ``[120,133]``), or ``ATTR=V1|V2|...`` (values)
``attributes`` ``*`` or ``A1|A2|...``: the attributes the rule is about
``roles``      ``R1|R2|...``: Strata roles (:data:`strata.users.ROLES`) it grants or denies
``users``      ``U1|U2|...``: user names it grants or denies (roles, users or both)
``sign``       ``+`` (grant) or ``-`` (deny)
``immutable``  the paper's flag: recorded and shown, no effect (Strata has no server-side
               policies an sp could be combined with; docs/semantics.md §11)
=============  ===========================================================================

The punctuations of one (stream, level) at one instant form one policy (the paper's sp-batch); a
policy replaces the previous one of that (stream, level) wholesale from its instant on (Fig. 10).
This module is plain logic: parsing a batch into :class:`Punctuation` s with one-line refusals
(:func:`parse_batch`), and a policy's decision over an Arrow table (:func:`visible_mask`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from .config import StreamSchema
from .users import ROLES

__all__ = ["STREAM", "SCHEMA", "Punctuation", "PunctuationError", "is_punctuation_stream", "input_schema",
           "parse_batch", "tuple_mask", "visible_mask", "referenced_attributes", "to_json", "from_json"]

#: the reserved input stream of security punctuations (refused as a user stream name: it starts with '_')
STREAM = "_punctuations"

#: its columns (after ``ts`` and ``level``), as a stream schema so input files are read like any stream's
SCHEMA = StreamSchema(STREAM, (("stream", "string"), ("tuples", "string"), ("attributes", "string"),
                               ("roles", "string"), ("users", "string"), ("sign", "string"),
                               ("immutable", "boolean")))

#: most punctuation rows one instant of one (stream, level) may hold (a policy is evaluated per tuple batch)
MAX_POLICY_SPS = 1000


class PunctuationError(ValueError):
    """A punctuation batch refused whole (one line)."""


def is_punctuation_stream(name) -> bool:
    return isinstance(name, str) and name.lower() == STREAM


def input_schema(config, name: str):
    """The schema of input stream ``name``: a configured stream's, the punctuation stream's, or None."""
    s = config.stream(name) if isinstance(name, str) else None
    if s is None and is_punctuation_stream(name):
        return SCHEMA
    return s


@dataclass(frozen=True)
class Punctuation:
    """One sp: ``stream`` is a canonical stream name or ``*``; ``attribute`` None = every tuple, else
    the tuple pattern over that attribute: ``values`` (a tuple of typed values) or ``lo``/``hi``."""

    ts: int
    level: str
    stream: str
    attribute: str | None
    values: tuple | None
    lo: float | None
    hi: float | None
    attributes: tuple[str, ...] | None  # None: every attribute (``*``)
    roles: frozenset
    users: frozenset
    positive: bool
    immutable: bool = False

    def grants_to(self, user: str, roles: frozenset) -> bool:
        """Whether the sp names the principal (its user or one of its roles)."""
        return user in self.users or bool(self.roles & roles)

    def covers(self, attr: str) -> bool:
        return self.attributes is None or attr in self.attributes


def _split(text) -> list[str]:
    return [p.strip() for p in (text or "").split("|") if p.strip()]


def _attr_of(config, stream: str, name: str, what: str) -> tuple[str, list[tuple[str, str]]]:
    """The canonical attribute ``name`` and the (stream, type) pairs that have it (``stream`` ``*``: all)."""
    streams = [s for s in config.streams.values() if not s.relation] if stream == "*" else [config.streams[stream]]
    found = []
    canon = None
    for s in streams:
        for col, typ in s.columns:
            if col.lower() == name.lower():
                canon = canon or col
                found.append((s.name, typ))
    if not found:
        where = "any stream" if stream == "*" else f"stream {stream}"
        raise PunctuationError(f"{what}: no attribute {name!r} in {where}")
    return canon, found


def _value(v: str, typ: str, what: str):
    try:
        if typ in ("long", "timestamp"):
            return int(v)
        if typ == "double":
            x = float(v)
            if not np.isfinite(x):
                raise ValueError
            return x
        if typ == "boolean":
            if v.lower() not in ("true", "false"):
                raise ValueError
            return v.lower() == "true"
        return v
    except ValueError:
        raise PunctuationError(f"{what}: {v!r} is not a {typ} value") from None


def _parse_row(config, r: dict, what: str) -> Punctuation:
    stream = (r.get("stream") or "").strip()
    if stream != "*":
        s = config.stream(stream) if stream else None
        if s is None or s.relation:
            raise PunctuationError(f"{what}: stream must be a stream name or *, not {stream!r} "
                                   f"(streams: {', '.join(n for n, x in config.streams.items() if not x.relation)})")
        stream = s.name
    attribute = values = lo = hi = None
    tp = (r.get("tuples") or "").strip()
    if tp not in ("", "*"):
        if "=" not in tp:
            raise PunctuationError(f"{what}: tuples must be *, ATTR=LO..HI or ATTR=V1|V2|..., not {tp!r}")
        name, pat = (x.strip() for x in tp.split("=", 1))
        attribute, holders = _attr_of(config, stream, name, what)
        if ".." in pat:
            a, b = (x.strip() for x in pat.split("..", 1))
            if any(t not in ("long", "double", "timestamp") for _, t in holders):
                raise PunctuationError(f"{what}: a range needs a numeric attribute; {attribute} is not")
            lo, hi = (_value(x, "double", what) for x in (a, b))
            if lo > hi:
                raise PunctuationError(f"{what}: empty range {a}..{b}")
        else:
            vals = _split(pat)
            if not vals:
                raise PunctuationError(f"{what}: tuples {tp!r} names no value")
            types = {t for _, t in holders}
            if len(types) > 1:
                raise PunctuationError(f"{what}: attribute {attribute} has types {', '.join(sorted(types))} in "
                                       "different streams; name one stream")
            typ = types.pop()
            values = tuple(_value(v, typ, what) for v in vals)
    ap = (r.get("attributes") or "*").strip()
    attributes = None
    if ap != "*":
        names = _split(ap)
        if not names:
            raise PunctuationError(f"{what}: attributes must be * or A1|A2|..., not {ap!r}")
        attributes = tuple(sorted({_attr_of(config, stream, n, what)[0] for n in names}))
    roles = frozenset(x.lower() for x in _split(r.get("roles")))
    bad = sorted(roles - set(ROLES))
    if bad:
        raise PunctuationError(f"{what}: unknown role(s) {', '.join(bad)} (roles: {', '.join(ROLES)})")
    users = frozenset(_split(r.get("users")))
    if not roles and not users:
        raise PunctuationError(f"{what}: name at least one role or user it grants or denies")
    sign = (r.get("sign") or "").strip()
    if sign not in ("+", "-"):
        raise PunctuationError(f"{what}: sign must be + or -, not {sign!r}")
    return Punctuation(int(r["ts"]), r["level"], stream, attribute, values, lo, hi, attributes, roles, users,
                       sign == "+", bool(r.get("immutable") or False))


def parse_batch(config, rows: list[dict], first_row: int = 1) -> list[Punctuation]:
    """The punctuations of a batch (dicts with the columns of :data:`SCHEMA`, levels canonical), or
    :class:`PunctuationError` naming the first bad row."""
    return [_parse_row(config, r, f"punctuation row {i + first_row}") for i, r in enumerate(rows)]


def to_json(p: Punctuation) -> dict:
    return dataclasses.asdict(p) | {"values": None if p.values is None else list(p.values),
                                    "attributes": None if p.attributes is None else list(p.attributes),
                                    "roles": sorted(p.roles), "users": sorted(p.users)}


def from_json(d: dict) -> Punctuation:
    return Punctuation(**(d | {"values": None if d["values"] is None else tuple(d["values"]),
                               "attributes": None if d["attributes"] is None else tuple(d["attributes"]),
                               "roles": frozenset(d["roles"]), "users": frozenset(d["users"])}))


# ---- a policy's decision -----------------------------------------------------------------------------
def tuple_mask(sp: Punctuation, table) -> np.ndarray:
    """Which rows of an Arrow ``table`` (a batch of one stream) the sp's tuple pattern matches (a NULL
    value, or a stream without the attribute, never matches)."""
    import pyarrow as pa  # deferred: this module is imported by the CLI's input reading (strata --help)
    import pyarrow.compute as pc

    n = table.num_rows
    if sp.attribute is None:
        return np.ones(n, dtype=bool)
    if sp.attribute not in table.column_names:
        return np.zeros(n, dtype=bool)
    col = table.column(sp.attribute)
    if sp.values is not None:
        m = pc.is_in(col, value_set=pa.array(sp.values, type=col.type))
    else:
        m = pc.and_(pc.greater_equal(col, sp.lo), pc.less_equal(col, sp.hi))
    return np.asarray(pc.fill_null(m, False).to_numpy(zero_copy_only=False), dtype=bool)


def visible_mask(policy: list[Punctuation], matches, user: str, roles: frozenset,
                 attrs: tuple[str, ...]) -> np.ndarray:
    """Which tuples ``policy`` (in force, non-empty) lets a query of ``user`` with ``roles`` see, when
    the query reads ``attrs`` of the stream; ``matches(sp)``: the sp's tuple mask over the tuples.
    Denial by default; a tuple is visible iff a positive sp matching it names the principal, no
    negative sp over every attribute matching it names the principal, and each attribute in
    ``attrs`` is covered by a positive sp matching it and by no negative one (all naming the principal)."""
    mine = [sp for sp in policy if sp.grants_to(user, roles)]
    if not any(sp.positive for sp in mine):
        return np.zeros(len(matches(None)), dtype=bool)
    granted = denied_all = None
    pos = {a: None for a in attrs}
    neg = {a: None for a in attrs}

    def union(a, m):
        return m.copy() if a is None else (a | m)

    for sp in mine:
        m = matches(sp)
        if sp.positive:
            granted = union(granted, m)
        elif sp.attributes is None:
            denied_all = union(denied_all, m)
        for a in attrs:
            if sp.covers(a):
                if sp.positive:
                    pos[a] = union(pos[a], m)
                else:
                    neg[a] = union(neg[a], m)
    out = granted
    if denied_all is not None:
        out &= ~denied_all
    for a in attrs:
        if pos[a] is None:
            return np.zeros(len(out), dtype=bool)
        out &= pos[a]
        if neg[a] is not None:
            out &= ~neg[a]
    return out


def referenced_attributes(query, schema) -> tuple[str, ...]:
    """The attributes of stream ``schema`` that ``query`` (an MLS-CQL AST) names anywhere, whatever the
    qualifier (every attribute for a ``SELECT *`` anywhere in it), in declaration order."""
    names: set[str] = set()
    star = False

    def visit(x) -> None:
        nonlocal star
        if isinstance(x, (list, tuple, frozenset, set)):
            for y in x:
                visit(y)
            return
        if not dataclasses.is_dataclass(x):
            return
        kind = type(x).__name__
        if kind == "Column":
            names.add(x.name.lower())
        elif kind == "Query" and getattr(x, "select", "") is None:
            star = True
        elif kind == "Window":
            names.update(c.lower() for c in (x.partition_by or ()))
        for f in dataclasses.fields(x):
            visit(getattr(x, f.name))

    visit(query)
    return tuple(c for c, _ in schema.columns if star or c.lower() in names)
