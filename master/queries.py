"""A query as its owner sees it, and the released results the master keeps for its subscribers.

:class:`QueryInfo` is one registered query: its text, owner, rewritten form, state (running,
cancelled, failed, revoked; shown as ended once a running query ends) and the results released for
it.  :class:`Retention` bounds what is kept (``[limits] result_retention_rows`` and
``result_retention_results``) and hands a subscriber the results after its cursor; a subscriber
that needs a result no longer kept gets :class:`ResultsGone`, never a silent gap.

Plain logic over plain data; the core (:class:`~strata.master.core.MasterCore`) calls it under its
lock.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .pipeline import Released

__all__ = ["QueryInfo", "NotYours", "ResultsGone", "Retention", "STATES", "query_number", "view", "has_news"]

#: a query's state as its owner sees it
STATES = ("running", "ended", "cancelled", "failed", "revoked")


class ResultsGone(LookupError):
    """A subscriber asked for results the master no longer keeps (``[limits] result_retention_rows``)."""


class NotYours(LookupError):
    """A query id that is not one of the caller's queries (or does not exist: the same answer)."""


@dataclass
class QueryInfo:
    query_id: str
    text: str
    owner: str  # user
    rewritten: str
    r2s: str
    columns: list[str]
    results: list[Released] = field(default_factory=list)
    base: int = 0  # results dropped from the front (retention); cursors count from the first result ever
    kept_rows: int = 0  # rows in ``results``
    dropped_upto: int | None = None  # the last instant of the newest dropped result
    ended: bool = False  # no result will ever be added to ``results``
    revoked_after: int | None = None  # stopped: no result with ts above this is ever released
    state: str = "running"  # running, cancelled, failed, revoked (shown as ended once a running query ends)
    error: str = ""  # failed: the one-line reason its owner sees
    last_ts: int | None = None  # the last instant released for it
    roles: tuple = ()  # the registering session's roles (security punctuations grant or deny them)

    @property
    def shown_state(self) -> str:
        return "ended" if self.state == "running" and self.ended else self.state


def query_number(qid: str) -> int:
    """The number of query id ``qN`` (ids continue after the largest after a restart)."""
    return int(qid.lstrip("q") or 0)


def view(i: QueryInfo) -> dict:
    """What its owner reads of a query (``strata status``, ``strata query list``, a cancel's reply)."""
    return {"query_id": i.query_id, "text": i.rewritten, "state": i.shown_state,
            "last_ts": -1 if i.last_ts is None else i.last_ts, "error": i.error,
            "stopped_after": -1 if i.revoked_after is None else i.revoked_after}


def has_news(queries: dict[str, QueryInfo], qids: list[str], cursor: dict[str, int]) -> bool:
    """Whether one of ``qids`` has a result after ``cursor`` or has ended (may be read without the
    core's lock: a stale answer only means one more look after the next notification)."""
    for q in qids:
        info = queries.get(q)
        if info is None or info.ended or getattr(info, "base", 0) + len(info.results) != cursor.get(q, 0):
            return True
    return False


class Retention:
    """The released results kept per query: at most ``rows`` rows and ``results`` results (the
    newest result always stays)."""

    def __init__(self, rows: int, results: int):
        self.rows = rows
        self.results = results

    def describe(self) -> str:
        return f"retention {self.rows} rows, {self.results} results"

    def keep(self, info: QueryInfo, r: Released) -> None:
        """Keep released result ``r`` (with rows) of ``info``'s query, dropping the oldest beyond the
        bounds (:meth:`trim`)."""
        info.results.append(r)
        info.kept_rows += r.rows.num_rows
        self.trim(info)

    def trim(self, info: QueryInfo) -> None:
        """Bound the results kept for resuming subscribers: drop the oldest while the query keeps more
        than :attr:`rows` rows or :attr:`results` results (the newest result always stays).  A
        subscriber that still needs a dropped one gets :class:`ResultsGone`, never a silent gap."""
        while (info.kept_rows > self.rows or len(info.results) > self.results) and len(info.results) > 1:
            old = info.results.pop(0)
            info.base += 1
            info.kept_rows -= old.rows.num_rows
            info.dropped_upto = old.last_ts if info.dropped_upto is None else max(info.dropped_upto, old.last_ts)

    def check_resume(self, queries: dict[str, QueryInfo], qids: list[str], after_ts: int) -> None:
        """Refuse (:class:`ResultsGone`) a subscription that resumes after ``after_ts`` when results of
        later instants were dropped: the subscriber would miss them."""
        for q in qids:
            info = queries[q]
            if info.dropped_upto is not None and info.dropped_upto > after_ts:
                raise ResultsGone(f"query {q}: results up to instant {info.dropped_upto} are no longer kept "
                                  f"({self.describe()}); resume after that instant")

    def take(self, queries: dict[str, QueryInfo], qids: list[str],
             cursor: dict[str, int]) -> tuple[list[Released], list[str]]:
        """The results of ``qids`` after ``cursor[qid]`` (a count of the query's results since its first,
        dropped ones included; a new subscriber starts at the oldest kept), the cursor moved past
        them, and the queries among ``qids`` that have ended with every result taken.  A subscriber
        whose next result was dropped before it read it gets :class:`ResultsGone`."""
        out, ended = [], []
        for q in qids:
            info = queries[q]
            cursor.setdefault(q, info.base)
            if cursor[q] < info.base:
                raise ResultsGone(f"query {q}: results up to instant {info.dropped_upto} were dropped before "
                                  f"this subscriber read them ({self.describe()})")
            out.extend(info.results[cursor[q] - info.base:])
            cursor[q] = info.base + len(info.results)
            if info.ended:
                ended.append(q)
        return out, ended
