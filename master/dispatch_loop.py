"""The dispatch loop: the thread that moves chunks to workers and their results back to the core.

I/O only, over the core's decisions (:class:`~strata.master.core.MasterCore`): each step feeds
Algorithm 5 the group's heartbeats (workers whose address is proven,
:class:`~strata.groups.membership.AddressProver`), takes back overdue units (:meth:`MasterCore.expire`),
and sends the units :meth:`MasterCore.assignments` chose, each as one ``Execute`` call: ROWS pruning
and column projection (:func:`~strata.chunking.prune.prune_chunk`), the codec, and the level's group
signature over :func:`strata.groups.execute_digest` (with this master's epoch when it has standbys).
A reply goes to :meth:`MasterCore.on_result`, a failure to :meth:`MasterCore.on_failure`; a worker
that refuses this master's epoch (a newer master drives the workers) calls ``on_fenced``.  With
nothing to send the loop waits for the core's next change (:meth:`MasterCore.wait_change`), at most
50 ms.

In a trusted master whose levels take turns (``turn``: the level's turn of :class:`strata.turns.Turns`)
each step runs in the level's turn, and the workers' replies wait in a queue for the next step instead
of being merged on gRPC's callback thread: all of a level's dispatch work (cutting, encoding, merging
results) happens in its own slots, whatever another level's load.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

import grpc

from strata.chunking.codec import decode_result, encode_chunk
from strata.chunking.prune import prune_chunk
from strata.errors import one_line
from strata.groups import AUTH_HEADER, execute_digest, execute_wire, sign_request
from strata.groups.membership import AddressProver, info_probe
from strata.logs import RepeatLimiter
from strata.rpc import strata_pb2 as pb
from strata.serving import MAX_MESSAGE
from strata.tls import secure_channel

from .core import MasterCore

__all__ = ["DispatchLoop"]

log = logging.getLogger("strata.master")
#: warnings of the loop (a failed step, a chunk that failed, a bad reply): once a minute each, with a count
limited = RepeatLimiter(log)


class DispatchLoop:
    """Sends ready chunks to workers (async gRPC) and feeds results back to the core."""

    def __init__(self, core: MasterCore, key: bytes, member, rpc_deadline: float = 30.0, tls_dir=None,
                 epoch: int = 0, on_fenced=None, turn=None):
        """``epoch``: this master's epoch (a master with standbys; 0: none), signed into every Execute;
        ``on_fenced(detail)``: a worker refused it for a newer master's epoch (the master steps down);
        ``turn(kind)``: a context manager the level's work waits in (a trusted master's turns; None: none)."""
        self.core = core
        self.key = key
        self.member = member
        self.rpc_deadline = rpc_deadline
        self.tls_dir = tls_dir
        self.epoch = int(epoch)
        self.on_fenced = on_fenced
        self.turn = turn
        self._replies: deque = deque()  # with turns: replies waiting for the level's next step
        self._dirty = threading.Event()  # with turns: the core changed since the last step began
        if turn is not None:
            core.changes.attach(self)
        self._executes: dict[str, object] = {}  # worker -> its Execute (serialized requests)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dispatch", daemon=True)

    def start(self):
        self._thread.start()
        return self

    def stop(self):
        self._stop.set()
        if self.turn is not None:
            self.core.changes.detach(self)
        self.core.changes.notify()  # wakes the loop if it waits for a change
        self._thread.join(timeout=5)

    def _execute(self, sid: str):
        """The worker's Execute taking an already serialized request (:func:`execute_wire`): a unit's
        tens of MB are copied once, not into a message, its serialization and out for the digest."""
        if sid not in self._executes:
            opts = [("grpc.max_receive_message_length", MAX_MESSAGE), ("grpc.max_send_message_length", MAX_MESSAGE)]
            if self.tls_dir is not None:  # the worker must prove it is a worker of this level
                ch = secure_channel(sid, self.tls_dir, "master", self.core.level, "worker", opts)
            else:
                ch = grpc.insecure_channel(sid, opts)
            self._executes[sid] = ch.unary_unary("/strata.rpc.Worker/Execute",
                                                 response_deserializer=pb.ExecuteReply.FromString)
        return self._executes[sid]

    def _sync_group(self) -> None:
        """Feed Algorithm 5 the heartbeats of the workers listed by the group member.

        The master's member lists an address only for the identity key that an Info call
        at that address returned (strata/groups/membership.py): the probes run in the background
        (:class:`~strata.groups.membership.AddressProver`), so this never blocks, and a worker
        gets no chunk before its address is proven.  A heartbeat the dispatcher refuses
        is skipped; the loop goes on."""
        prover = self.__dict__.get("_prover")
        if prover is None and hasattr(self.member, "claimed"):
            def channel(sid: str):  # one short-lived channel per probe, as this level's master
                if self.tls_dir is not None:
                    return secure_channel(sid, self.tls_dir, "master", self.core.level, "worker", [])
                return grpc.insecure_channel(sid)

            prover = self._prover = AddressProver(self.member, info_probe(channel, self.key, self.core.level))
        if prover is not None:
            prover.step()
        for sid, hb in self.member.snapshot().items():
            try:
                self.core.heartbeat(sid, hb.cpu, hb.state, hb.pid, slots=hb.slots, seq=hb.seq)
            except (TypeError, ValueError) as e:
                limited.warning("heartbeat", "heartbeat of %s not used: %s", sid, one_line(e))

    #: with turns: an idle loop still steps this often (heartbeats into Algorithm 5, overdue units)
    IDLE_STEP_SECONDS = 1.0

    def notify(self) -> None:
        """The core changed (with turns: attached to ``core.changes``).  A change the loop's own step makes
        (heartbeats fed in, replies merged, units assigned) is not news to it: only another thread's is."""
        if threading.current_thread() is not self._thread:
            self._dirty.set()

    def _run(self) -> None:
        last = 0.0
        while not self._stop.is_set():
            try:
                if self.turn is None:
                    sent = self._step()
                elif self._dirty.is_set() or self._replies or self.core.has_ready() or \
                        time.monotonic() - last >= self.IDLE_STEP_SECONDS:
                    # with turns, only a step with something to do waits for the level's slot: news from another
                    # thread, replies, or units waiting to be sent (a worker's free slot, a linger's end: no
                    # notification says when); a loop waiting there all the time would read as work to a
                    # round-robin plan
                    self._dirty.clear()
                    with self.turn("dispatch"):
                        sent = self._step()
                    last = time.monotonic()
                else:
                    sent = []
            except Exception:  # noqa: BLE001 - the dispatch thread never dies: log, wait a little, go on
                limited.exception("dispatch", "dispatch step failed; continuing")
                sent = []
            if sent:
                continue
            if self.turn is None:
                self.core.wait_change(0.05)
            else:
                self._dirty.wait(0.05)

    def _step(self) -> list:
        while self._replies:  # (with turns) the replies that came in since the last step
            self._reply(*self._replies.popleft())
        self._sync_group()
        self.core.expire()
        sent = self.core.assignments()
        for chunk, sid in sent:
            try:
                self._send(chunk, sid)
            except Exception as e:  # noqa: BLE001 - e.g. encoding failed: one failed attempt of this chunk
                limited.exception("send", "chunk %s could not be sent to %s", chunk.chunk_id, sid)
                self.core.on_failure(chunk.chunk_id, sid, reason=f"not sent: {e}", kind="SEND")
        return sent

    def _wire(self, chunk):
        """What travels: the chunk without new tuples no ROWS window can hold (chunking/prune.py).

        The full chunk stays in the core for re-dispatch; any failure sends it unpruned."""
        try:
            return prune_chunk(chunk, dict(getattr(self.core.pipeline, "queries", {}) or {}))
        except Exception as e:  # noqa: BLE001 - pruning is an optimization only
            limited.warning("prune", "chunk %s sent unpruned: %s", chunk.chunk_id, e)
            return chunk

    def _send(self, chunk, sid: str) -> None:
        specs = [pb.QuerySpec(query_id=qc.query_id, text=self.core.queries[qc.query_id].text, level=self.core.level)
                 for qc in chunk.queries if qc.query_id in self.core.queries]
        head = pb.ExecuteRequest(level=self.core.level, queries=specs, epoch=self.epoch)
        body = encode_chunk(self._wire(chunk))
        md = ((AUTH_HEADER, sign_request(self.key, self.core.level, execute_digest(head, body))),)
        # a merged unit computes several chunks: it gets more time before it counts as failed
        timeout = self.rpc_deadline * self.core.deadline_factor(chunk.chunk_id)
        fut = self._execute(sid).future(execute_wire(head, body), timeout=timeout, metadata=md)
        cid = chunk.chunk_id
        span = (chunk.first_ts, chunk.last_ts)  # which cut chunks this unit covers, whatever happens meanwhile

        def done(f):
            if self.turn is None:
                self._reply(f, cid, sid, span)
            else:  # merged in the level's turn, by the loop
                self._replies.append((f, cid, sid, span))
                self.core.changes.notify()

        fut.add_done_callback(done)

    def _reply(self, f, cid: str, sid: str, span) -> None:
        """A finished Execute of unit ``cid`` on ``sid``: its results to the core, or a failure."""
        try:
            try:
                reply = f.result()
            except grpc.RpcError as e:
                code = e.code()
                if code == grpc.StatusCode.FAILED_PRECONDITION and self.on_fenced is not None and \
                        (e.details() or "").startswith("fenced"):
                    self.on_fenced(f"worker {sid}: {e.details()}")  # a newer master drives the workers
                    return
                limited.warning("chunk-failed", "chunk %s on %s failed: %s %s", cid, sid, code, e.details())
                # a lost worker is dropped (its chunks go elsewhere, not counted against them);
                # an error reply or an overrun deadline is one failed attempt of the chunk
                self.core.on_failure(cid, sid, drop_worker=code in (grpc.StatusCode.UNAVAILABLE,),
                                     reason=str(e.details() or ""), kind=getattr(code, "name", str(code)))
                return
            try:
                results = [decode_result(b) for b in reply.results]
                self.core.on_result(cid, sid, results, span=span)
            except Exception as e:  # noqa: BLE001 - an undecodable or inconsistent reply
                limited.warning("bad-reply", "chunk %s on %s: bad reply: %s", cid, sid, e)
                self.core.on_failure(cid, sid, reason=f"bad reply: {e}", kind="BAD_REPLY")
        except Exception:  # noqa: BLE001 - never lose a callback silently
            limited.exception("result", "chunk %s on %s: result handling failed", cid, sid)
