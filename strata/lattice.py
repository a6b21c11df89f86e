"""Security lattices: total orders, classifications with categories, Chinese Wall vector lattices.

Levels are handled everywhere as their *canonical text*: ``"S"`` for a total
order, ``"(S,{NATO})"`` for a classification with categories, ``"[1,B]"`` /
``"[⊥,T]"`` for a Chinese Wall lattice.  Canonical strings
travel unchanged through Arrow columns, CSV files and protobuf messages.

Every lattice also has a bitmask encoding with ``decode(a | b) == lub(a, b)``
and ``decode(0) == bottom``: Spark computes output levels of joins, windows and
groups with a plain ``bit_or`` and decodes them afterwards.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from functools import cached_property
from typing import Iterable

__all__ = ["Lattice", "TotalOrder", "Categories", "ChineseWall", "LevelError", "BOTTOM", "TOP", "BOTTOM_ALIASES", "TOP_ALIASES"]

BOTTOM = "⊥"
TOP = "T"
#: how a Chinese Wall component may spell ⊥ and T; none of them (in any case) may name a company
BOTTOM_ALIASES = (BOTTOM, "0", "_|_", "bot")
TOP_ALIASES = (TOP, "⊤")
_RESERVED = frozenset(a.casefold() for a in BOTTOM_ALIASES + TOP_ALIASES)
_MAX_MASK_BITS = 63


class LevelError(ValueError):
    """A level literal that the lattice does not contain."""


class Lattice(ABC):
    """A finite lattice of security levels with a bottom."""

    kind: str

    @property
    @abstractmethod
    def levels(self) -> tuple[str, ...]:
        """All levels, each after every level it dominates (a linear extension)."""

    @property
    @abstractmethod
    def bottom(self) -> str: ...

    @property
    @abstractmethod
    def top(self) -> str: ...

    @abstractmethod
    def leq(self, a: str, b: str) -> bool:
        """``a ≤ b``: ``b`` dominates ``a``.  ``None`` (no level, e.g. a users-file entry whose
        clearance is unknown) dominates nothing and is dominated by nothing."""

    @abstractmethod
    def lub(self, a: str, b: str) -> str: ...

    @abstractmethod
    def parse(self, text: str) -> str:
        """Canonical level for a literal; raises LevelError for unknown levels."""

    @abstractmethod
    def encode(self, level: str) -> int:
        """Bitmask of a level; OR of masks decodes to the lub."""

    @abstractmethod
    def decode(self, mask: int) -> str: ...

    # -- derived ---------------------------------------------------------------
    def lub_all(self, levels: Iterable[str]) -> str:
        out = self.bottom
        for lv in levels:
            out = self.lub(out, lv)
        return out

    def dominated(self, level: str) -> frozenset[str]:
        """``{l : l ≤ level}`` (Algorithm 2 line 3 with ≤, SEMANTICS §2)."""
        return frozenset(l for l in self.levels if self.leq(l, level))

    def contains(self, text: str) -> bool:
        try:
            self.parse(text)
        except LevelError:
            return False
        return True

    def sort(self, levels: Iterable[str]) -> list[str]:
        """Levels in the lattice's linear-extension order (stable printing)."""
        return sorted(set(levels), key=self._order.__getitem__)

    @cached_property
    def _order(self) -> dict[str, int]:
        return {lv: i for i, lv in enumerate(self.levels)}

    @cached_property
    def mask_table(self) -> dict[str, int]:
        return {lv: self.encode(lv) for lv in self.levels}

    def describe(self) -> str:
        return f"{self.kind} lattice with {len(self.levels)} levels"


class TotalOrder(Lattice):
    """``levels[0] < levels[1] < …`` (dissertation ch. 4: U < C < S < TS)."""

    kind = "total order"

    def __init__(self, levels: Iterable[str]):
        lv = tuple(levels)
        if not lv:
            raise ValueError("a total order needs at least one level")
        if len(set(lv)) != len(lv):
            dup = next(x for x in lv if lv.count(x) > 1)
            raise ValueError(f"duplicate level {dup!r}")
        for name in lv:
            if not isinstance(name, str) or not name.isidentifier():
                raise ValueError(f"level name {name!r} is not an identifier")
        if len(lv) > _MAX_MASK_BITS:
            raise ValueError(f"at most {_MAX_MASK_BITS} levels are supported")
        self._levels = lv
        self._rank = {name: i for i, name in enumerate(lv)}

    @property
    def levels(self) -> tuple[str, ...]:
        return self._levels

    @property
    def bottom(self) -> str:
        return self._levels[0]

    @property
    def top(self) -> str:
        return self._levels[-1]

    def leq(self, a: str, b: str) -> bool:
        if a is None or b is None:
            return False
        return self._rank[a] <= self._rank[b]

    def lub(self, a: str, b: str) -> str:
        return a if self._rank[a] >= self._rank[b] else b

    def parse(self, text: str) -> str:
        t = str(text).strip()
        if t in self._rank:
            return t
        raise LevelError(f"unknown level {t!r} (levels: {', '.join(self._levels)})")

    def encode(self, level: str) -> int:
        return (1 << (self._rank[level] + 1)) - 1

    def decode(self, mask: int) -> str:
        if mask == 0:
            return self.bottom
        return self._levels[int(mask).bit_length() - 1]

    def __repr__(self) -> str:
        return f"TotalOrder({list(self._levels)!r})"


class Categories(Lattice):
    """A classification and a set of categories (dissertation ch. 4: ``(S, {NATO})``): ``(c1, K1) ≤
    (c2, K2)`` iff ``c1 ≤ c2`` in the total order of classifications and ``K1 ⊆ K2``; the lub takes
    the higher classification and the union of the categories.  Two levels may be incomparable:
    ``(S,{NATO})`` and ``(TS,{CRYPTO})``.

    Canonical text ``(TS,{NATO,CRYPTO})``: categories in their declared order, ``(U,{})`` without
    any.  A literal may also be written ``( TS , { CRYPTO, NATO } )`` or, without categories, as
    the bare classification ``TS``.  Mask: the classification as a total order's prefix bits (one
    per classification), then one bit per category, so ``decode(a | b) == lub(a, b)``."""

    kind = "categories"
    #: categories a lattice may have: every level is enumerated (classifications × 2^categories)
    MAX_CATEGORIES = 10

    def __init__(self, classifications: Iterable[str], categories: Iterable[str] = ()):
        self.classes = TotalOrder(classifications)
        cats = tuple(categories)
        for c in cats:
            if not isinstance(c, str) or not c.isidentifier():
                raise ValueError(f"category name {c!r} is not an identifier")
            if c in self.classes.levels:
                raise ValueError(f"category {c!r} is also a classification")
        if len(set(cats)) != len(cats):
            dup = next(x for x in cats if cats.count(x) > 1)
            raise ValueError(f"duplicate category {dup!r}")
        if len(cats) > self.MAX_CATEGORIES:
            raise ValueError(f"at most {self.MAX_CATEGORIES} categories are supported (every level is enumerated)")
        if len(self.classes.levels) + len(cats) > _MAX_MASK_BITS:
            raise ValueError(f"classifications and categories need at most {_MAX_MASK_BITS} mask bits")
        self.categories = cats
        self._cat_index = {c: i for i, c in enumerate(cats)}
        self._n = len(self.classes.levels)

    # parts ------------------------------------------------------------------
    def split(self, level: str) -> tuple[str, frozenset[str]]:
        """(classification, categories) of a canonical level."""
        cls, rest = level[1:-1].split(",", 1)
        body = rest.strip()[1:-1]
        return cls, frozenset(x for x in body.split(",") if x)

    def make(self, cls: str, cats: Iterable[str]) -> str:
        ordered = sorted(set(cats), key=self._cat_index.__getitem__)
        return f"({cls},{{{','.join(ordered)}}})"

    @cached_property
    def levels(self) -> tuple[str, ...]:
        subsets = [frozenset(c for j, c in enumerate(self.categories) if k >> j & 1)
                   for k in range(1 << len(self.categories))]
        pairs = [(r, cls, s) for r, cls in enumerate(self.classes.levels) for s in subsets]
        pairs.sort(key=lambda p: (p[0] + len(p[2]), p[0], sorted(self._cat_index[c] for c in p[2])))
        return tuple(self.make(cls, s) for _, cls, s in pairs)

    @property
    def bottom(self) -> str:
        return self.make(self.classes.bottom, ())

    @property
    def top(self) -> str:
        return self.make(self.classes.top, self.categories)

    def leq(self, a: str, b: str) -> bool:
        if a is None or b is None:
            return False
        (ca, ka), (cb, kb) = self.split(a), self.split(b)
        return self.classes.leq(ca, cb) and ka <= kb

    def lub(self, a: str, b: str) -> str:
        (ca, ka), (cb, kb) = self.split(a), self.split(b)
        return self.make(self.classes.lub(ca, cb), ka | kb)

    def parse(self, text: str) -> str:
        t = str(text).strip()
        if t.startswith("(") and t.endswith(")"):
            inner = t[1:-1]
            cls, sep, rest = inner.partition(",")
            rest = rest.strip()
            if not sep or not (rest.startswith("{") and rest.endswith("}")):
                raise LevelError(f"level {t!r} is not written like (S,{{NATO}}) or S")
            names = [x.strip() for x in rest[1:-1].split(",") if x.strip()]
        else:
            cls, names = t, []
        try:
            cls = self.classes.parse(cls)
        except LevelError:
            raise LevelError(f"level {t!r}: unknown classification {cls.strip()!r} "
                             f"(classifications: {', '.join(self.classes.levels)})") from None
        for x in names:
            if x not in self._cat_index:
                raise LevelError(f"level {t!r}: unknown category {x!r} (categories: "
                                 f"{', '.join(self.categories) or 'none'})")
        return self.make(cls, names)

    def encode(self, level: str) -> int:
        cls, cats = self.split(level)
        mask = self.classes.encode(cls)
        for c in cats:
            mask |= 1 << (self._n + self._cat_index[c])
        return mask

    def decode(self, mask: int) -> str:
        m = int(mask)
        cls = self.classes.decode(m & ((1 << self._n) - 1))
        return self.make(cls, (c for j, c in enumerate(self.categories) if m >> (self._n + j) & 1))

    def __repr__(self) -> str:
        return f"Categories({list(self.classes.levels)!r}, {list(self.categories)!r})"


class ChineseWall(Lattice):
    """Vector lattice of dissertation Def. 14-17 over conflict-of-interest classes."""

    kind = "Chinese Wall"

    def __init__(self, coi: Iterable[Iterable[str]]):
        classes = tuple(tuple(str(c) for c in cls) for cls in coi)
        if not classes:
            raise ValueError("a Chinese Wall lattice needs at least one COI class")
        for k, cls in enumerate(classes, 1):
            if not cls:
                raise ValueError(f"COI class {k} is empty")
            for c in cls:
                if c.casefold() in _RESERVED:
                    raise ValueError(
                        f"company name {c!r} in COI class {k} is reserved: levels spell ⊥ as "
                        f"{', '.join(BOTTOM_ALIASES)} and T as {', '.join(TOP_ALIASES)} (in any case)"
                    )
                if not _is_company(c):
                    raise ValueError(
                        f"company name {c!r} in COI class {k} is invalid (use letters, digits, _ and -)"
                    )
            if len(set(cls)) != len(cls):
                dup = next(c for c in cls if cls.count(c) > 1)
                raise ValueError(f"company {dup!r} appears twice in COI class {k}")
        bits = sum(len(c) + 1 for c in classes)
        if bits > _MAX_MASK_BITS:
            raise ValueError(f"COI classes need {bits} mask bits; at most {_MAX_MASK_BITS} supported")
        self.coi = classes
        offsets, off = [], 0
        for cls in classes:
            offsets.append(off)
            off += len(cls) + 1
        self._offsets = tuple(offsets)

    @property
    def mask_offsets(self) -> tuple[int, ...]:
        """Bit offset of each COI class in the mask: class k uses ``len(coi[k]) + 1`` bits
        from there (one per company, then a T bit)."""
        return self._offsets

    # components ------------------------------------------------------------
    def components(self, level: str) -> tuple[str, ...]:
        return _split_vector(level)

    @staticmethod
    def _join(parts: Iterable[str]) -> str:
        return "[" + ",".join(parts) + "]"

    @cached_property
    def levels(self) -> tuple[str, ...]:
        per = [(BOTTOM, *cls, TOP) for cls in self.coi]
        vectors = itertools.product(*per)
        # rank: ⊥=0, company=1, T=2 → sum of ranks is a linear extension
        rank = lambda v: sum(0 if x == BOTTOM else 2 if x == TOP else 1 for x in v)  # noqa: E731
        ordered = sorted(vectors, key=lambda v: (rank(v), [p.index(x) for p, x in zip(per, v)]))
        return tuple(self._join(v) for v in ordered)

    @property
    def bottom(self) -> str:
        return self._join(BOTTOM for _ in self.coi)

    @property
    def top(self) -> str:
        return self._join(TOP for _ in self.coi)

    def leq(self, a: str, b: str) -> bool:
        if a is None or b is None:
            return False
        return all(x == y or x == BOTTOM or y == TOP for x, y in zip(_split_vector(a), _split_vector(b)))

    def lub(self, a: str, b: str) -> str:
        out = []
        for x, y in zip(_split_vector(a), _split_vector(b)):
            out.append(x if x == y else y if x == BOTTOM else x if y == BOTTOM else TOP)
        return self._join(out)

    def parse(self, text: str) -> str:
        t = str(text).strip()
        if not (t.startswith("[") and t.endswith("]")):
            raise LevelError(f"level {t!r} is not a vector like [1,B] in this Chinese Wall lattice")
        parts = [p.strip() for p in t[1:-1].split(",")]
        if len(parts) != len(self.coi):
            raise LevelError(f"level {t!r} has {len(parts)} components; the lattice has {len(self.coi)} COI classes")
        out = []
        for k, (p, cls) in enumerate(zip(parts, self.coi), 1):
            if p in BOTTOM_ALIASES:
                out.append(BOTTOM)
            elif p in TOP_ALIASES:
                out.append(TOP)
            elif p in cls:
                out.append(p)
            else:
                raise LevelError(f"level {t!r}: {p!r} is not a company of COI class {k} ({', '.join(cls)})")
        return self._join(out)

    def encode(self, level: str) -> int:
        mask = 0
        for x, cls, off in zip(_split_vector(level), self.coi, self._offsets):
            if x == TOP:
                mask |= ((1 << (len(cls) + 1)) - 1) << off
            elif x != BOTTOM:
                mask |= 1 << (off + cls.index(x))
        return mask

    def decode(self, mask: int) -> str:
        out = []
        for cls, off in zip(self.coi, self._offsets):
            part = (int(mask) >> off) & ((1 << (len(cls) + 1)) - 1)
            companies = part & ((1 << len(cls)) - 1)
            n = bin(companies).count("1")
            if part >> len(cls) or n >= 2:
                out.append(TOP)
            elif n == 1:
                out.append(cls[companies.bit_length() - 1])
            else:
                out.append(BOTTOM)
        return self._join(out)

    def __repr__(self) -> str:
        return f"ChineseWall({[list(c) for c in self.coi]!r})"


def _is_company(name: str) -> bool:
    return name.replace("_", "").replace("-", "").isalnum()


def _split_vector(level: str) -> tuple[str, ...]:
    return tuple(level[1:-1].split(","))
