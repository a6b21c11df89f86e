"""Input files and how a producer sends them: reading (``STREAM=FILE``, CSV or JSON lines, every
value checked against its stream's declared type), leaving out the rows the master would drop, and
cutting the rest into ingest batches with the advances that close complete instants.

Shared by ``strata ingest`` (strata/commands.py) and ``strata replay`` (deploy/replay.py).  A refusal
is a :class:`~strata.errors.CliError` of one line naming the file, the line and the column.  Arrow is
imported where it is used: ``strata --help`` imports this module and should not load pyarrow.
"""

from __future__ import annotations

import csv
import re

import numpy as np

from .errors import EXIT_REJECTED, CliError

__all__ = ["read_input", "check_inputs", "parse_inputs", "batches_of", "drop_above", "instant_batches"]


def read_input(cfg, stream: str, path: str):
    """A replay/ingest file: CSV with header ts,level,<attributes> (or JSON lines); a stored
    relation's file also has the column ``op`` (``insert`` or ``delete``).

    What is NULL is explicit (docs/operations.md, *Input files*): in CSV only an empty
    field of a double, long, timestamp or boolean column is NULL; a string or level
    column has no NULL (an empty field is the empty string).  ``NA``, ``NULL``, ``null``,
    ``N/A``, ``nan`` … are not NULL: in a numeric or boolean column they are refused like
    any other word.  A double must be finite: ``nan``/``NaN`` and ``inf`` are refused (in
    JSON lines too, where ``null`` is NULL).  A refusal is one line naming the file, the
    line and the column.  Reading stays Arrow's multi-threaded reader; the checks are
    vectorized.
    """
    import pyarrow as pa  # deferred: pyarrow (~80 ms) stays out of the CLI's start-up
    import pyarrow.compute as pc
    import pyarrow.csv as pcsv
    import pyarrow.json as pjson

    from .arrowio import ARROW_TYPES  # deferred: imports pyarrow

    schema = _stream_schema(cfg, stream)
    types = {"ts": pa.int64(), "level": pa.string()}
    types.update({c: ARROW_TYPES[t] for c, t in schema.columns})
    declared = {"ts": "long", "level": "level", **dict(schema.columns)}
    if schema.relation:  # a stored relation's rows say what they do: op = insert | delete
        types["op"] = pa.string()
        declared["op"] = "insert/delete"
    is_json = path.endswith((".jsonl", ".json"))
    first_line = 1 if is_json else 2  # the line of row 0 (one row per line; CSV: after the header)

    def refuse(row, column, message):
        where = f"line {row + first_line}, " if row is not None else ""
        raise CliError(f"{path}: {where}column {column}: {message}", EXIT_REJECTED)

    def header():
        with open(path, newline="", encoding="utf-8", errors="replace") as f:
            return next(csv.reader(f), [])

    def conversion_error(e):
        """Arrow names the column by number and the bad value, not the row: find its first row."""
        m = re.search(r"In CSV column #(\d+): CSV conversion error to (\w+): invalid value '(.*)'", str(e))
        if not m:
            return
        names = header()
        idx, value = int(m.group(1)), m.group(3)
        if idx >= len(names):
            return
        name = names[idx]
        col = pcsv.read_csv(path, convert_options=pcsv.ConvertOptions(
            include_columns=[name], column_types={name: pa.string()}, strings_can_be_null=False,
            quoted_strings_can_be_null=False)).column(0)
        row = pc.index(col, value).as_py()
        kind = declared.get(name, str(types.get(name, m.group(2))))
        refuse(row if row is not None and row >= 0 else None, name,
               f"{value!r} is not a {kind} value (only an empty field is NULL)")

    try:
        if is_json:
            table = pjson.read_json(path, parse_options=pjson.ParseOptions(explicit_schema=pa.schema(types)))
        else:
            table = pcsv.read_csv(path, convert_options=pcsv.ConvertOptions(
                column_types=types, null_values=[""], strings_can_be_null=False, quoted_strings_can_be_null=False))
    except OSError as e:
        raise CliError(f"{path}: {str(e).splitlines()[0]}") from None
    except pa.ArrowInvalid as e:
        if not is_json:
            conversion_error(e)
        raise CliError(f"{path}: {str(e).splitlines()[0]}", EXIT_REJECTED) from None
    for name in table.column_names:  # a double must be finite: nan and ±inf are refused, never NULL
        col = table.column(name)
        if pa.types.is_floating(col.type) and col.null_count < len(col) and not pc.all(pc.is_finite(col)).as_py():
            row = pc.index(pc.is_finite(col), False).as_py()
            refuse(row, name, f"{col[row].as_py()!r} is not a finite number (nan and inf are refused; "
                              "an empty field is NULL)")
    return schema.name, table


def _stream_schema(cfg, stream: str):
    """The schema of ``stream`` (also the reserved stream of security punctuations), or the one line
    refusing an unknown name."""
    from .punctuations import input_schema  # deferred: strata --help stays light (it imports users, config)

    schema = input_schema(cfg, stream)
    if schema is None:
        raise CliError(f"unknown stream {stream!r} (streams: {', '.join(cfg.streams)})", EXIT_REJECTED)
    return schema


def _input_specs(specs: list[str]):
    """(stream, file) of each ``--input STREAM=FILE``, in order; the first malformed one refused."""
    for spec in specs:
        if "=" not in spec:
            raise CliError(f"--input must be STREAM=FILE, got {spec!r}", EXIT_REJECTED)
        yield tuple(spec.split("=", 1))


def check_inputs(cfg, specs: list[str]) -> None:
    """The checks of :func:`parse_inputs` that need no reading, for a caller that reads later (the
    replay reads while its cluster starts): each spec is STREAM=FILE, the stream exists, the file opens."""
    for s, f in _input_specs(specs):
        _stream_schema(cfg, s)
        try:
            with open(f, "rb"):
                pass
        except OSError as e:
            raise CliError(f"{f}: {e.strerror or e}") from None


def parse_inputs(cfg, specs: list[str]):
    return [read_input(cfg, s, f) for s, f in _input_specs(specs)]


def batches_of(inputs, rows: int = 65536):
    """``(stream, table)`` slices of at most ``rows`` rows of each input, in order (no advances)."""
    for stream, table in inputs:
        for off in range(0, table.num_rows, rows):
            yield stream, table.slice(off, rows)


def drop_above(cfg, inputs, level: str) -> tuple[list, int]:
    """Labelled input without the rows whose level ``level`` (the session's) does not dominate, and
    how many were left out.

    The master's shepherd drops exactly these rows on arrival and tells only this producer how
    many (master/shepherd.py), so sending them costs the producer, the wire and the master their
    encoding and decoding for nothing: a quarter of a four-level CSV replayed at S.  Rows with no
    level or an unknown one stay, so the master refuses their batch with its usual one line; the
    shepherd still checks every row that is sent.  The producer knows its own data: leaving
    rows out here changes nothing another session can see."""
    import pyarrow as pa  # deferred: pyarrow (~80 ms) stays out of the CLI's start-up

    from .visibility import Visibility  # deferred: imports pyarrow

    visibility = Visibility(cfg.lattice, level)
    out, dropped = [], 0
    for stream, table in inputs:
        if "level" not in table.column_names or not table.num_rows:
            out.append((stream, table))
            continue
        col = table.column("level")
        if not (pa.types.is_string(col.type) or pa.types.is_large_string(col.type)):
            out.append((stream, table))
            continue
        kept, n = visibility.without_hidden(table)  # no level or an unknown one: kept, for the master
        dropped += n
        out.append((stream, kept))
    return out, dropped


def instant_batches(cfg, inputs, level: str | None, rows: int = 65536):
    """The input in instant order across streams, in batches of about ``rows`` tuples, each group of
    complete instants followed by an advance closing them: ``(stream, table, upto or None)``.

    So the master cuts chunks and the workers compute while the rest is still being sent.  An
    advance never goes beyond ``[limits] advance_horizon`` past the latest instant the master
    keeps (rows ``level`` dominates; ``None``: every row is the session's own level).  Input whose
    ``ts`` decreases is sent as it is, without advances (the master names the offending row)."""
    from .visibility import Visibility  # deferred: imports pyarrow

    inputs = [(s, t) for s, t in inputs if t.num_rows]
    if not inputs:
        return
    ts = {i: t.column("ts").to_numpy() for i, (_, t) in enumerate(inputs)}
    if any(len(x) > 1 and bool((np.diff(x) < 0).any()) for x in ts.values()):
        for stream, table in batches_of(inputs, rows):
            yield stream, table, None
        return
    horizon = cfg.limits.advance_horizon
    visibility = Visibility(cfg.lattice, level) if level is not None else None
    kept_max = {}  # per stream, per row: the largest ts of a kept row up to it (-1: none yet)
    for i, (_, t) in enumerate(inputs):
        if visibility is None or "level" not in t.column_names:
            kept_max[i] = ts[i]
            continue
        mask = visibility.visible_rows(t.column("level")).to_numpy(zero_copy_only=False)
        kept_max[i] = np.maximum.accumulate(np.where(mask, ts[i], -1))
    instants = np.unique(np.concatenate(list(ts.values())))
    starts = {i: np.searchsorted(x, instants, side="left") for i, x in ts.items()}
    ends = {i: np.searchsorted(x, instants, side="right") for i, x in ts.items()}
    sizes = sum(ends[i] - starts[i] for i in ts)
    advanced = None
    g = 0
    while g < len(instants):
        h, n = g, int(sizes[g])
        while h + 1 < len(instants) and n + int(sizes[h + 1]) <= rows:
            h += 1
            n += int(sizes[h])
        pieces = []
        for i, (stream, t) in enumerate(inputs):
            a, b = int(starts[i][g]), int(ends[i][h])
            for off in range(a, b, rows):
                pieces.append((stream, t.slice(off, min(rows, b - off))))
        upto = None
        if h + 1 < len(instants):  # the last group: the caller finishes the input
            top = max(int(kept_max[i][int(ends[i][h]) - 1]) if ends[i][h] > 0 else -1 for i in ts)
            upto = min(int(instants[h]), max(top, 0) + horizon)
            if advanced is not None and upto <= advanced:
                upto = None
        for k, (stream, piece) in enumerate(pieces):
            yield stream, piece, upto if k == len(pieces) - 1 else None
        if upto is not None:
            advanced = upto
        g = h + 1
