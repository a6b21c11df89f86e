"""What the master admits: the limits of one ingest batch and of an advance, and the refusal they raise.

Plain checks, no state of their own; the core (:class:`~strata.master.core.MasterCore`) calls them
in this order for a batch (:meth:`~strata.master.core.MasterCore.ingest_batch`):

* :func:`check_seq`: an exactly-once batch's sequence number;
* :func:`conform_batch`: the edge: encoded columns (dictionary, run-end, views, large strings)
  decoded to the stream's types, sized as decoded first (:mod:`strata.edge`);
* then, outside this module, the stream name and the shepherd (rows above the master's level go);
* :func:`check_limits`: batch size and the largest instant, on the rows the shepherd kept only;
* :func:`check_horizon`: how far an advance may close instants past the input;

and for a stream declared at run time, :func:`declared_stream`.

Every refusal is counted through ``count(reason)`` (operators see the counts in ``strata status``)
and raised as :class:`Refused` with one line.  Nothing here looks at a row the shepherd dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import pyarrow as pa
import pyarrow.compute as pc

from strata.config import Limits, StreamError, stream_of
from strata.punctuations import input_schema
from strata.edge import EdgeError, conform, stream_targets
from strata.names import MAX_NAME_CHARS

__all__ = ["Refused", "BatchOutcome", "MAX_INGEST_ROWS", "MAX_INGEST_BYTES", "MAX_PRODUCER_ID", "DEFAULT_MAX_TS",
           "DEFAULT_ADVANCE_HORIZON", "check_seq", "conform_batch", "check_limits", "check_horizon", "producer_key",
           "declared_stream"]

MAX_INGEST_ROWS = 1_000_000  # per batch, counted on the rows the shepherd kept
MAX_INGEST_BYTES = 64 * 1024 * 1024  # per batch (kept rows); the transport allows twice that
#: the defaults of ``[limits] max_ts`` and ``advance_horizon`` (declared in strata/config.py, :class:`Limits`)
DEFAULT_MAX_TS = Limits.max_ts
DEFAULT_ADVANCE_HORIZON = Limits.advance_horizon
#: longest producer id (the client's part; the master prefixes the session's user)
MAX_PRODUCER_ID = 128

Count = Callable[[str], None]


class Refused(ValueError):
    """A call refused by a limit or a check; ``reason`` is the counter it is counted under."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


@dataclass
class BatchOutcome:
    """What one ingest batch did: rows kept and applied (for a duplicate: what its first delivery
    applied), rows the shepherd dropped (told to its producer only), chunks its advance cut, and
    whether it was a duplicate (at or below its producer's high-water mark: not applied again)."""

    accepted: int = 0
    dropped: int = 0
    chunks: int = 0
    duplicate: bool = False
    #: rows the level shed (master/shedding.py) and their first and last instant (-1: none)
    shed: int = 0
    shed_first: int = -1
    shed_last: int = -1


def check_seq(producer: str | None, seq, count: Count) -> None:
    """An exactly-once batch (``producer`` given) carries a sequence number from 1."""
    if producer is not None and (isinstance(seq, bool) or not isinstance(seq, int) or seq < 1):
        count("bad_seq")
        raise Refused(f"batch seq {seq!r} of producer {producer}: must be an integer from 1", "bad_seq")


def producer_key(user: str, producer_id: str, count: Count) -> str | None:
    """The producer key of an exactly-once batch: the session's user and the client's id (None: the
    batch has no id).  A bad id raises ValueError (counted ``bad_producer``)."""
    if not producer_id:
        return None
    if len(producer_id) > MAX_PRODUCER_ID or not producer_id.isprintable():
        count("bad_producer")
        raise ValueError(f"producer id: at most {MAX_PRODUCER_ID} printable characters")
    return f"{user}/{producer_id}"


def conform_batch(config, stream: str, table, count: Count):
    """The batch with its encoded columns (dictionary, run-end, views, large strings) decoded to the
    stream's types, so the shepherd, the limits, the log and the chunker see plain columns only;
    refused (``bad_type``, ``oversized``) if a column's type is not accepted or the columns would
    decode to more than the transport's cap: sizes are those after decoding, counted first
    (:mod:`strata.edge`).  An unknown stream is left to the pipeline's message."""
    schema = input_schema(config, stream)
    if schema is None:
        return table
    if isinstance(table, pa.RecordBatch):
        table = pa.Table.from_batches([table])
    if not isinstance(table, pa.Table):
        return table  # not Arrow: the chunker says it cannot read it
    try:
        return conform(table, stream_targets(schema), 2 * MAX_INGEST_BYTES, f"{schema.kind} {schema.name}")
    except EdgeError as e:
        count(e.reason)
        raise Refused(str(e), e.reason) from None


def check_limits(stream: str, kept: pa.Table, max_ts: int, count: Count) -> None:
    """Batch size and timestamp bounds, on kept rows only."""
    if kept.num_rows > MAX_INGEST_ROWS:
        count("oversized")
        raise Refused(f"batch of {kept.num_rows} rows exceeds {MAX_INGEST_ROWS}; split it", "oversized")
    if kept.nbytes > MAX_INGEST_BYTES:
        count("oversized")
        raise Refused(f"batch of {kept.nbytes} bytes exceeds {MAX_INGEST_BYTES}; split it", "oversized")
    if not kept.num_rows:
        return
    lower = {c.lower(): c for c in kept.column_names}
    if "ts" not in lower:
        return  # the chunker names the missing column
    try:
        top = pc.max(kept.column(lower["ts"]).cast(pa.int64())).as_py()
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError):
        return  # not integers: the chunker refuses the type
    if top is not None and top > max_ts:
        count("ts_out_of_range")
        raise Refused(f"stream {stream}: ts {top} is beyond the largest instant accepted "
                      f"({max_ts}, [limits] max_ts); nothing of this batch was applied", "ts_out_of_range")


def check_horizon(upto_ts: int, last_input_ts: int | None, horizon: int, count: Count, top: int | None = None,
                  prefix: str = "") -> None:
    """Refuse (counted) closing instants beyond the latest kept instant ingested (``last_input_ts``,
    or ``top``, the latest of a batch about to be applied) plus ``horizon`` (``[limits]
    advance_horizon``)."""
    base = last_input_ts if last_input_ts is not None else 0
    if top is not None and (last_input_ts is None or top > base):
        base = top
    bound = base + horizon
    if upto_ts > bound:
        count("advance_beyond_horizon")
        raise Refused(f"{prefix}advance to {upto_ts} refused: at most {horizon} instants "
                      f"([limits] advance_horizon) past the latest instant ingested ({base}), "
                      f"i.e. up to {bound}", "advance_beyond_horizon")


def declared_stream(config, name: str, columns) -> tuple:
    """(the stream, whether it is new) for declaring stream ``name`` with ``columns`` ((attribute,
    type) pairs) in ``config``: the same declaration again gives the existing stream; another one
    for an existing name (a stream's or a stored relation's: they share one namespace), or a bad
    one, raises :class:`Refused` (``bad_stream``) with one line."""
    have = config.stream(name) if isinstance(name, str) else None
    if have is not None and have.relation:
        raise Refused(f"{have.name} is a stored relation ([relations.{have.name}]); a stream cannot take its "
                      f"name (streams and relations share one namespace)", "bad_stream")
    if have is not None:
        if have.name == name and list(have.columns) == [tuple(c) for c in columns]:
            return have, False
        raise Refused(f"stream {have.name} exists with attributes "
                      f"{', '.join(f'{c}={t}' for c, t in have.columns)}", "bad_stream")
    try:
        return stream_of(name, [tuple(c) for c in columns], config.streams), True
    except StreamError as e:
        shown = name if isinstance(name, str) and len(name) <= MAX_NAME_CHARS else "(name)"
        raise Refused(f"stream {shown}: {e}" + (f" ({e.key})" if e.key else ""), "bad_stream") from None
