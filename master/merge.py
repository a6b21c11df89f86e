"""Merge chunk results back into instant order, exactly once.

Chunks are registered in dispatch order (increasing chunk id = increasing
instants).  Results may come back in any order, more than once (a slow worker
whose chunk was re-dispatched), or for chunks no longer expected; the merger
releases each registered chunk's result once, strictly in order.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, TypeVar

__all__ = ["OrderedMerger"]

T = TypeVar("T")


class OrderedMerger(Generic[T]):
    def __init__(self) -> None:
        self._pending: OrderedDict[int, T | None] = OrderedDict()
        self._released_upto = -1  # highest released chunk id
        self.duplicates = 0

    def expect(self, chunk_id: int) -> None:
        if chunk_id <= self._released_upto or chunk_id in self._pending:
            raise ValueError(f"chunk {chunk_id} registered twice or after release")
        if self._pending and chunk_id < next(reversed(self._pending)):
            raise ValueError(f"chunk {chunk_id} registered out of order")
        self._pending[chunk_id] = None

    def resume_after(self, chunk_id: int) -> None:
        """Start (empty) as if every chunk up to ``chunk_id`` had been released (a checkpoint)."""
        if self._pending:
            raise ValueError("resume_after on a merger that expects chunks")
        self._released_upto = int(chunk_id)

    def add(self, chunk_id: int, result: T) -> list[tuple[int, T]]:
        """Record a result; return the results now releasable, in order."""
        if chunk_id not in self._pending or self._pending[chunk_id] is not None:
            self.duplicates += 1
            return []
        self._pending[chunk_id] = result
        out = []
        while self._pending:
            cid, res = next(iter(self._pending.items()))
            if res is None:
                break
            self._pending.popitem(last=False)
            self._released_upto = cid
            out.append((cid, res))
        return out

    def has_result(self, chunk_id: int) -> bool:
        """A result for ``chunk_id`` is recorded (released or waiting for an earlier chunk)."""
        return chunk_id <= self._released_upto and chunk_id not in self._pending or \
            self._pending.get(chunk_id) is not None

    @property
    def waiting(self) -> int:
        return len(self._pending)

    @property
    def released_upto(self) -> int:
        return self._released_upto
