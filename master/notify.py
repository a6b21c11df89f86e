"""How a plain object tells whoever waits on it that something changed: threads or an event loop.

The master's core does not know who waits on it.  After every change a waiter may care about (a
chunk cut, a result released, a query stopped, a worker's heartbeat, a chunk requeued) it calls
:meth:`Changes.notify`, and every :class:`Notifier` attached to it wakes its own waiters:

* :class:`ThreadNotifier`: threads blocked on a ``threading.Condition``.  The core's is its lock
  too (``MasterCore.cond``), so a thread checks the core's state and waits in one step: the
  dispatch loop, a thread-per-stream subscriber (``MasterCore.wait_results``).
* :class:`AsyncNotifier`: coroutines on one asyncio event loop (the master's ``grpc.aio`` front,
  :mod:`strata.master.aio_server`).  ``notify`` may be called from any thread (with the core's
  lock held): it only schedules one wake-up on the loop, coalesced; each waiter then looks at its
  own predicate on the loop.

The asyncio front attaches its notifier (:meth:`Changes.attach`) to the core it serves; nothing
replaces the core's condition.  Plain logic with no I/O (tests/test_master_streams.py).
"""

from __future__ import annotations

import asyncio
import threading
from typing import Callable, Protocol

__all__ = ["Notifier", "Changes", "ThreadNotifier", "AsyncNotifier"]


class Notifier(Protocol):
    """Something that wakes its waiters when told that the object they wait on changed."""

    def notify(self) -> None: ...


class Changes:
    """The one "something changed" signal of an object: :meth:`notify` tells every attached
    :class:`Notifier`, in the order they were attached.  Attaching and detaching may happen while
    another thread notifies (the list is replaced, never changed in place)."""

    def __init__(self, *notifiers: Notifier):
        self._notifiers: tuple[Notifier, ...] = tuple(notifiers)

    def attach(self, notifier: Notifier) -> Notifier:
        self._notifiers = (*self._notifiers, notifier)
        return notifier

    def detach(self, notifier: Notifier) -> None:
        self._notifiers = tuple(n for n in self._notifiers if n is not notifier)

    def notify(self) -> None:
        for n in self._notifiers:
            n.notify()


class ThreadNotifier:
    """Threads waiting on ``cond`` (a ``threading.Condition``; by default one of its own).  With an
    object's lock as ``cond``, :meth:`notify` may be called with it held (it is re-entrant)."""

    def __init__(self, cond: threading.Condition | None = None):
        self.cond = cond if cond is not None else threading.Condition()

    def notify(self) -> None:
        with self.cond:
            self.cond.notify_all()

    def wait(self, timeout: float) -> bool:
        """Block until the next notification or ``timeout`` seconds; False on the timeout."""
        with self.cond:
            return self.cond.wait(timeout)


class AsyncNotifier:
    """Coroutines on ``loop`` waiting for a predicate of the object's state (:meth:`wait_for`).

    :meth:`notify` is called from any thread: it schedules one wake-up on the loop (coalesced:
    several notifications before it runs make one), and every waiter then checks its predicate on
    the loop without the object's lock."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._pending = False
        self._waiters: set[asyncio.Future] = set()

    def notify(self) -> None:
        if self._pending:
            return
        self._pending = True
        try:
            self.loop.call_soon_threadsafe(self._wake)
        except RuntimeError:  # the loop is closed (shutting down)
            pass

    def _wake(self) -> None:
        self._pending = False
        for f in self._waiters:
            if not f.done():
                f.set_result(None)

    async def wait_for(self, predicate: Callable[[], bool], timeout: float) -> bool:
        """Until ``predicate()`` (checked on every notification) or ``timeout`` s; its last value."""
        deadline = self.loop.time() + timeout
        while not predicate():
            left = deadline - self.loop.time()
            if left <= 0:
                return False
            f = self.loop.create_future()
            self._waiters.add(f)
            try:
                await asyncio.wait_for(f, left)
            except asyncio.TimeoutError:
                return bool(predicate())
            finally:
                self._waiters.discard(f)
        return True
