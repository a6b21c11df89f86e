"""Hypothesis strategies: random multilevel streams and random MLS-CQL queries.

* :func:`stream_rows` — one stream's tuples in arrival order (non-decreasing
  ``ts`` with gaps, crowded instants, levels from the whole lattice, small
  value domains so joins and groups collide, occasional NULLs);
* :func:`multistream` — ``{stream: rows}`` for every stream of a config;
* :func:`queries` — query *text* accepted by ``compile_query`` at a level,
  built by construction to be valid (window and WHERE levels dominated by the
  query level, top-level WHERE level conjuncts meeting the window's set), and
  covering every window kind, window level clauses, level and value
  conditions, arithmetic, joins, grouping, aggregates and R2S operators.

``extremes`` (opt-in, for the overflow rules of SEMANTICS §8): streams draw their
64-bit integers near ±2**62 and ±2**63 in that fraction of examples (mixed with
small ones, so sums overflow and come back into range), and queries add
overflow-prone arithmetic and literals near the limits.

Works for any config; tuned for ``battlefield`` and ``chinese_wall``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from hypothesis import HealthCheck, assume, settings
from hypothesis import strategies as st

from strata.config import Config, StreamSchema
from strata.lattice import ChineseWall, Lattice
from strata.mlscql import QueryError, compile_query


def example_settings(env_var: str, default: int):
    """Hypothesis settings of the Spark-backed property tests: ``env_var`` examples (default
    ``default``), no deadline, derandomized on CI; returns (examples, settings)."""
    examples = int(os.environ.get(env_var, str(default)))
    return examples, settings(
        max_examples=examples, deadline=None, derandomize=bool(os.environ.get("CI")),
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    )

__all__ = ["stream_rows", "multistream", "queries", "query_levels", "STRINGS", "DOUBLES", "LONGS", "BIG_LONGS"]

#: small value domains: joins and groups collide often
STRINGS = ("a", "b", "c")
DOUBLES = (100.0, 100.0, 110.5, 120.0, 125.25, 80.0, 0.0, -2.5)
LONGS = (0, 1, 2, 3, 5, 7, -1, -4)
#: 64-bit integers near the limits: x * 2 overflows from ±2**62, x + 1 at 2**63 - 1, -x at -2**63,
#: and a few of them overflow a SUM
BIG_LONGS = (2**62, 2**62 + 1, -(2**62), 3 * 2**61, -3 * 2**61, 2**63 - 1, 2**63 - 2, -(2**63), -(2**63) + 1,
             4 * 10**18, -4 * 10**18, 4 * 10**18)
#: literals near the limits (with ``extremes``)
BIG_LITERALS = ("4611686018427387904", "9223372036854775807", "-9223372036854775808", "3000000000000000000",
                "-4611686018427387905")
NUMERIC = ("double", "long", "timestamp")


# ---------------------------------------------------------------------------
# streams


def query_levels(config: Config) -> st.SearchStrategy[str]:
    """A query level, biased toward high levels (they see more of the data)."""
    levels = list(config.lattice.levels)
    high = levels[len(levels) // 2:]
    return st.one_of(st.sampled_from(levels), st.sampled_from(high), st.just(config.lattice.top))


def _level_strategy(lat: Lattice, levels) -> st.SearchStrategy[str]:
    if levels is not None:
        return st.sampled_from(sorted({lat.parse(x) for x in levels}, key=lat.levels.index))
    all_levels = list(lat.levels)
    # low levels are dominated by more query levels, so bias toward them
    low = all_levels[: max(1, (len(all_levels) + 1) // 2)]
    lowest = all_levels[:3]
    return st.one_of(st.sampled_from(all_levels), st.sampled_from(low), st.sampled_from(lowest))


def _value_strategy(typ: str, extremes: bool = False) -> st.SearchStrategy:
    if typ == "double":
        return st.sampled_from(DOUBLES + (None,))
    if typ == "long":
        return st.sampled_from(LONGS + LONGS + (None,) + (BIG_LONGS + BIG_LONGS if extremes else ()))
    if typ == "timestamp":
        return st.sampled_from((1, 2, 3, 4, 5, 1, 2, 3, 4, 5, None) + (BIG_LONGS if extremes else ()))
    if typ == "boolean":
        return st.sampled_from((True, False, True, False, None))
    return st.sampled_from(STRINGS + STRINGS + STRINGS + (None,))


@st.composite
def stream_rows(
    draw,
    config: Config,
    stream: str,
    levels=None,
    max_instants: int = 6,
    max_per_instant: int = 8,
    start: int = 0,
    extremes: bool = False,
) -> list[dict]:
    """Tuples of ``stream`` in arrival order: ``{"ts", "level", attrs...}`` (``extremes``: 64-bit
    attributes also take values near the limits)."""
    schema = config.stream(stream)
    if schema is None:
        raise ValueError(f"unknown stream {stream!r}")
    lat = config.lattice
    level_st = _level_strategy(lat, levels)
    values = {c: _value_strategy(t, extremes) for c, t in schema.columns}
    n = draw(st.integers(1, max_instants)) if max_instants > 0 else 0
    ts = start
    rows: list[dict] = []
    for _ in range(n):
        ts += draw(st.sampled_from((1, 1, 1, 2, 3, 5)))
        k = draw(st.one_of(st.integers(1, 3), st.integers(0, max_per_instant)))
        for _ in range(k):
            row = {"ts": ts, "level": draw(level_st)}
            for c, _t in schema.columns:
                row[c] = draw(values[c])
            rows.append(row)
    return rows


@st.composite
def multistream(draw, config: Config, levels=None, max_instants: int = 6, max_per_instant: int = 8,
                extremes: float = 0.0):
    """``{stream name: rows}`` for every stream of ``config``; in a fraction ``extremes`` of the
    examples the 64-bit attributes take values near the limits."""
    big = extremes > 0 and draw(st.integers(0, 999), label="extreme values") < int(extremes * 1000)
    return {
        name: draw((relation_rows if config.streams[name].relation else stream_rows)(
            config, name, levels=levels, max_instants=max_instants, max_per_instant=max_per_instant,
            extremes=big), label=name)
        for name in config.streams
    }


@st.composite
def relation_rows(draw, config: Config, name: str, levels=None, max_instants: int = 6, max_per_instant: int = 8,
                  extremes: bool = False) -> list[dict]:
    """Updates of stored relation ``name`` in arrival order: ``{"ts", "level", attrs..., "op"}``, every
    delete of a row live at that point (an equal row of the same level: also one of several equal
    ones, and one inserted in the same instant); attribute values from a few, so that rows repeat."""
    schema = config.stream(name)
    level_st = _level_strategy(config.lattice, levels)
    pools = {c: draw(st.lists(_value_strategy(t, extremes), min_size=1, max_size=3), label=f"{name}.{c} values")
             for c, t in schema.columns}
    ts, rows, live = 0, [], []
    for _ in range(draw(st.integers(1, max_instants))):
        ts += draw(st.sampled_from((0, 1, 1, 2, 3)))
        for _ in range(draw(st.integers(1, max(1, max_per_instant // 2)))):
            if live and draw(st.integers(0, 2)) == 0:
                row = dict(live.pop(draw(st.integers(0, len(live) - 1))), ts=ts, op="delete")
            else:
                row = {"ts": ts, "level": draw(level_st), **{c: draw(st.sampled_from(pools[c])) for c, _ in schema.columns},
                       "op": "insert"}
                live.append({k: v for k, v in row.items() if k not in ("ts", "op")})
            rows.append(row)
    return rows


# ---------------------------------------------------------------------------
# queries


@dataclass
class _Ref:
    """One FROM item being generated."""

    stream: str
    schema: StreamSchema
    qual: str | None  # prefix for its columns (alias or stream name); None = unqualified
    alias: str | None
    wset: frozenset[str] = field(default_factory=frozenset)  # rewritten window level set

    def col(self, name: str) -> str:
        return f"{self.qual}.{name}" if self.qual else name

    def cols(self, *types: str) -> list[str]:
        return [c for c, t in self.schema.columns if not types or t in types]


_ALIASES = (("x", "y"), ("v", "w"), ("s1", "s2"), ("left_", "right_"))


class _Gen:
    def __init__(self, draw, config: Config, level: str, extremes: bool = False):
        self.draw = draw
        self.config = config
        self.lat = config.lattice
        self.L = level
        self.dom = self.lat.sort(self.lat.dominated(level))
        self.upper = draw(st.booleans())  # keyword spelling
        self.extremes = extremes

    # -- small helpers -----------------------------------------------------------
    def d(self, strategy):
        return self.draw(strategy)

    def kw(self, word: str) -> str:
        return word.upper() if self.upper else word.lower()

    def pick(self, seq):
        return self.d(st.sampled_from(list(seq)))

    def chance(self, p: float) -> bool:
        return self.d(st.integers(0, 999)) < int(p * 1000)

    def low(self, levels) -> str:
        """A level from ``levels``, biased toward the lowest (streams are biased the same way)."""
        ordered = sorted(levels, key=self.lat.levels.index)
        return self.d(st.one_of(st.sampled_from(ordered), st.sampled_from(ordered[:3])))

    def subset(self, seq, min_size=1) -> list:
        seq = list(seq)
        return self.d(st.lists(st.sampled_from(seq), min_size=min_size, max_size=max(min_size, len(seq)), unique=True))

    def lvl(self, level: str, quoted_ok: bool = True) -> str:
        """Text for a level literal: U, "S", [1,B], [0,A], '[1,B]'."""
        if isinstance(self.lat, ChineseWall):
            parts = list(self.lat.components(level))
            # the grammar also lists `_|_`, but the lexer rejects it (reported); not in SEMANTICS
            bottom = self.pick(("⊥", "⊥", "0"))
            text = "[" + ",".join(bottom if p == "⊥" else p for p in parts) + "]"
        else:
            text = level
        if quoted_ok and self.chance(0.12):
            q = self.pick(('"', "'"))
            return f"{q}{text}{q}"
        return text

    def lvl_set(self, levels, braces=True) -> str:
        inner = ", ".join(self.lvl(x) for x in levels)
        return "{" + inner + "}" if braces else "(" + inner + ")"

    # -- FROM ------------------------------------------------------------------------
    def refs(self, n: int) -> list[_Ref]:
        names = list(self.config.streams)
        if n == 1:
            name = self.pick(names)
            schema = self.config.streams[name]
            alias = self.pick((None, None, None, "t", "src"))
            qual = None
            if self.chance(0.2):
                qual = alias or name
            return [_Ref(name, schema, qual, alias)]
        self_join = len(names) == 1 or self.chance(0.4)
        if self_join:
            name = self.pick(names)
            pair = [name, name]
        else:
            pair = self.d(st.lists(st.sampled_from(names), min_size=2, max_size=2, unique=True))
        aliases = self.pick(_ALIASES)
        out = []
        for k, name in enumerate(pair):
            alias = aliases[k] if self_join or self.chance(0.6) else None
            out.append(_Ref(name, self.config.streams[name], alias or name, alias))
        return out

    def window_clause(self, ref: _Ref, where: bool = True) -> str:
        """Level clause text (or "") and set ``ref.wset`` to the rewritten window set."""
        r = self.d(st.integers(0, 9))
        where = self.kw("where") + " " if where and self.chance(0.1) else ""
        if r <= 4:
            ref.wset = frozenset(self.dom)
            return ""
        if r <= 6:
            s = self.subset(self.dom)
            ref.wset = frozenset(s)
            return f" {where}level {self.kw('in')} {self.lvl_set(s)}"
        if r <= 7:
            x = self.low(self.dom)
            ref.wset = frozenset({x})
            return f" {where}level = {self.lvl(x)}"
        x = self.pick(self.dom)
        ref.wset = self.lat.dominated(x)
        return f" {where}level {self.kw('dominated by')} {self.lvl(x)}"

    def window(self, ref: _Ref, join: bool) -> str:
        if ref.schema.relation:  # a stored relation: no window, at most a level clause
            clause = self.window_clause(ref, where=False)
            return f"[{clause.strip()}]" if clause else ""
        if join:
            kinds = ("rows", "rows", "now", "now", "partition", "partition_level", "range_small")
        else:
            kinds = ("rows", "range", "unbounded", "none", "now", "partition", "partition_level", "range_units",
                     "range_slide")
        kind = self.pick(kinds)
        if kind == "none":
            ref.wset = frozenset(self.dom)
            return ""
        clause = self.window_clause(ref)
        maxrows = 4 if join else 5
        if kind == "rows":
            spec = f"{self.kw('rows')} {self.d(st.integers(1, maxrows))}"
        elif kind == "range":
            unit = self.pick(("", " " + self.kw("seconds"), " " + self.kw("second"), " " + self.kw("secs")))
            spec = f"{self.kw('range')} {self.d(st.integers(1, 4))}{unit}"
        elif kind == "range_slide":  # RANGE T SLIDE S: T and S of 1-5 instants (S < T, = T or > T)
            unit = self.pick(("", " " + self.kw("seconds")))
            slide = self.pick((f"{self.d(st.integers(1, 3))}{unit}", "2000 ms", "1500 MILLISECONDS"))
            spec = f"{self.kw('range')} {self.d(st.integers(1, 5))}{unit} {self.kw('slide')} {slide}"
        elif kind == "range_small":
            spec = f"{self.kw('range')} 1"
        elif kind == "range_units":
            spec = self.kw("range") + " " + self.pick(
                ("1500 MILLISECONDS", "500 ms", "0.5 seconds", "2.5 SECONDS", "1 MINUTE", "2000 milliseconds")
            )
        elif kind == "unbounded":
            spec = self.kw("range unbounded")
        elif kind == "now":
            spec = self.kw("now")
        elif kind == "partition":
            attrs = self.subset(ref.cols("string", "long", "boolean", "timestamp") + ["level"], min_size=1)[:2]
            n = self.d(st.integers(1, 2 if join else 3))
            spec = f"{self.kw('partition by')} {', '.join(attrs)} {self.kw('rows')} {n}"
        else:  # partition_level: PARTITION BY [attr,] level ROWS n (level clause inline or at the end)
            attrs = ["level"]
            if self.chance(0.3) and ref.cols("string"):
                attrs = [self.pick(ref.cols("string")), "level"]
            n = self.d(st.integers(1, 2 if join else 3))
            if clause and self.chance(0.5) and not clause.lstrip().lower().startswith("where"):
                # `[PARTITION BY level in {C} ROWS 2]`: the condition follows `level`
                cond = clause.strip()[len("level"):]
                return f"[{self.kw('partition by')} {', '.join(attrs)}{cond} {self.kw('rows')} {n}]"
            spec = f"{self.kw('partition by')} {', '.join(attrs)} {self.kw('rows')} {n}"
        if self.chance(0.2):  # a window condition: `[ROWS 3 WHERE bp > 100]`, with the level clause as a conjunct
            conds = [self.window_filter(ref)]
            if clause:
                c = clause.strip()
                conds.insert(self.d(st.integers(0, 1)), c[len("where"):].strip() if c.lower().startswith("where") else c)
            return f"[{spec} {self.kw('where')} {' AND '.join(conds)}]"
        return f"[{spec}{clause}]"

    def window_filter(self, ref: _Ref, depth: int = 0) -> str:
        """A window condition on ``ref``'s attributes, in the forms a window takes (no 64-bit
        arithmetic, no %); its columns qualified or not."""
        r = self.d(st.integers(0, 7))
        if depth == 0 and r == 0:
            return f"({self.window_filter(ref, 1)} {self.kw('or')} {self.window_filter(ref, 1)})"
        if depth == 0 and r == 1:
            return f"{self.kw('not')} ({self.window_filter(ref, 1)})"
        if depth == 0 and r == 2:
            return f"{self.window_filter(ref, 1)} {self.kw('and')} {self.window_filter(ref, 1)}"
        col = ref.col if self.chance(0.5) else (lambda n: n)
        numeric = ref.cols(*NUMERIC) + ["ts"]
        strings = ref.cols("string")
        kind = self.pick(("num", "num", "arith", "str", "null", "in") if strings else ("num", "arith", "null", "in"))
        if kind in ("num", "arith"):
            c = self.pick(numeric)
            typ = ref.schema.type_of(c) if c != "ts" else "long"
            op = self.pick(("<=", ">=", "!=", "<", ">", "="))
            if kind == "arith":
                doubles = ref.cols("double")
                if doubles and self.chance(0.6):
                    d = self.pick(doubles)
                    return f"{col(d)} {self.pick(('*', '+', '-'))} 2.0 {op} {self.num_lit('double')}"
                return f"{col(c)} / 2 {op} {self.num_lit(typ)}"
            return f"{col(c)} {op} {self.num_lit(typ)}"
        if kind == "str":
            return f"{col(self.pick(strings))} {self.pick(('=', '!=', '<', '>='))} '{self.pick(STRINGS)}'"
        if kind == "null":
            c = self.pick(numeric + strings)
            return f"{col(c)} {self.kw('is null') if self.chance(0.3) else self.kw('is not null')}"
        if strings and self.chance(0.5):
            c, items = self.pick(strings), ", ".join(f"'{x}'" for x in self.subset(STRINGS))
        else:
            c = self.pick(numeric)
            typ = ref.schema.type_of(c) if c != "ts" else "long"
            items = ", ".join(self.num_lit(typ) for _ in range(self.d(st.integers(1, 3))))
        return f"{col(c)} {self.kw('not in') if self.chance(0.3) else self.kw('in')} ({items})"

    def from_text(self, ref: _Ref, join: bool) -> str:
        win = self.window(ref, join)
        name = ref.stream if self.chance(0.85) else ref.stream.lower()
        if ref.alias is None:
            return f"{name}{win}"
        form = self.d(st.integers(0, 3))
        if not win:
            return f"{name} {ref.alias}" if form < 2 else f"{name} {self.kw('as')} {ref.alias}"
        if form == 0:
            return f"{name}{win} {ref.alias}"
        if form == 1:
            return f"{name} {win} {self.kw('as')} {ref.alias}"
        if form == 2:
            return f"{name} {self.kw('as')} {ref.alias} {win}"
        return f"{name} {ref.alias} {win}"

    # -- conditions -------------------------------------------------------------------
    def level_cond(self, ref: _Ref, constrained: bool) -> str:
        """A level condition on ``ref``; if constrained its level set meets ref.wset."""
        col = ref.col("level")
        w = sorted(ref.wset, key=self.lat.levels.index) if constrained else list(self.dom)
        form = self.pick(("=", "=", "!=", "in", "in_paren", "not in", "dominated", "flipped"))
        anchor = self.low(w)
        if form in ("=", "flipped"):
            x = anchor
            return f"{col} = {self.lvl(x)}" if form == "=" else f"{self.lvl(x, quoted_ok=False)} = {col}"
        if form == "!=":
            others = [x for x in self.dom if not (constrained and set(w) <= {x})]
            x = self.pick(others) if others else anchor
            if constrained and set(w) <= {x}:
                return f"{col} = {self.lvl(anchor)}"
            return f"{col} {self.pick(('!=', '<>'))} {self.lvl(x)}"
        if form in ("in", "in_paren"):
            s = set(self.subset(self.dom)) | {anchor}
            s = self.lat.sort(s)
            return f"{col} {self.kw('in')} {self.lvl_set(s, braces=form == 'in')}"
        if form == "not in":
            cands = [x for x in self.dom if x != anchor]
            if not cands:
                return f"{col} = {self.lvl(anchor)}"
            s = self.lat.sort(self.subset(cands))
            return f"{col} {self.kw('not in')} {self.lvl_set(s)}"
        # dominated: X ≥ anchor
        ups = [x for x in self.dom if self.lat.leq(anchor, x)]
        return f"{col} {self.kw('dominated by')} {self.lvl(self.pick(ups))}"

    def num_lit(self, typ: str) -> str:
        if typ == "double":
            return self.pick(("100", "100.0", "110.5", "120", "0", "-2.5", "115.0", "90"))
        if self.extremes and self.chance(0.2):
            return self.pick(BIG_LITERALS)
        return self.pick(("0", "1", "2", "3", "4", "-1", "5"))

    def big_arith(self, ref: _Ref) -> str | None:
        """An overflow-prone 64-bit expression over ``ref`` (with ``extremes``), or None."""
        longs = ref.cols("long", "timestamp")
        if not self.extremes or not longs:
            return None
        c, d = ref.col(self.pick(longs)), ref.col(self.pick(longs))
        return self.pick((f"{c} + {d}", f"{c} * 3", f"{c} - {d}", f"-{c} - 1", f"{c} * {d}", f"{c} + 1",
                          f"{c} - {self.pick(BIG_LITERALS)}", f"({c} + {d}) - {c}", f"{c} % 7 * 2"))

    def value_pred(self, refs: list[_Ref]) -> str:
        ref = self.pick(refs)
        numeric = ref.cols(*NUMERIC) + ["ts"]
        strings = ref.cols("string")
        kind = self.pick(("num", "num", "str", "null", "in") if strings else ("num", "num", "null", "in"))
        if kind == "num":
            c = self.pick(numeric)
            typ = ref.schema.type_of(c)
            op = self.pick(("<=", ">=", "!=", "<", ">", "=", ">=", "<="))
            big = self.big_arith(ref)
            if big is not None and self.chance(0.4):
                return f"{big} {op} {self.num_lit('long')}"
            shape = self.d(st.integers(0, 6))
            col = ref.col(c)
            if shape == 0:
                return f"{col} + 1 {op} {self.num_lit(typ)}"
            if shape == 1:
                return f"{col} * 2 {op} {self.num_lit(typ)}"
            if shape == 2:
                return f"{col} / 2 {op} {self.num_lit(typ)}"
            if shape == 3:
                others = [x for x in numeric if x != c]
                if others:
                    return f"{col} {op} {ref.col(self.pick(others))}"
            if shape == 4:
                k = self.pick(("2", "3"))
                r = self.pick(("0", "1", "-1"))
                return f"({col} - 4) % {k} = {r}"
            return f"{col} {op} {self.num_lit(typ)}"
        if kind == "str":
            c = ref.col(self.pick(strings))
            op = self.pick(("=", "!=", "<", ">=", "="))
            q = self.pick(("'", '"'))
            return f"{c} {op} {q}{self.pick(STRINGS)}{q}"
        if kind == "null":
            c = ref.col(self.pick(numeric + strings))
            return f"{c} {self.kw('is null') if self.chance(0.25) else self.kw('is not null')}"
        # IN list
        if strings and self.chance(0.5):
            c = ref.col(self.pick(strings))
            items = ", ".join(f"'{x}'" for x in self.subset(STRINGS))
        else:
            c0 = self.pick(numeric)
            c = ref.col(c0)
            items = ", ".join(self.num_lit(ref.schema.type_of(c0)) for _ in range(self.d(st.integers(1, 3))))
        neg = self.kw("not in") if self.chance(0.3) else self.kw("in")
        return f"{c} {neg} ({items})"

    def free_pred(self, refs: list[_Ref], depth: int = 0) -> str:
        """Any boolean combination; level conditions here are unconstrained.

        At depth 0 (a top-level conjunct of WHERE) only OR / NOT forms: the
        optimizer treats nested ANDs and bare level conditions as conjuncts,
        which could make the query never-output (rejected).
        """
        r = self.d(st.integers(0, 2)) if depth == 0 else self.d(st.integers(0, 9))
        if depth < 2 and r <= 1:
            return f"({self.free_pred(refs, depth + 1)} {self.kw('or')} {self.free_pred(refs, depth + 1)})"
        if depth < 2 and r == 2:
            return f"{self.kw('not')} ({self.free_pred(refs, depth + 1)})"
        if depth < 2 and r == 3:
            return f"({self.free_pred(refs, depth + 1)} {self.kw('and')} {self.free_pred(refs, depth + 1)})"
        if r <= 5:
            return self.level_cond(self.pick(refs), constrained=False)
        return self.value_pred(refs)

    def join_cond(self, a: _Ref, b: _Ref) -> str:
        pairs = []
        for ca, ta in a.schema.columns:
            for cb, tb in b.schema.columns:
                if ta == tb == "string":
                    pairs.append((ca, cb))
        same = [(x, y) for x, y in pairs if x == y]
        if same and self.chance(0.6):
            ca, cb = self.pick(same)
        elif pairs and self.chance(0.9):
            ca, cb = self.pick(pairs)
        else:
            ca, cb = "ts", "ts"
        op = "=" if self.chance(0.9) else self.pick(("<=", "!="))
        return f"{a.col(ca)} {op} {b.col(cb)}"

    def where(self, refs: list[_Ref], join: bool) -> str:
        conj = []
        if join and self.chance(0.8):
            conj.append(self.join_cond(*refs))
        for ref in refs:
            if self.chance(0.35):
                conj.append(self.level_cond(ref, constrained=True))
        for _ in range(self.pick((0, 0, 1, 1, 2))):
            conj.append(self.free_pred(refs) if self.chance(0.4) else self.value_pred(refs))
        if not conj:
            return ""
        conj = self.d(st.permutations(conj))
        return f" {self.kw('where')} " + f" {self.kw('and')} ".join(conj)

    # -- select list -----------------------------------------------------------------------
    def scalar_item(self, refs: list[_Ref], k: int) -> str:
        ref = self.pick(refs)
        numeric = ref.cols(*NUMERIC)
        r = self.d(st.integers(0, 7))
        if r <= 2 or not numeric:
            return ref.col(self.pick(ref.cols() + ["level", "ts"]))
        c = ref.col(self.pick(numeric))
        expr = self.pick((
            f"{c} * 2", f"{c} + 1", f"-{c}", f"{c} / 4", f"{c} % 3", f"({c} - 100) / 3",
            f"{c} / {ref.col(self.pick(numeric))}", f"{ref.col('ts')} % 2",
        ))
        big = self.big_arith(ref)
        if big is not None and self.chance(0.5):
            expr = big
        return f"{expr} {self.kw('as')} e{k}" if self.chance(0.7) else expr

    def agg_item(self, refs: list[_Ref], k: int) -> str:
        ref = self.pick(refs)
        numeric = ref.cols(*NUMERIC)
        anyc = ref.cols("string", *NUMERIC)
        choices = ["COUNT(*)", f"COUNT({ref.col(self.pick(anyc))})",
                   f"MIN({ref.col(self.pick(anyc))})", f"MAX({ref.col(self.pick(anyc))})",
                   f"SUM({ref.col('ts')})", f"COUNT(DISTINCT {ref.col(self.pick(anyc))})"]
        if numeric:
            n1, n2 = ref.col(self.pick(numeric)), ref.col(self.pick(numeric))
            choices += [f"SUM({n1})", f"AVG({n1})", f"AVG({n1} * 2)", f"MAX({n1}) - MIN({n1})",
                        f"SUM({n1}) / COUNT(*)", f"MIN({n2})", f"MAX({n2})", f"AVG({n2})",
                        f"COUNT(DISTINCT {n1} * 2)"]
        big = self.big_arith(ref)
        if big is not None:
            n1 = ref.col(self.pick(ref.cols("long", "timestamp")))
            choices += [f"SUM({n1})", f"SUM({n1})", f"SUM({big})", f"AVG({big})", f"SUM({n1}) + SUM({n1})",
                        f"MAX({n1}) - MIN({n1})", f"SUM({n1}) - MIN({n1})", f"COUNT({big})", f"MAX({big})"]
        e = self.pick(choices)
        if self.chance(0.25):
            e = e.replace("COUNT", "count").replace("AVG", "avg").replace("SUM", "Sum")
        return f"{e} {self.kw('as')} a{k}" if self.chance(0.5) else e

    def having(self, refs: list[_Ref], keys: list[tuple[_Ref, str]]) -> str:
        ref = self.pick(refs)
        numeric = ref.cols(*NUMERIC)
        opts = ["COUNT(*) > 1", "COUNT(*) >= 2", "COUNT(*) < 3", f"MAX({ref.col('ts')}) > 2"]
        if numeric:
            c = self.pick(numeric)
            n = ref.col(c)
            dbl = ref.schema.type_of(c) == "double"
            opts += [f"AVG({n}) >= {'100' if dbl else '2'}", f"SUM({n}) IS NOT NULL",
                     f"MIN({n}) < {'110.5' if dbl else '4'}", f"COUNT({n}) > 0"]
            if self.extremes and not dbl:
                opts += [f"MAX({n}) - MIN({n}) > 0", f"SUM({n}) + 1 > 0", f"MIN({n}) * 2 < 0"]
        if ref.cols("string"):
            opts.append(f"MAX({ref.col(self.pick(ref.cols('string')))}) != 'a'")
        for kref, kc in keys:
            if kc == "level":
                opts.append(self.level_cond(kref, constrained=False))
            elif kref.schema.type_of(kc) == "string":
                opts.append(f"{kref.col(kc)} != 'b'")
        h = self.pick(opts)
        if self.chance(0.3):
            h = f"({h} {self.kw(self.pick(('or', 'and')))} {self.pick(opts)})"
        return f" {self.kw('having')} {h}"

    # -- whole query --------------------------------------------------------------------------
    def query(self) -> str:
        shape = self.pick(("single", "single", "single_agg", "single_agg", "join", "join_agg"))
        join = shape.startswith("join")
        refs = self.refs(2 if join else 1)
        from_ = ", ".join(self.from_text(r, join) for r in refs)
        where = self.where(refs, join)
        group = having = ""
        if shape.endswith("agg"):
            keys: list[tuple[_Ref, str]] = []
            if self.chance(0.6):
                for _ in range(self.d(st.integers(1, 2))):
                    ref = self.pick(refs)
                    c = self.pick(ref.cols("string", "long", "timestamp") + ["level", "level"])
                    if (ref, c) not in keys:
                        keys.append((ref, c))
            items = [ref.col(c) for ref, c in keys if self.chance(0.8)]
            n_agg = self.d(st.integers(0 if keys else 1, 3))
            items += [self.agg_item(refs, k) for k in range(n_agg)]
            if not items:
                items = ["COUNT(*)"]
            items = list(self.d(st.permutations(items)))
            select = ", ".join(items)
            if keys:
                group = f" {self.kw('group by')} " + ", ".join(ref.col(c) for ref, c in keys)
            if self.chance(0.4):
                having = self.having(refs, keys)
        elif self.chance(0.15):
            select = "*"
        else:
            select = ", ".join(self.scalar_item(refs, k) for k in range(self.d(st.integers(1, 3))))
        if not group and not having and self.chance(0.15) and not _has_aggregate(select):
            select = f"{self.kw('distinct')} {select}"  # one row per value tuple, at the lub of its rows
        r2s = self.pick((None, None, None, "ISTREAM", "RSTREAM", "DSTREAM", "w:ISTREAM", "w:RSTREAM", "w:DSTREAM"))
        if r2s and not r2s.startswith("w:"):
            select = f"{self.kw(r2s)} {select}"
        text = f"{self.kw('select')} {select} {self.kw('from')} {from_}{where}{group}{having}"
        if r2s and r2s.startswith("w:"):
            text = f"{self.kw(r2s[2:])}({text})"
        if self.chance(0.1):
            text += ";"
        return text


def _has_aggregate(select: str) -> bool:
    import re

    return bool(re.search(r"\b(count|sum|avg|min|max)\s*\(", select, re.I))


@st.composite
def queries(draw, config: Config, level: str, extremes: bool = False) -> str:
    """Random MLS-CQL text that ``compile_query(text, config, level)`` accepts (``extremes``:
    with overflow-prone 64-bit arithmetic and literals near the limits)."""
    lvl = config.lattice.parse(level)
    text = _Gen(draw, config, lvl, extremes).query()
    try:
        compile_query(text, config, lvl)
    except QueryError:
        assume(False)
    return text


# ------------------------------------------------------------------------- compound queries

_SIGNATURES = (("string",), ("string", "double"), ("double",), ("long",), ("string", "long"), ("double", "long"))
_LITERALS = {"string": ("'a'", "'b'"), "double": ("1.5", "100.0"), "long": ("1", "7")}


def _select_of(gen: _Gen, ref: _Ref, sig: tuple[str, ...]) -> tuple[str, str, str]:
    """(select list, GROUP BY text, kind) of one SELECT of ``ref`` whose columns have types ``sig``
    (a long and a double combine, so either may stand for the other)."""
    strings, numeric = ref.cols("string"), ref.cols("double", "long")
    if sig[0] == "string" and len(sig) == 2 and strings and numeric and gen.chance(0.4):
        key = ref.col(gen.pick(strings))
        agg = gen.pick(("COUNT(*)", f"AVG({ref.col(gen.pick(numeric))})", f"MAX({ref.col(gen.pick(numeric))})"))
        return f"{key}, {agg}", f" {gen.kw('group by')} {key}", "agg"
    if len(sig) == 1 and sig[0] != "string" and numeric and gen.chance(0.3):
        col = ref.col(gen.pick(numeric))
        return gen.pick(("COUNT(*)", f"SUM({col})", f"MIN({col})")), "", "agg"
    items = []
    for t in sig:
        cols = ref.cols(t) if t == "string" else numeric
        items.append(ref.col(gen.pick(cols)) if cols and gen.chance(0.85) else gen.pick(_LITERALS[t]))
    return ", ".join(items), "", "plain"


@st.composite
def compound_queries(draw, config: Config, level: str) -> str:
    """Random ``q1 UNION [ALL] q2 [EXCEPT q3]`` text (also INTERSECT, and parentheses around two of
    three SELECTs) the front end accepts: each SELECT over one
    stream with any window (conditions included) and WHERE, plain, DISTINCT or aggregated, columns
    of matching types; the stream operator on the first SELECT, around the whole, or the default."""
    lvl = config.lattice.parse(level)
    gen = _Gen(draw, config, lvl)
    sig = gen.pick(_SIGNATURES)
    parts = []
    for k in range(gen.d(st.integers(2, 3))):
        ref = gen.refs(1)[0]
        select, group, kind = _select_of(gen, ref, sig)
        if kind == "plain" and gen.chance(0.2):
            select = f"{gen.kw('distinct')} {select}"
        parts.append(f"{gen.kw('select')} {{r2s}}{select} {gen.kw('from')} {gen.from_text(ref, False)}"
                     f"{gen.where([ref], False)}{group}")
    ops = [gen.pick(("UNION", "UNION ALL", "EXCEPT", "INTERSECT", "union", "union all", "except", "intersect"))
           for _ in parts[1:]]
    r2s = gen.pick((None, None, "ISTREAM", "RSTREAM", "DSTREAM", "w:ISTREAM", "w:RSTREAM", "w:DSTREAM"))
    first = f"{gen.kw(r2s)} " if r2s and not r2s.startswith("w:") else ""
    parts = [parts[0].replace("{r2s}", first)] + [p.replace("{r2s}", "") for p in parts[1:]]
    # parentheses (three SELECTs): around the last two, or around the first two (no stream operator
    # inside them); else INTERSECT binds tighter than the operator before it
    group = gen.pick((None, None, "last", "first")) if len(parts) == 3 else None
    if group == "first" and first:
        group = None
    if group == "last":
        text = f"{parts[0]} {ops[0]} ({parts[1]} {ops[1]} {parts[2]})"
    elif group == "first":
        text = f"({parts[0]} {ops[0]} {parts[1]}) {ops[1]} {parts[2]}"
    else:
        text = parts[0] + "".join(f" {op} {p}" for op, p in zip(ops, parts[1:]))
    if r2s and r2s.startswith("w:"):
        text = f"{gen.kw(r2s[2:])}({text})"
    try:
        compile_query(text, config, lvl)
    except QueryError:
        assume(False)
    return text
