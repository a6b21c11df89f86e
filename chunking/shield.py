"""The per-query input shields the chunker applies before a tuple reaches a legacy window
(docs/semantics.md §11-12): the **Security Shield** of security punctuations and the **initial
privacy switch** (paper 004).  A tuple a shield denies is invisible to that query exactly like a
tuple whose level the query does not dominate: it is in none of its windows and is not an instant
of the query.

:class:`Shields` holds

* the punctuations per (stream pattern, level) as a history of policies (one per instant that has
  punctuations; a later one replaces an earlier one wholesale), trimmed to what tuples not yet fed
  can still need (the policy in force at the first open instant, and newer ones);
* the privacy switches per (query, stream): the instants from which the owner's access is off or
  on again, with the counters operators read (access counter, tuples blocked and passed).

It is applied when instants close (the chunker feeds its queries then), so every punctuation and
switch of an instant is in before any tuple of that instant is shown to a query: no sequence
numbers are needed (the paper's csn).  Plain logic; the chunker owns one.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from strata.punctuations import Punctuation, from_json, to_json, tuple_mask, visible_mask

__all__ = ["Shields", "Switch", "SwitchError"]


class SwitchError(ValueError):
    """A switch change refused (one line)."""


@dataclass
class Switch:
    """One privacy switch: ``query``'s owner ``user`` and stream ``stream``; ``changes``: (instant, on)
    in instant order (on before the first change)."""

    query: str
    user: str
    stream: str
    changes: list = field(default_factory=list)
    blocked: int = 0  # tuples the initial switch kept out of the query's input
    passed: int = 0  # tuples it let through

    def on_at(self, t: int) -> bool:
        on = True
        for at, state in self.changes:
            if at > t:
                break
            on = state
        return on

    def off_mask(self, ts: np.ndarray) -> np.ndarray:
        """Which instants ``ts`` lie in an interval where the switch is off."""
        off = np.zeros(len(ts), dtype=bool)
        for at, state in self.changes:
            off = np.where(ts >= at, not state, off)
        return off

    def view(self, now: int) -> dict:
        on = self.on_at(now)
        last = max((at for at, _ in self.changes if at <= now), default=None)
        return {"query_id": self.query, "user": self.user, "stream": self.stream, "state": "on" if on else "off",
                "since": -1 if last is None else int(last), "access_counter": int(on),
                "blocked": self.blocked, "passed": self.passed,
                "changes": [[int(a), bool(s)] for a, s in self.changes]}


class Shields:
    def __init__(self):
        #: (stream name or "*", level) -> [(instant, [Punctuation])] in instant order
        self.history: dict[tuple[str, str], list[tuple[int, list[Punctuation]]]] = {}
        self.switches: dict[tuple[str, str], Switch] = {}  # (query, stream) -> switch
        self.punctuations = 0  # accepted so far

    # -- punctuations ------------------------------------------------------------------------------
    def add_punctuations(self, sps: list[Punctuation]) -> None:
        for sp in sps:
            h = self.history.setdefault((sp.stream, sp.level), [])
            if h and h[-1][0] == sp.ts:
                h[-1][1].append(sp)
            else:
                h.append((sp.ts, [sp]))
            self.punctuations += 1

    def levels_with_policies(self, stream: str) -> list[str]:
        return sorted({lv for (s, lv) in self.history if s in (stream, "*")})

    def _policies(self, stream: str, level: str) -> tuple[list[int], list[list[Punctuation]]]:
        """The policy history of (``stream``, ``level``): instants and their policies (both patterns)."""
        merged: dict[int, list[Punctuation]] = {}
        for key in ((stream, level), ("*", level)):
            for t, sps in self.history.get(key, ()):
                merged.setdefault(t, []).extend(sps)
        ts = sorted(merged)
        return ts, [merged[t] for t in ts]

    def trim(self, open_from: int) -> None:
        """Forget policies no tuple at or after ``open_from`` can be under."""
        for key, h in self.history.items():
            k = bisect_right([t for t, _ in h], open_from) - 1  # the one in force at open_from
            if k > 0:
                del h[:k]

    # -- switches ----------------------------------------------------------------------------------
    def set_switch(self, query: str, user: str, stream: str, on: bool, at: int) -> tuple[Switch, bool]:
        """Turn (query, stream) on or off from instant ``at``; returns (the switch, whether it changed)."""
        sw = self.switches.get((query, stream))
        if sw is None:
            sw = self.switches[(query, stream)] = Switch(query, user, stream)
        if sw.changes and at < sw.changes[-1][0]:
            raise SwitchError(f"instant {at} is before the switch's last change at {sw.changes[-1][0]}")
        if sw.on_at(at) == on:
            return sw, False
        if sw.changes and sw.changes[-1][0] == at:
            sw.changes.pop()
        else:
            sw.changes.append((int(at), bool(on)))
        return sw, True

    def terminal_off(self, query: str, ts: np.ndarray) -> np.ndarray:
        """The terminal switch: which output instants ``ts`` of ``query`` its owner gets none of (some
        stream of the query switched off then)."""
        off = np.zeros(len(ts), dtype=bool)
        for (q, _), sw in self.switches.items():
            if q == query and sw.changes:
                off |= sw.off_mask(ts)
        return off

    def query_switched(self, query: str) -> bool:
        return any(q == query and sw.changes for (q, _), sw in self.switches.items())

    # -- the shield --------------------------------------------------------------------------------
    def active(self, query: str, stream: str) -> bool:
        """Whether anything may hide a tuple of ``stream`` from ``query`` (else no per-tuple work)."""
        sw = self.switches.get((query, stream))
        return bool(sw is not None and sw.changes) or any(s in (stream, "*") for s, _ in self.history)

    def mask(self, query: str, principal: tuple[str, frozenset], stream: str, attrs: tuple[str, ...],
             t: pa.Table) -> np.ndarray | None:
        """Which rows of ``t`` (a batch of ``stream``, ts sorted) the query may see; None: all of them."""
        n = t.num_rows
        if n == 0 or not self.active(query, stream):
            return None
        ts = t.column("ts").to_numpy()
        keep = np.ones(n, dtype=bool)
        levels = self.levels_with_policies(stream)
        if levels:
            level_col = t.column("level")
            full: dict[tuple, np.ndarray] = {}  # a tuple pattern -> its mask over all of t (once per batch)

            def over(sel):
                def matches(sp):
                    if sp is None:
                        return sel
                    key = (sp.attribute, sp.values, sp.lo, sp.hi)
                    if key not in full:
                        full[key] = tuple_mask(sp, t)
                    return full[key][sel]
                return matches

            for level in levels:
                rows = np.flatnonzero(np.asarray(pc.equal(level_col, level).to_numpy(zero_copy_only=False),
                                                 dtype=bool))
                if not len(rows):
                    continue
                instants, policies = self._policies(stream, level)
                which = np.searchsorted(np.asarray(instants), ts[rows], side="right") - 1
                for k in np.unique(which):
                    if k < 0:
                        continue  # no policy yet for (stream, level): the lattice alone decides
                    sel = rows[which == k]
                    keep[sel] = visible_mask(policies[k], over(sel), principal[0], principal[1], attrs)
        sw = self.switches.get((query, stream))
        if sw is not None and sw.changes:
            off = sw.off_mask(ts)
            sw.blocked += int((keep & off).sum())
            sw.passed += int((keep & ~off).sum())
            keep &= ~off
        return None if keep.all() else keep

    # -- checkpoints -------------------------------------------------------------------------------
    def export(self) -> dict:
        return {"history": [[s, lv, [[t, [to_json(p) for p in sps]] for t, sps in h]]
                            for (s, lv), h in self.history.items()],
                "switches": [{"query": sw.query, "user": sw.user, "stream": sw.stream,
                              "changes": [[a, s] for a, s in sw.changes], "blocked": sw.blocked,
                              "passed": sw.passed} for sw in self.switches.values()],
                "punctuations": self.punctuations}

    def load(self, meta: dict | None) -> None:
        if not meta:
            return
        self.history = {(s, lv): [(int(t), [from_json(p) for p in sps]) for t, sps in h]
                        for s, lv, h in meta.get("history", [])}
        self.switches = {}
        for d in meta.get("switches", []):
            self.switches[(d["query"], d["stream"])] = Switch(d["query"], d["user"], d["stream"],
                                                              [(int(a), bool(s)) for a, s in d["changes"]],
                                                              int(d["blocked"]), int(d["passed"]))
        self.punctuations = int(meta.get("punctuations", 0))
