"""The edge of the master: a batch conformed to its stream's schema before anything else sees it.

An Arrow batch's buffers say little about what it decodes to.  A string column dictionary-encoded
as one 200-character value and a million int32 indices is 4 MB of buffers and 200 MB of strings
once cast to the stream's ``string``; run-end encoded columns, views into one shared buffer and
numbers cast to strings grow the same way.  Caps on buffers (``strata.arrowio.from_ipc``) or on a
table's ``nbytes`` therefore do not bound what the chunker's cast materializes.

:func:`conform` sizes every column as it will be once decoded and cast to the stream's Arrow type
(:func:`logical_nbytes`), from the encodings' small parts only (dictionary value lengths, run
lengths, view lengths, a per-value bound for numbers cast to strings), and refuses a batch over the
cap before anything is materialized.  Types no stream declares (nested, unions, extension types,
binary, an encoding inside an encoding) are refused with one line naming the column and the rule.
Only then are the encodings (dictionary, run-end encoded, string_view, binary_view, large_string,
large_binary) decoded and cast, so that the shepherd, the limits, the event log and the chunker see
plain columns only.  A column already of its plain type costs one ``nbytes`` (no per-row work).

Pure and role-free: no master, worker or deploy import.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.types as pt

from strata.arrowio import ARROW_TYPES
from strata.config import OP_COLUMN, SYSTEM_COLUMNS

__all__ = ["EdgeError", "conform", "logical_nbytes", "natural_type", "stream_targets"]


class EdgeError(ValueError):
    """A batch refused at the edge; ``reason`` is the counter it is counted under
    (``bad_type``: a type the stream does not accept, ``oversized``: over the decoded-size cap)."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


#: the most characters the cast of one value of a type to a string gives (``-9223372036854775808``,
#: ``-2.2250738585072014e-308``, ``false``); temporal values: a generous bound (dates, zones)
_TEXT_WIDTH = {
    pa.int8(): 4, pa.int16(): 6, pa.int32(): 11, pa.int64(): 20,
    pa.uint8(): 3, pa.uint16(): 5, pa.uint32(): 10, pa.uint64(): 20,
    pa.float16(): 16, pa.float32(): 16, pa.float64(): 24, pa.bool_(): 5, pa.null(): 0,
}
_TEMPORAL_TEXT_WIDTH = 48

#: how declared types are named in messages (the MLS-CQL names)
_DECLARED = {pa.string(): "string", pa.int64(): "long", pa.float64(): "double", pa.bool_(): "boolean"}


def stream_targets(schema) -> dict[str, pa.DataType]:
    """The Arrow type of each column a batch of ``schema`` (a ``StreamSchema``) carries, by lower-cased
    name: ``ts``, ``level``, the declared attributes, and a stored relation's ``op``."""
    out = {c: ARROW_TYPES[t] for c, t in SYSTEM_COLUMNS.items()}
    out.update((c.lower(), ARROW_TYPES[t]) for c, t in schema.columns)
    if getattr(schema, "relation", False):
        out[OP_COLUMN] = pa.string()
    return out


# ---- types -------------------------------------------------------------------------------------
def _is_text(t: pa.DataType) -> bool:
    return pt.is_string(t) or pt.is_large_string(t) or pt.is_string_view(t)


def _is_binary(t: pa.DataType) -> bool:
    return pt.is_binary(t) or pt.is_large_binary(t) or pt.is_binary_view(t) or pt.is_fixed_size_binary(t)


def _is_encoded(t: pa.DataType) -> bool:
    """An encoding of a plain type: decoded at the edge (after its logical size passed the cap)."""
    return (pt.is_dictionary(t) or pt.is_run_end_encoded(t) or pt.is_string_view(t) or pt.is_binary_view(t)
            or pt.is_large_string(t) or pt.is_large_binary(t))


def natural_type(t: pa.DataType) -> pa.DataType:
    """The plain type an encoded type decodes to (a column the stream does not declare is decoded to
    it, then refused by the chunker as an unexpected column); a plain type is its own."""
    if pt.is_dictionary(t) or pt.is_run_end_encoded(t):
        return natural_type(t.value_type)
    if pt.is_string_view(t) or pt.is_large_string(t):
        return pa.string()
    if pt.is_binary_view(t) or pt.is_large_binary(t):
        return pa.binary()
    return t


def _rule(t: pa.DataType, target: pa.DataType | None) -> str | None:
    """Why a column of type ``t`` is refused for a column declared ``target`` (None: the stream
    does not declare it), or None if it is accepted."""
    if isinstance(t, pa.BaseExtensionType):
        return "extension types are refused"
    if pt.is_dictionary(t) or pt.is_run_end_encoded(t):
        v = t.value_type
        if isinstance(v, pa.BaseExtensionType):
            return "extension types are refused"
        if pt.is_dictionary(v) or pt.is_run_end_encoded(v) or pt.is_string_view(v) or pt.is_binary_view(v):
            return "an encoding inside an encoding is refused"
        if pt.is_nested(v):
            return "nested types are refused"
        t = v
    elif pt.is_nested(t):
        return "nested types are refused"
    if target is not None and _is_binary(t) and not _is_binary(target):
        return "binary is not a string" if _is_text(target) else "binary types are refused"
    return None


def _declared(target: pa.DataType | None, name: str, kind: str) -> str:
    if target is None:
        return f"the {kind} declares no column {name}"
    return f"the {kind} declares {_DECLARED.get(target, str(target))}"


# ---- sizes ---------------------------------------------------------------------------------------
def _layout(target: pa.DataType, n: int, data: int, nulls: int) -> int:
    """Bytes of an ``n``-value array of ``target`` holding ``data`` bytes of variable-width values
    and ``nulls`` nulls, counted as ``Array.nbytes`` counts a freshly built one (one offset per
    value, a validity bitmap only when there are nulls)."""
    validity = (n + 7) // 8 if nulls else 0
    if pt.is_null(target):
        return 0
    if pt.is_string(target) or pt.is_binary(target):
        return data + 4 * n + validity
    if pt.is_large_string(target) or pt.is_large_binary(target):
        return data + 8 * n + validity
    try:
        return (target.bit_width * n + 7) // 8 + validity
    except ValueError:  # not fixed-width (never a declared type): a generous 16 bytes a value
        return 16 * n + validity


def _text_width(t: pa.DataType) -> int:
    """Most bytes one value of plain, non-text type ``t`` takes once cast to a string."""
    if t in _TEXT_WIDTH:
        return _TEXT_WIDTH[t]
    if pt.is_decimal(t):
        return max(t.precision, abs(t.scale)) + 8
    return _TEMPORAL_TEXT_WIDTH


def _var_width(target: pa.DataType) -> bool:
    return _is_text(target) or _is_binary(target) and not pt.is_fixed_size_binary(target)


def _value_lengths(values: pa.Array, target: pa.DataType):
    """Per value of a plain array, the bytes it takes in variable-width ``target``: an integer array
    (null for a null value) for strings and binaries, else a constant bound."""
    if pt.is_fixed_size_binary(values.type):
        return values.type.byte_width
    if _is_text(values.type) or _is_binary(values.type):
        return pc.binary_length(values)
    return _text_width(values.type)


def _plain_data(arr: pa.Array, target: pa.DataType) -> int:
    """Variable-width bytes of plain array ``arr`` once cast to ``target``."""
    t, n = arr.type, len(arr)
    if not n:
        return 0
    if pt.is_string(t) or pt.is_binary(t) or pt.is_large_string(t) or pt.is_large_binary(t):
        large = pt.is_large_string(t) or pt.is_large_binary(t)
        offsets = np.frombuffer(arr.buffers()[1], dtype=np.int64 if large else np.int32)
        return int(offsets[arr.offset + n]) - int(offsets[arr.offset])
    if pt.is_string_view(t) or pt.is_binary_view(t):
        lens = np.frombuffer(arr.buffers()[1], dtype=np.int32)[4 * arr.offset: 4 * (arr.offset + n): 4]
        if arr.null_count:  # a null view's length is undefined
            lens = lens[np.asarray(arr.is_valid())]
        return int(lens.sum(dtype=np.int64))
    if pt.is_fixed_size_binary(t):
        return t.byte_width * n
    return _text_width(t) * (n - arr.null_count)


def _dictionary_nbytes(arr: pa.DictionaryArray, target: pa.DataType) -> int:
    """The decoded size of one dictionary chunk: its indices select value lengths (respecting the
    chunk's slice and null indices)."""
    values, indices = arr.dictionary, arr.indices
    n = len(arr)
    nulls = indices.null_count
    if values.null_count and n:  # indices that select a null value
        nulls += int(pc.sum(pc.take(pc.cast(values.is_null(), pa.int8()), indices)).as_py() or 0)
    data = 0
    if _var_width(target) and n:
        lens = _value_lengths(values, target)
        if isinstance(lens, int):
            data = lens * (n - nulls)
        else:  # one length per row, at the width of the lengths (4 bytes for strings), summed
            data = int(pc.sum(pc.take(lens, indices)).as_py() or 0)
    return _layout(target, n, data, nulls)


def _runs(arr: pa.RunEndEncodedArray) -> tuple[np.ndarray, pa.Array]:
    """(length of each run within the array's slice, the values of those runs)."""
    n = len(arr)
    if not n:
        return np.zeros(0, np.int64), arr.values.slice(0, 0)
    pos, count = arr.find_physical_offset(), arr.find_physical_length()
    ends = np.asarray(arr.run_ends.slice(pos, count), dtype=np.int64) - arr.offset
    ends = np.minimum(ends, n)
    return np.diff(ends, prepend=0), arr.values.slice(pos, count)


def _ree_nbytes(arr: pa.RunEndEncodedArray, target: pa.DataType) -> int:
    """The decoded size of one run-end encoded chunk: run lengths times value lengths."""
    runs, values = _runs(arr)
    nulls = int(runs[np.asarray(values.is_null())].sum()) if values.null_count else 0
    data = 0
    if _var_width(target):
        lens = _value_lengths(values, target)
        if isinstance(lens, int):
            data = lens * (len(arr) - nulls)
        else:
            data = int(np.dot(runs, np.asarray(pc.fill_null(lens, 0), dtype=np.int64)))
    return _layout(target, len(arr), data, nulls)


def _chunk_nbytes(arr: pa.Array, target: pa.DataType) -> int:
    t = arr.type
    if t == target:
        return arr.nbytes
    if pt.is_dictionary(t):
        return _dictionary_nbytes(arr, target)
    if pt.is_run_end_encoded(t):
        return _ree_nbytes(arr, target)
    n = len(arr)
    return _layout(target, n, _plain_data(arr, target) if _var_width(target) else 0, arr.null_count)


def logical_nbytes(column: pa.ChunkedArray | pa.Array, target: pa.DataType | None = None) -> int:
    """Bytes ``column`` will take once decoded and cast to ``target`` (default: its own plain type,
    :func:`natural_type`), computed without materializing it: per chunk (each IPC batch may have its
    own dictionary), respecting slices and nulls.  Exactly ``nbytes`` for a column already of type
    ``target``; for an encoded one, ``nbytes`` of the freshly decoded column.  Raises
    :class:`EdgeError` (``bad_type``) for a type :func:`conform` refuses."""
    target = natural_type(column.type) if target is None else target
    rule = _rule(column.type, target)
    if rule is not None:
        raise EdgeError(f"type {column.type} is not accepted ({rule})", "bad_type")
    if column.type == target:  # the plain fast path: no per-row work
        return column.nbytes
    chunks = column.chunks if isinstance(column, pa.ChunkedArray) else [column]
    return sum(_chunk_nbytes(c, target) for c in chunks)


# ---- decoding ----------------------------------------------------------------------------------
def _decode(arr: pa.Array, target: pa.DataType) -> pa.Array:
    """One encoded chunk as a plain array of ``target``.  Nothing much larger than the result is
    built on the way: the dictionary or the runs are cast first, then expanded, except numbers to a
    string (a number's text is longer than the number: expanded as numbers, then cast)."""
    t = arr.type
    if not (pt.is_dictionary(t) or pt.is_run_end_encoded(t)):
        return arr.cast(target, safe=True)
    if pt.is_dictionary(t):
        values, expand = arr.dictionary, (lambda v: pc.take(v, arr.indices))
    else:
        runs, values = _runs(arr)
        ends = pa.array(np.cumsum(runs), t.run_end_type)
        expand = (lambda v: pc.run_end_decode(pa.RunEndEncodedArray.from_arrays(ends, v)) if len(arr)
                  else pa.array([], v.type))
    if values.type == target:
        return expand(values)
    if _var_width(target) and not (_is_text(values.type) or _is_binary(values.type)):
        return expand(values).cast(target, safe=True)
    return expand(values.cast(target, safe=True))


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= 200 else text[:197] + "..."


def _bytes(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} bytes"


def conform(table: pa.Table, targets: dict[str, pa.DataType], max_bytes: int | None, what: str) -> pa.Table:
    """``table`` with its encoded columns decoded and cast to their declared type (``targets``, by
    lower-cased column name), or :class:`EdgeError` with one line, nothing decoded.

    Refused (``bad_type``): nested and union types, extension types, binary, an encoding inside an
    encoding, for every column (a column not in ``targets`` is otherwise left to the chunker, which
    refuses it as unexpected).  Refused (``oversized``): a batch whose columns decode to more than
    ``max_bytes`` (None: no cap), each counted at its :func:`logical_nbytes` for the type it will be
    cast to.  ``what``: the stream as messages name it (``stream Vitals``)."""
    kind = what.split(" ", 1)[0] if " " in what else "stream"
    plan = []  # (index, name, column, target, bytes)
    total = 0
    for i, (name, col) in enumerate(zip(table.column_names, table.columns)):
        declared = targets.get(name.lower())
        rule = _rule(col.type, declared)
        if rule is not None:
            raise EdgeError(f"{what}: column {name}: type {col.type} is not accepted "
                            f"({rule}; {_declared(declared, name, kind)})", "bad_type")
        target = declared if declared is not None else natural_type(col.type)
        size = col.nbytes if col.type == target else sum(_chunk_nbytes(c, target) for c in col.chunks)
        total += size
        plan.append((i, name, col, target, size))
    if max_bytes is not None and total > max_bytes:
        _, name, col, _, size = max(plan, key=lambda p: p[4])
        raise EdgeError(f"{what}: batch too large: its columns decode to {total} bytes, more than "
                        f"{_bytes(max_bytes)} (column {name}: {size} bytes from {col.type}); split it", "oversized")
    for i, name, col, target, _ in plan:
        if not _is_encoded(col.type):
            continue  # plain: the chunker casts it (and names a value it cannot read)
        try:
            plain = pa.chunked_array([_decode(c, target) for c in col.chunks], type=target)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as e:
            raise EdgeError(f"{what}: column {name} of type {col.type} cannot be read as "
                            f"{_DECLARED.get(target, str(target))}: {_one_line(e)}", "bad_type") from None
        table = table.set_column(i, table.schema.field(i).with_type(target), plain)
    return table
