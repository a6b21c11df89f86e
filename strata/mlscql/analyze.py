"""Semantic analysis, authorization, secure rewriting and optimization.

``compile_query(text, config, level)`` runs the whole front end of SEMANTICS.md
§3-4 and returns a :class:`CompiledQuery`:

1. parse, and bound every literal (``limits.py``: window sizes, RANGE lengths
   in instants, 64-bit integers, finite doubles → :class:`LimitError`);
2. semantic analysis against the declared streams: resolve FROM items and
   columns (every column ends up qualified by its FROM item), decide which
   names are level literals, type-check, check GROUP BY / HAVING;
3. **authorize** (Alg. 2 with ≤, ``authorize.py``): every level the query names,
   in a window clause or anywhere in an expression, must be dominated by the
   query level;
4. **rewrite** (Alg. 3): no window → ``[RANGE UNBOUNDED]``; no level clause →
   ``level in dominated(L)``; a clause is intersected with ``dominated(L)``;
5. **optimize** (Alg. 4 as corrected): reject disjoint window/WHERE level sets;
   move the WHERE level set into RANGE/UNBOUNDED/NOW windows and into
   PARTITION BY windows partitioned by ``level``; drop it for ROWS windows
   whose set is already inside it.

Errors are :class:`QueryError` subclasses whose message names the clause and
never contains data.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace

from ..config import Config, StreamSchema
from ..lattice import LevelError
from . import ast as A
from .authorize import authorize
from .errors import AuthorizationError, LimitError, OptimizationError, QueryError, SemanticError
from .limits import check_query
from .parser import parse
from .printer import expr_text, to_text

__all__ = [
    "CompiledQuery", "ItemInfo", "OutputColumn", "QueryError", "LimitError", "SemanticError",
    "AuthorizationError", "OptimizationError", "compile_query", "analyze", "NUMERIC", "LegacyMode", "legacy_mode",
]

NUMERIC = ("long", "double", "timestamp")


@dataclass(frozen=True)
class ItemInfo:
    name: str  # alias, else stream name: the qualifier of its columns
    stream: str
    schema: StreamSchema


@dataclass(frozen=True)
class OutputColumn:
    name: str
    type: str  # string | long | double | boolean | timestamp | level | null


class LegacyMode(enum.Enum):
    """How a query's history before a chunk reaches the worker."""

    WINDOW = "window"  # bounded legacy per FROM item (ROWS/RANGE/NOW/PARTITION)
    STATE = "state"  # unbounded aggregate over one FROM item: running state snapshot
    NONE = "none"  # unbounded, one FROM item, no aggregate, ISTREAM/DSTREAM: no history needed
    HISTORY = "history"  # unbounded otherwise (joins, RSTREAM of a selection): full visible history


@dataclass(frozen=True)
class CompiledQuery:
    """A query accepted at ``level``, rewritten and optimized (SEMANTICS §4)."""

    text: str
    level: str
    query: A.Query  # final form: qualified columns, explicit windows with level sets
    items: tuple[ItemInfo, ...]
    outputs: tuple[OutputColumn, ...]
    r2s: str  # effective: ISTREAM | RSTREAM | DSTREAM
    is_aggregate: bool
    notes: tuple[str, ...] = field(default=(), compare=False)
    #: the rewritten query before Alg. 4 when Alg. 4 narrowed a window whose instants it had to keep
    #: (``Window.instants``, which query text cannot spell): what :attr:`rewritten` prints then
    before_optimization: A.Query | None = field(default=None, compare=False)
    #: a compound query (``q1 UNION q2 EXCEPT q3``): its SELECTs, each compiled on its own with this
    #: query's stream operator, and the set operators between them (``A.SET_OPS``).  Then ``query``
    #: holds the FROM items of all branches in order (``items`` too) and the written stream operator
    branches: tuple["CompiledQuery", ...] = ()
    set_ops: tuple[str, ...] = ()
    #: a query over subqueries in FROM (``SELECT … FROM (SELECT …) x, Vitals [ROWS 5] v``): per FROM item
    #: of the outer query, its subquery compiled on its own and evaluated as RSTREAM (its relation at
    #: every instant), or None for a stream; and the outer query, compiled over each ``x`` as a stream
    #: whose tuples at τ are that relation's rows (``[NOW]``).  Then ``query`` and ``items`` are what
    #: chunks carry: per outer FROM item, the stream item or the subquery's FROM items, in order
    subqueries: tuple["CompiledQuery | None", ...] = ()
    outer: "CompiledQuery | None" = None

    @property
    def rewritten(self) -> str:
        """The rewritten text shown to the user (qualifiers dropped for one FROM item): the optimized
        query, or the rewritten one before optimization when an optimization kept instants that its
        text could not show (compiling the shown text gives this same query again)."""
        return to_text(self.shown)

    @property
    def shown(self) -> "A.Query | A.Compound":
        """The query :attr:`rewritten` prints."""
        if self.branches:
            return A.Compound(tuple(b.shown for b in self.branches), self.set_ops, self.query.r2s, self.query.wrapped)
        if self.subqueries:
            o = self.outer.shown
            return replace(o, from_=tuple(f if sub is None else A.FromItem(f.stream, None, f.stream, subquery=sub.shown)
                                          for f, sub in zip(o.from_, self.subqueries)))
        q = self.before_optimization or self.query
        return q if len(self.items) > 1 else _strip_qualifiers(q)

    def window_levels(self, i: int) -> frozenset[str]:
        return self.query.from_[i].window.levels

    @property
    def legacy_mode(self) -> "LegacyMode":
        """How chunks of this query carry its history (:func:`legacy_mode`)."""
        return legacy_mode(self)

    def to_json(self) -> dict:
        wins = []
        for item, f in zip(self.items, self.query.from_):
            w = f.window
            d = {"stream": item.stream, "alias": f.alias or item.stream, "kind": w.kind,
                 "levels": list(w.clause.levels)}
            if w.rows is not None:
                d["rows"] = w.rows
            if w.kind == "range":
                d["range"] = {"amount": w.range_amount, "unit": w.range_unit}
                if w.slide_amount is not None:
                    d["slide"] = {"amount": w.slide_amount, "unit": w.slide_unit}
            if w.partition_by:
                d["partition_by"] = list(w.partition_by)
            if w.filter is not None:  # filters the stream before the window (not the instants)
                d["filter"] = expr_text(_strip_expr(w.filter) if len(self.items) == 1 else w.filter)
            if w.instants is not None:  # Alg. 4 narrowed the window; the instants are these levels' arrivals
                d["instants_of"] = list(w.instants)
            wins.append(d)
        extra = {}
        if self.branches:
            extra = {"branches": [to_text(b.shown) for b in self.branches], "set_ops": list(self.set_ops)}
        if self.subqueries:
            extra = {"subqueries": [{"name": it.name, "query": sub.rewritten}
                                    for it, sub in zip(self.outer.items, self.subqueries) if sub is not None]}
        return {
            **extra,
            "level": self.level,
            "query": self.text,
            "rewritten": self.rewritten,
            "r2s": self.r2s,
            "aggregate": self.is_aggregate,
            "windows": wins,
            "columns": [{"name": c.name, "type": c.type} for c in self.outputs],
            "notes": list(self.notes),
        }


def legacy_mode(cq) -> LegacyMode:
    """How chunks of compiled query ``cq`` carry history.

    Bounded windows (ROWS, RANGE, NOW, PARTITION BY) always carry a bounded
    per-item legacy.  With a ``[RANGE UNBOUNDED]`` item: one item with an
    aggregate, none of them COUNT/SUM/AVG(DISTINCT) → STATE; one item, no aggregate, ISTREAM/DSTREAM → NONE (the
    result only changes by the rows of new tuples); anything else → HISTORY
    (every visible tuple of the unbounded items is legacy).
    """
    kinds = [f.window.kind for f in cq.query.from_]
    if "unbounded" not in kinds:
        return LegacyMode.WINDOW
    if getattr(cq, "branches", ()) or getattr(cq, "subqueries", ()):
        return LegacyMode.HISTORY  # a compound or derived query: the visible history of its unbounded items
    if len(kinds) == 1:
        if cq.is_aggregate:
            if any(a.distinct for s in cq.query.select or () for a in A.aggregates_in(s.expr)) \
                    or any(a.distinct for a in A.aggregates_in(cq.query.having)):
                return LegacyMode.HISTORY  # a set of distinct values is no running state: the history travels
            return LegacyMode.STATE
        if cq.r2s in ("ISTREAM", "DSTREAM"):
            return LegacyMode.NONE
    return LegacyMode.HISTORY


def compile_query(text: str, config: Config, level: str) -> CompiledQuery:
    """Parse, analyze, authorize, rewrite and optimize ``text`` for a session at ``level``."""
    try:
        lvl = config.lattice.parse(level)
    except LevelError as e:
        raise AuthorizationError(f"query level: {e}") from None
    return analyze(parse(text), config, lvl, text=text)


def analyze(q: A.Query | A.Compound, config: Config, level: str, text: str | None = None) -> CompiledQuery:
    if isinstance(q, A.Compound):
        return _compound(q, config, level, text if text is not None else to_text(q))
    if any(f.subquery is not None for f in q.from_):
        return _derived(q, config, level, text if text is not None else to_text(q))
    return _Analyzer(config, level).run(q, text if text is not None else to_text(q))


def _with_r2s(cq: CompiledQuery, r2s: str) -> CompiledQuery:
    """``cq`` evaluated with stream operator ``r2s`` (its SELECTs too, for a compound query)."""
    return replace(cq, r2s=r2s, branches=tuple(_with_r2s(b, r2s) for b in cq.branches),
                   outer=None if cq.outer is None else _with_r2s(cq.outer, r2s))


def _derived(q: A.Query, config: Config, level: str, text: str) -> CompiledQuery:
    """``SELECT … FROM (subquery) x [, Stream [window] …] …``: each subquery is compiled on its own
    (authorized, rewritten, optimized; SEMANTICS §4 applies inside it) and is a relation: at each
    instant x holds its rows, each with ``ts`` = the instant and ``level`` = the row's level.  The
    outer query is compiled over each x as a stream of those rows read through ``[NOW]``, next to
    its stream items; its instants are those of all the streams below it.  x's columns are the
    subquery's, which need names the outer query can use."""
    streams = {n.lower() for n in config.streams}
    subs: list[CompiledQuery | None] = []
    pseudo: dict[str, StreamSchema] = {}
    from_ = []
    for f in q.from_:
        if f.subquery is None:
            subs.append(None)
            from_.append(f)
            continue
        if f.alias.lower() in streams or f.alias.lower() in {p.lower() for p in pseudo}:
            raise SemanticError(f"FROM: the subquery's name {f.alias!r} is already a stream's or another "
                                f"subquery's; choose another")
        inner = analyze(f.subquery, config, level, to_text(f.subquery))
        cols = []  # (the analyzer names output columns uniquely, never ts or level)
        for k, o in enumerate(inner.outputs):
            if not o.name.isidentifier():
                raise SemanticError(f"subquery {f.alias}: name its column {k + 1} ({o.name}) with AS; the outer "
                                    f"query reads it by name")
            cols.append((o.name, {"level": "string", "null": "string"}.get(o.type, o.type)))
        pseudo[f.alias] = StreamSchema(f.alias, tuple(cols))
        subs.append(_with_r2s(inner, "RSTREAM"))
        from_.append(A.FromItem(f.alias, A.Window("now"), None))
    rows_cfg = replace(config, streams={**config.streams, **pseudo})
    outer = _Analyzer(rows_cfg, level).run(replace(q, from_=tuple(from_)), text)
    chunk_from, items = [], []
    for f, it, sub in zip(outer.query.from_, outer.items, subs):
        chunk_from += [f] if sub is None else list(sub.query.from_)
        items += [it] if sub is None else list(sub.items)
    query = A.Query(None, tuple(chunk_from), r2s=q.r2s, wrapped=q.wrapped)
    notes = tuple(n for sub in subs if sub is not None for n in sub.notes) + outer.notes
    return CompiledQuery(text, level, query, tuple(items), outer.outputs, outer.r2s, outer.is_aggregate, notes,
                         subqueries=tuple(subs), outer=outer)


def _compound(q: A.Compound, config: Config, level: str, text: str) -> CompiledQuery:
    """``q1 UNION [ALL] q2 EXCEPT …`` (also INTERSECT, and parenthesized compounds as branches): every
    SELECT analyzed, authorized, rewritten and optimized on its own (SEMANTICS §4 per SELECT); the
    same number of columns in each, of types that combine
    (a long with a double is a double); the names are the first SELECT's.  The stream operator is
    the written one, else RSTREAM when a SELECT's list has an aggregate, else ISTREAM."""
    branches = [analyze(b, config, level, to_text(b)) for b in q.branches]  # a SELECT may read subqueries
    first = branches[0]
    types = [o.type for o in first.outputs]
    for op, b in zip(q.ops, branches[1:]):
        if len(b.outputs) != len(types):
            raise SemanticError(f"{op}: the SELECTs have {len(types)} and {len(b.outputs)} columns; "
                                f"they must have the same number")
        for k, o in enumerate(b.outputs):
            t = _combined_type(types[k], o.type)
            if t is None:
                raise SemanticError(f"{op}: column {k + 1} is {types[k]} in one SELECT and {o.type} in another")
            types[k] = t
    outputs = tuple(OutputColumn(o.name, t) for o, t in zip(first.outputs, types))
    agg = any(_aggregates_in_select(b) for b in branches)
    r2s = q.r2s or ("RSTREAM" if agg else "ISTREAM")
    branches = [_with_r2s(b, r2s) for b in branches]
    from_ = tuple(f for b in branches for f in b.query.from_)
    query = A.Query(None, from_, r2s=q.r2s, wrapped=q.wrapped)
    return CompiledQuery(text, level, query, tuple(it for b in branches for it in b.items), outputs, r2s,
                         any(b.is_aggregate for b in branches), tuple(n for b in branches for n in b.notes),
                         branches=tuple(branches), set_ops=tuple(q.ops))


def _aggregates_in_select(cq: CompiledQuery) -> bool:
    """Whether a select list of ``cq`` (any SELECT of a compound, the outer query over subqueries)
    has an aggregate: what decides a compound query's default stream operator."""
    if cq.branches:
        return any(_aggregates_in_select(b) for b in cq.branches)
    return any(A.aggregates_in(s.expr) for s in (cq.outer or cq).query.select or ())


def _combined_type(a: str, b: str) -> str | None:
    """The type of a column that is ``a`` in one SELECT and ``b`` in another, or None."""
    if a == b:
        return a
    if "null" in (a, b):
        return b if a == "null" else a
    if {a, b} <= {"long", "double", "timestamp"}:
        return "double" if "double" in (a, b) else "long"
    return None


# ---------------------------------------------------------------------------


class _Analyzer:
    def __init__(self, config: Config, level: str):
        self.config = config
        self.lat = config.lattice
        self.level = level
        self.dominated = self.lat.dominated(level)
        self.notes: list[str] = []

    # -- driver -----------------------------------------------------------------
    def run(self, q: A.Query, text: str) -> CompiledQuery:
        limits = self.config.limits
        check_query(q, limits.max_ts, self.config.instant_seconds)
        items = self._resolve_from(q.from_)
        self.items = items
        from_ = tuple(self._resolve_window(f, it) for f, it in zip(q.from_, items))

        where = self._expr_bool(q.where, "WHERE", allow_agg=False) if q.where is not None else None
        group_by = tuple(self._expr(g, "GROUP BY", allow_agg=False)[0] for g in q.group_by)
        having = self._expr_bool(q.having, "HAVING", allow_agg=True) if q.having is not None else None

        if q.select is None:
            select, outputs = self._star(items)
        else:
            select, outputs = self._select_list(q.select)

        is_agg = bool(group_by) or having is not None or any(A.aggregates_in(s.expr) for s in select)
        if q.distinct and not is_agg:
            # one row per distinct value tuple at the lub of its rows: exactly a grouping by the select list
            # (docs/semantics.md); printed back as SELECT DISTINCT
            group_by, is_agg = tuple(s.expr for s in select), True
        elif is_agg:
            # (with DISTINCT: the grouped rows, then one per distinct value tuple; A.Query.distinct_rows)
            if q.select is None:
                raise SemanticError("SELECT * cannot be combined with GROUP BY, HAVING or aggregates")
            for s in select:
                self._check_grouped(s.expr, group_by, "SELECT")
            if having is not None:
                self._check_grouped(having, group_by, "HAVING")

        has_agg_in_select = any(A.aggregates_in(s.expr) for s in select)
        r2s = q.r2s or ("RSTREAM" if has_agg_in_select else "ISTREAM")

        query = A.Query(select, from_, where, group_by, having, q.r2s, q.wrapped, q.distinct)
        authorize(query, self.lat, self.level)
        query = self._rewrite(query)
        rewritten = query
        query = self._optimize(query)
        shown = rewritten if any(f.window is not None and f.window.instants is not None for f in query.from_) else None
        return CompiledQuery(text, self.level, query, items, outputs, r2s, is_agg, tuple(self.notes), shown)

    # -- FROM ---------------------------------------------------------------------
    def _resolve_from(self, from_: tuple[A.FromItem, ...]) -> tuple[ItemInfo, ...]:
        out: list[ItemInfo] = []
        seen: dict[str, str] = {}
        for f in from_:
            schema = self.config.stream(f.stream)
            if schema is None:
                known = ", ".join(sorted(self.config.streams)) or "none declared"
                raise SemanticError(f"FROM: unknown stream {f.stream!r} (streams: {known})")
            name = f.alias or schema.name
            key = name.lower()
            if key in seen:
                raise SemanticError(
                    f"FROM: {name!r} is used twice; give each reference of a stream its own alias"
                )
            seen[key] = name
            out.append(ItemInfo(name, schema.name, schema))
        return tuple(out)

    def _resolve_window(self, f: A.FromItem, item: ItemInfo) -> A.FromItem:
        w = f.window
        if item.schema.relation:
            if w is not None and w.kind != "relation":
                raise SemanticError(f"{item.name} is a stored relation: it takes no window, only a level clause "
                                    f"({item.stream} [level in {{...}}]); its rows are those live at each instant")
            if w is None:
                w = A.Window("relation")
        elif w is not None and w.kind == "relation":
            raise SemanticError(f"{item.name} is a stream: its window needs ROWS, RANGE, NOW or PARTITION BY "
                                "before the level clause")
        if w is None:
            return A.FromItem(item.stream, None, f.alias)
        if w.kind == "partition":
            cols = []
            for c in w.partition_by:
                canon = _canon_column(item.schema, c)
                if canon is None:
                    raise SemanticError(f"window of {item.name}: PARTITION BY names unknown attribute {c!r}")
                if canon == "ts":
                    raise SemanticError(f"window of {item.name}: cannot partition by the timestamp ts")
                cols.append(canon)
            if len(set(cols)) != len(cols):
                raise SemanticError(f"window of {item.name}: PARTITION BY repeats an attribute")
            w = replace(w, partition_by=tuple(cols))
        if w.clause is not None:
            ctx = f"window clause of {item.name}"
            levels = tuple(self._level(x, ctx) for x in w.clause.levels)
            w = replace(w, clause=A.LevelClause(w.clause.form, levels))
        if w.filter is not None:
            w = replace(w, filter=self._window_filter(w.filter, item))
        return A.FromItem(item.stream, w, f.alias)

    def _window_filter(self, e: A.Expr, item: ItemInfo) -> A.Expr:
        """A window's condition on its own item's attributes (``[ROWS 10 WHERE bp > 100]``),
        analyzed against that item alone.  The master evaluates it (in Arrow) to cut the windows'
        legacy, so it takes what evaluates there exactly as Spark would: comparisons, AND/OR/NOT,
        IN, IS NULL, and arithmetic on doubles (``/`` of longs is a double); 64-bit ``+ - *`` and
        ``%`` belong in WHERE, whose overflow checks need the engine."""
        ctx = f"window condition of {item.name}"
        saved, self.items = self.items, (item,)
        try:
            out = self._expr_bool(e, ctx, allow_agg=False)
            for x in A.walk(out):
                if isinstance(x, A.Binary) and x.op in A.ARITHMETIC:
                    t = self._expr(x, ctx, allow_agg=False)[1]
                    if x.op == "%" or (x.op != "/" and t == "long"):
                        raise SemanticError(
                            f"{ctx}: {x.op} of {'integers' if t == 'long' else 'numbers'} is not supported in a "
                            f"window condition (comparisons, AND/OR/NOT, IN, IS NULL and arithmetic on doubles are)")
                if isinstance(x, A.Unary) and x.op == "-" and self._expr(x, ctx, allow_agg=False)[1] == "long":
                    raise SemanticError(f"{ctx}: unary minus of an integer is not supported in a window condition")
        finally:
            self.items = saved
        return out

    def _level(self, text: str, ctx: str) -> str:
        try:
            return self.lat.parse(text)
        except LevelError as e:
            raise SemanticError(f"{ctx}: {e}") from None

    # -- expressions --------------------------------------------------------------
    def _column(self, c: A.Column, ctx: str) -> tuple[A.Column, str]:
        if c.qualifier is not None:
            matches = [it for it in self.items if it.name.lower() == c.qualifier.lower()]
            if not matches:
                raise SemanticError(f"{ctx}: unknown stream or alias {c.qualifier!r} in {c.qualifier}.{c.name}")
            it = matches[0]
            canon = _canon_column(it.schema, c.name)
            if canon is None:
                raise SemanticError(f"{ctx}: {it.name} has no attribute {c.name!r}")
            return A.Column(it.name, canon), it.schema.type_of(canon)
        hits = [(it, _canon_column(it.schema, c.name)) for it in self.items]
        hits = [(it, canon) for it, canon in hits if canon is not None]
        if not hits:
            raise SemanticError(f"{ctx}: unknown attribute {c.name!r}")
        if len(hits) > 1:
            names = ", ".join(f"{it.name}.{canon}" for it, canon in hits)
            raise SemanticError(f"{ctx}: attribute {c.name!r} is ambiguous ({names}); qualify it")
        it, canon = hits[0]
        return A.Column(it.name, canon), it.schema.type_of(canon)

    def _as_level(self, e: A.Expr, ctx: str) -> A.LevelLiteral | None:
        """Interpret a comparison operand next to ``level`` as a level literal."""
        if isinstance(e, A.LevelLiteral):
            return A.LevelLiteral(self._level(e.text, ctx))
        if isinstance(e, A.Column) and e.qualifier is None and self.lat.contains(e.name):
            # next to `level` a level name wins: no attribute besides `level` has type level
            return A.LevelLiteral(self.lat.parse(e.name))
        if isinstance(e, A.Literal) and e.type == "string":
            return A.LevelLiteral(self._level(e.value, ctx))
        if isinstance(e, A.Literal) and e.type == "long" and self.lat.contains(str(e.value)):
            return A.LevelLiteral(self.lat.parse(str(e.value)))
        return None

    def _expr_bool(self, e: A.Expr, ctx: str, allow_agg: bool) -> A.Expr:
        out, t = self._expr(e, ctx, allow_agg)
        if t not in ("boolean", "null"):
            raise SemanticError(f"{ctx} must be a condition, got an expression of type {t}")
        return out

    def _expr(self, e: A.Expr, ctx: str, allow_agg: bool, in_agg: bool = False) -> tuple[A.Expr, str]:
        if isinstance(e, A.Literal):
            return e, e.type
        if isinstance(e, A.LevelLiteral):
            return A.LevelLiteral(self._level(e.text, ctx)), "level"
        if isinstance(e, A.Column):
            return self._column(e, ctx)
        if isinstance(e, A.Aggregate):
            if not allow_agg:
                raise SemanticError(f"{ctx}: aggregate {e.func} is not allowed here")
            if in_agg:
                raise SemanticError(f"{ctx}: aggregates cannot be nested ({expr_text(e)})")
            if e.arg is None:
                return e, "long"
            arg, t = self._expr(e.arg, ctx, allow_agg, in_agg=True)
            if t == "level":
                raise SemanticError(f"{ctx}: {e.func} cannot aggregate levels")
            if e.func in ("SUM", "AVG") and t not in NUMERIC:
                raise SemanticError(f"{ctx}: {e.func} needs a numeric argument, got {t}")
            if e.func in ("MIN", "MAX") and t == "boolean":
                raise SemanticError(f"{ctx}: {e.func} of a boolean is not supported")
            out_t = {"COUNT": "long", "AVG": "double"}.get(e.func, "long" if t == "timestamp" and e.func == "SUM" else t)
            # MIN/MAX(DISTINCT x) is MIN/MAX(x): the flag is dropped (and a running state stays possible)
            return A.Aggregate(e.func, arg, e.distinct and e.func in ("COUNT", "SUM", "AVG")), out_t
        if isinstance(e, A.Unary):
            x, t = self._expr(e.operand, ctx, allow_agg, in_agg)
            if e.op == "NOT":
                if t not in ("boolean", "null"):
                    raise SemanticError(f"{ctx}: NOT needs a condition, got {t}")
                return A.Unary("NOT", x), "boolean"
            if t not in NUMERIC and t != "null":
                raise SemanticError(f"{ctx}: unary minus needs a number, got {t}")
            return A.Unary("-", x), "long" if t == "timestamp" else t
        if isinstance(e, A.Binary):
            return self._binary(e, ctx, allow_agg, in_agg)
        if isinstance(e, A.InList):
            x, t = self._expr(e.operand, ctx, allow_agg, in_agg)
            items = []
            for it in e.items:
                if t == "level":
                    lv = self._as_level(it, ctx)
                    if lv is None:
                        raise SemanticError(f"{ctx}: {expr_text(it)} is not a level of the lattice")
                    items.append(lv)
                    continue
                y, ty = self._expr(it, ctx, allow_agg, in_agg)
                _comparable(t, ty, ctx, expr_text(e))
                items.append(y)
            return A.InList(x, tuple(items), e.negated, e.braces), "boolean"
        if isinstance(e, A.DominatedBy):
            x, t = self._expr(e.operand, ctx, allow_agg, in_agg)
            if t != "level":
                raise SemanticError(f"{ctx}: DOMINATED BY applies to level, not to {expr_text(e.operand)}")
            return A.DominatedBy(x, A.LevelLiteral(self._level(e.level.text, ctx))), "boolean"
        if isinstance(e, A.IsNull):
            x, _ = self._expr(e.operand, ctx, allow_agg, in_agg)
            return A.IsNull(x, e.negated), "boolean"
        raise SemanticError(f"{ctx}: unsupported expression {e!r}")

    def _binary(self, e: A.Binary, ctx: str, allow_agg: bool, in_agg: bool) -> tuple[A.Expr, str]:
        if e.op in ("AND", "OR"):
            l, tl = self._expr(e.left, ctx, allow_agg, in_agg)
            r, tr = self._expr(e.right, ctx, allow_agg, in_agg)
            for t, side in ((tl, e.left), (tr, e.right)):
                if t not in ("boolean", "null"):
                    raise SemanticError(f"{ctx}: {e.op} needs conditions, got {expr_text(side)} of type {t}")
            return A.Binary(e.op, l, r), "boolean"
        if e.op in A.COMPARISONS:
            # `level = U`: a bare name next to level is a level literal
            left, right = e.left, e.right
            l, tl = (None, None)
            if isinstance(left, A.Column) and left.name.lower() == "level":
                l, tl = self._expr(left, ctx, allow_agg, in_agg)
                lv = self._as_level(right, ctx) if tl == "level" else None
                if lv is not None:
                    return self._level_compare(e.op, l, lv, ctx)
            if isinstance(right, A.Column) and right.name.lower() == "level":
                r, tr = self._expr(right, ctx, allow_agg, in_agg)
                lv = self._as_level(left, ctx) if tr == "level" else None
                if lv is not None:
                    return self._level_compare(_flip(e.op), r, lv, ctx)
            if l is None:
                l, tl = self._expr(left, ctx, allow_agg, in_agg)
            r, tr = self._expr(right, ctx, allow_agg, in_agg)
            if "level" in (tl, tr) and e.op not in ("=", "!="):
                raise SemanticError(f"{ctx}: levels are compared with =, != or DOMINATED BY, not {e.op}")
            _comparable(tl, tr, ctx, expr_text(e))
            return A.Binary(e.op, l, r), "boolean"
        # arithmetic
        l, tl = self._expr(e.left, ctx, allow_agg, in_agg)
        r, tr = self._expr(e.right, ctx, allow_agg, in_agg)
        for t, side in ((tl, e.left), (tr, e.right)):
            if t not in NUMERIC and t != "null":
                raise SemanticError(f"{ctx}: {e.op} needs numbers, got {expr_text(side)} of type {t}")
        if e.op == "/" or "double" in (tl, tr):
            t = "double"
        else:
            t = "long"
        return A.Binary(e.op, l, r), t

    def _level_compare(self, op: str, col: A.Expr, lv: A.LevelLiteral, ctx: str) -> tuple[A.Expr, str]:
        if op not in ("=", "!="):
            raise SemanticError(f"{ctx}: levels are compared with =, != or DOMINATED BY, not {op}")
        return A.Binary(op, col, lv), "boolean"

    # -- select list ---------------------------------------------------------------
    def _star(self, items: tuple[ItemInfo, ...]):
        counts: dict[str, int] = {}
        for it in items:
            for c in it.schema.column_names:
                counts[c.lower()] = counts.get(c.lower(), 0) + 1
        select, outputs = [], []
        for it in items:
            for c, t in it.schema.columns:
                name = c if counts[c.lower()] == 1 else f"{it.name}_{c}"
                select.append(A.SelectItem(A.Column(it.name, c), name if name != c else None))
                outputs.append(OutputColumn(name, t))
        return tuple(select), tuple(outputs)

    def _select_list(self, sel: tuple[A.SelectItem, ...]):
        select, outputs, used = [], [], {"ts", "level"}
        explicit = {s.alias.lower() for s in sel if s.alias}
        for s in sel:
            e, t = self._expr(s.expr, "SELECT", allow_agg=True)
            if s.alias:
                name = s.alias
                if name.lower() in used:
                    raise SemanticError(f"SELECT: output column name {name!r} is used twice or is reserved (ts, level)")
            else:
                base = e.name if isinstance(e, A.Column) else expr_text(_strip_expr(e))
                name, k = base, 1
                while name.lower() in used or (name.lower() in explicit and name != base):
                    k += 1
                    name = f"{base}_{k}"
                if name.lower() in explicit:
                    k = 2
                    while f"{base}_{k}".lower() in used | explicit:
                        k += 1
                    name = f"{base}_{k}"
            used.add(name.lower())
            select.append(A.SelectItem(e, s.alias))
            outputs.append(OutputColumn(name, t))
        return tuple(select), tuple(outputs)

    def _check_grouped(self, e: A.Expr, group_by: tuple[A.Expr, ...], ctx: str) -> None:
        if e in group_by or isinstance(e, (A.Aggregate, A.Literal, A.LevelLiteral)):
            return
        if isinstance(e, A.Column):
            raise SemanticError(
                f"{ctx}: {e.name} must appear in GROUP BY or inside an aggregate"
            )
        for child in A.children(e):
            self._check_grouped(child, group_by, ctx)

    # -- rewriting (Alg. 3) --------------------------------------------------------
    def _rewrite(self, q: A.Query) -> A.Query:
        out = []
        for f in q.from_:
            w = f.window or A.Window("unbounded")
            if w.clause is None:
                levels = self.dominated
            elif w.clause.form == "dominated":
                levels = self.lat.dominated(w.clause.levels[0]) & self.dominated
            else:
                levels = frozenset(w.clause.levels) & self.dominated
            w = replace(w, clause=A.LevelClause("in", tuple(self.lat.sort(levels))))
            out.append(replace(f, window=w))
        return replace(q, from_=tuple(out))

    # -- optimization (Alg. 4 as corrected in SEMANTICS §4) --------------------------
    def _optimize(self, q: A.Query) -> A.Query:
        conjuncts = A.conjuncts(q.where)
        from_ = list(q.from_)
        drop: set[int] = set()
        for i, f in enumerate(from_):
            mine = [(k, c) for k, c in enumerate(conjuncts) if self._level_set_of(c, f.name) is not None]
            if not mine:
                continue
            sigma = self.dominated
            for _, c in mine:
                sigma = sigma & self._level_set_of(c, f.name)
            w = f.window
            wset = frozenset(w.clause.levels)
            if not (wset & sigma):
                raise OptimizationError(
                    f"the WHERE level condition on {f.name} excludes every level its window admits; "
                    "the query can never output"
                )
            movable = w.kind in ("range", "unbounded", "now", "relation") or (
                w.kind == "partition" and "level" in w.partition_by
            )
            if movable:
                new = frozenset(wset & sigma)
                # the instants stay those of the rewritten set (SEMANTICS §5): kept beside the clause
                keep = None if new == wset else tuple(self.lat.sort(wset))
                from_[i] = replace(f, window=replace(w, clause=A.LevelClause("in", tuple(self.lat.sort(new))),
                                                     instants=keep))
                drop.update(k for k, _ in mine)
                self.notes.append(f"moved the WHERE level condition on {f.name} into its window" + (
                    f" (its instants stay the arrivals of {{{', '.join(keep)}}})" if keep is not None else ""))
            elif w.kind in ("rows", "partition") and wset <= sigma:
                drop.update(k for k, _ in mine)
                self.notes.append(f"dropped the WHERE level condition on {f.name}: its window admits only those levels")
        kept = [c for k, c in enumerate(conjuncts) if k not in drop]
        where = _and_all(kept)
        return replace(q, from_=tuple(from_), where=where)

    def _level_set_of(self, c: A.Expr, item: str) -> frozenset[str] | None:
        """Level set σ if ``c`` is a pure level condition on FROM item ``item``."""
        def is_mine(x):
            return isinstance(x, A.Column) and x.qualifier == item and x.name == "level"

        if isinstance(c, A.Binary) and c.op in ("=", "!=") and is_mine(c.left) and isinstance(c.right, A.LevelLiteral):
            s = frozenset({c.right.text})
            return s if c.op == "=" else self.dominated - s
        if isinstance(c, A.InList) and is_mine(c.operand) and all(isinstance(i, A.LevelLiteral) for i in c.items):
            s = frozenset(i.text for i in c.items)
            return self.dominated - s if c.negated else s
        if isinstance(c, A.DominatedBy) and is_mine(c.operand):
            return self.lat.dominated(c.level.text)
        return None


# ---------------------------------------------------------------------------


def _canon_column(schema: StreamSchema, name: str) -> str | None:
    low = name.lower()
    if low in ("ts", "level"):
        return low
    for c in schema.column_names:
        if c.lower() == low:
            return c
    return None


def _comparable(a: str, b: str, ctx: str, what: str) -> None:
    if "null" in (a, b) or a == b:
        return
    if a in NUMERIC and b in NUMERIC:
        return
    raise SemanticError(f"{ctx}: cannot compare {a} with {b} in {what}")


def _flip(op: str) -> str:
    return {"<": ">", ">": "<", "<=": ">=", ">=": "<="}.get(op, op)


def _and_all(es: list[A.Expr]) -> A.Expr | None:
    if not es:
        return None
    out = es[0]
    for e in es[1:]:
        out = A.Binary("AND", out, e)
    return out


def _strip_expr(e):
    """Drop column qualifiers (for display with a single FROM item)."""
    if isinstance(e, A.Column):
        return A.Column(None, e.name)
    return A.map_children(e, _strip_expr)


def _strip_qualifiers(q: A.Query) -> A.Query:
    s = None if q.select is None else tuple(A.SelectItem(_strip_expr(i.expr), i.alias) for i in q.select)
    return replace(
        q,
        select=s,
        where=None if q.where is None else _strip_expr(q.where),
        group_by=tuple(_strip_expr(g) for g in q.group_by),
        having=None if q.having is None else _strip_expr(q.having),
        from_=tuple(f if f.window is None or f.window.filter is None
                    else replace(f, window=replace(f.window, filter=_strip_expr(f.window.filter))) for f in q.from_),
    )
