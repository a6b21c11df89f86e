"""Standby masters: a second master of a level follows the active one's event log and takes over
when it dies (docs/operations.md, *Standby masters*).

A master started with peers (``strata master --peers HOST:PORT,...``: the level's other masters) is
a :class:`Node`.  Before it serves it asks its peers what they are (``Probe``, :func:`start_decision`):

* a peer is **active**: this master becomes its **standby**.  It opens ``Follow`` (master-to-master,
  over the level's mutual TLS with a master certificate of the level on both ends, signed with the
  level's group key) and receives a copy of the active's state file (SQLite's online backup,
  :meth:`MasterStore.snapshot_to`), which replaces its own (a returning old master's log tail after
  the point where it diverged is dropped with it), then every write of the active's store as it is
  committed (:class:`~strata.master.log_shipping.LogShipper`, master/log_shipping.py: events under
  the same seq numbers, producers' marks, sessions, checkpoints), each confirmed once stored
  (``synchronous=FULL``).  A standby refuses every client
  call with FAILED_PRECONDITION and one line naming the active (:func:`standby_refusal`), serves no
  client and dispatches nothing.
* no peer answers (or only masters starting too, and this one has the newest log): it becomes
  **active** at a new **epoch** (one more than any it knows, persisted in its state file).

The active acknowledges a write (an ingest batch, a registration, an advance, a session, ...) only
once every standby in sync confirmed it (``LogShipper.wait``, synchronous replication); a
standby that does not confirm within ``ack_seconds`` (2 s) is detached (counted, logged) and the
active goes on alone; the standby attaches again, with a new copy.

Takeover (:func:`takeover_decision`): when its Follow stream breaks (or carries nothing, not even
the active's pings every 0.5 s, for 3 s) a standby asks its peers every 0.2 s; if the active does not
answer as active for ``takeover_seconds`` (2 s) and the standby holds a whole copy, it restores
from its state file as a restarted master does (:meth:`MasterCore.restore`), bumps the epoch, starts
its dispatch loop and serves clients.

Fencing: the epoch is signed into every Execute (:func:`strata.groups.execute_digest`); a worker
refuses an epoch below the highest it has seen (worker/service.py ``fence``), and a master refused so
stops (:class:`Fenced`): restarted, it finds the active one and follows it.

This module holds the decisions (plain logic: :func:`start_decision`, :func:`takeover_decision`,
:func:`next_epoch`), the :class:`Node` that acts on them (its calls to peers, the Follow stream it
reads), and :func:`serve_replicated`; the active side's shipping is in master/log_shipping.py
(tests/test_standby.py).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import queue
import signal
import threading
import time
import uuid
from dataclasses import dataclass

import grpc

from strata.errors import one_line
from strata.groups import AUTH_HEADER, sign_request, verify_request
from strata.logs import RepeatLimiter
from strata.rpc import strata_pb2 as pb
from strata.rpc import strata_pb2_grpc as rpc
from strata.serving import MAX_MESSAGE, run_until_stopped
from strata.tls import PeerCheck, secure_channel

from .aio_server import MasterServer
from .log_shipping import DEFAULT_ACK_SECONDS, LogShipper
from .loops import MasterLoops, build_core
from .server import MasterServicer, client_tls, warm_up
from .store import MasterStore, StateMismatch, config_fingerprint

__all__ = ["PeerView", "start_decision", "takeover_decision", "next_epoch", "standby_refusal", "is_standby_refusal",
           "peer_digest", "Node", "Fenced", "serve_replicated", "DEFAULT_TAKEOVER_SECONDS"]

log = logging.getLogger("strata.master")
limited = RepeatLimiter(log)  # what may repeat every second (a follow that fails again): once a minute

#: seconds without an answer from the active after which a standby in sync takes over
DEFAULT_TAKEOVER_SECONDS = 2.0
STALL_SECONDS = 3.0  # a Follow stream that carries nothing this long counts as broken
FIRST_RECORD_SECONDS = 60.0  # ... before its first record (the active copies its state file meanwhile)
PROBE_SECONDS = 1.0  # a Probe's deadline
SETTLE_SECONDS = 1.0  # masters starting together look again this long before the newest log goes active
LOOK_SECONDS = 0.2  # how often a master without an active one asks its peers


class Fenced(RuntimeError):
    """A worker refused this master's Execute for a newer epoch: another master of the level is
    active.  The master stops; restarted, it follows the active one."""


def standby_refusal(level: str, active: str) -> str:
    """The one line a standby answers client calls with (clients move on to the next master)."""
    return f"this master of level {level} is a standby; the active one is {active or 'unknown'}"


def is_standby_refusal(details: str) -> bool:
    return " is a standby; the active one is " in (details or "")


def peer_digest(kind: str, payload: bytes) -> bytes:
    """What a master-to-master call's group signature covers (``kind``: probe, follow)."""
    return hashlib.sha256(b"strata-master|" + kind.encode() + b"|" + payload).digest()


# ---- decisions (plain logic) ------------------------------------------------------------------------
@dataclass(frozen=True)
class PeerView:
    """What a master says about itself (a Probe's reply, or this master's own view)."""

    role: str  # active, standby, starting
    epoch: int = 0
    last_seq: int = 0
    address: str = ""
    synced: bool = False  # a standby holding a whole copy of an active's log (it may take over)
    owner: str = ""  # the master that began its epoch
    active: str = ""  # a standby: whom it follows
    node: str = ""  # a random id of the master's process

    @property
    def rank(self) -> tuple:
        """The order in which masters without an active one go active: the newest history first."""
        return self.epoch, self.last_seq, self.address, self.node


def _best_active(answers: dict) -> str | None:
    actives = [(v.epoch, v.owner, addr) for addr, v in answers.items() if v is not None and v.role == "active"]
    return max(actives)[2] if actives else None


def start_decision(me: PeerView, answers: dict, waited: float, settle: float = SETTLE_SECONDS) -> tuple[str, str | None]:
    """What a starting master does, given its peers' answers (address -> :class:`PeerView`, None: no
    answer) after ``waited`` seconds of asking: ``("follow", address)`` (an active one answered: the
    one of the highest epoch), ``("active", None)`` or ``("wait", None)`` (ask again).

    A standby that may take over is let to (it holds the newest copy: this master follows it once it
    is active); a standby that may not (it never completed a copy) does not count.  Masters starting
    together wait ``settle`` seconds, then the one with the newest history (epoch, last event,
    address) goes active; if nobody answers this master goes active."""
    best = _best_active(answers)
    if best is not None:
        return "follow", best
    views = [v for v in answers.values() if v is not None]
    if any(v.role == "standby" and v.synced for v in views):
        return "wait", None
    starting = [v for v in views if v.role == "starting"]
    if starting:
        if waited < settle or any(v.rank >= me.rank for v in starting):
            return "wait", None
    return "active", None


def takeover_decision(me: PeerView, answers: dict, silent: float, takeover_seconds: float) -> tuple[str, str | None]:
    """What a standby whose Follow stream broke does: ``("follow", address)`` (an active one answers),
    ``("takeover", None)`` (it holds a whole copy, the active has not answered for ``silent`` >=
    ``takeover_seconds`` and no other standby in sync has a newer history) or ``("wait", None)``."""
    best = _best_active(answers)
    if best is not None:
        return "follow", best
    if not me.synced:
        return "wait", None
    rivals = [v for v in answers.values() if v is not None and v.role == "standby" and v.synced]
    if any(v.rank > me.rank for v in rivals):
        return "wait", None
    return ("takeover", None) if silent >= takeover_seconds else ("wait", None)


def next_epoch(own: int, answers: dict) -> int:
    """The epoch of a master becoming active: one more than any it knows (its own, its peers')."""
    return max([int(own)] + [int(v.epoch) for v in answers.values() if v is not None]) + 1


# ---- a master with peers ------------------------------------------------------------------------------
class Node:
    """One master of a level with peers: its role (starting, standby, activating, active), the
    answers to master-to-master calls (:meth:`probe`, :meth:`follow`), the gate of client calls
    (:meth:`gate`), and the thread that decides, follows and takes over (:meth:`start`)."""

    def __init__(self, level: str, store: MasterStore, peers: list[str], key: bytes, tls_dir=None,
                 takeover_seconds: float = DEFAULT_TAKEOVER_SECONDS, ack_seconds: float = DEFAULT_ACK_SECONDS,
                 stop: threading.Event | None = None):
        self.level = level
        self.store = store
        self.peers = [p for p in dict.fromkeys(p.strip() for p in peers) if p]
        self.key = key
        self.tls_dir = tls_dir
        self.takeover_seconds = float(takeover_seconds)
        self.ack_seconds = float(ack_seconds)
        self.address = ""
        self.role = "starting"
        self.active = ""  # a standby: the master it follows
        self.synced = False  # holds a whole copy of an active's log
        self.shipper: LogShipper | None = None
        self.refused: dict = {}  # refused master-to-master calls (reason -> n)
        self.client_refused: dict = {}  # refused client certificates (the core's ``refused`` once active)
        self.peer_check = PeerCheck(level, ("master",), refused=self.refused) if tls_dir is not None else None
        self.ready = threading.Event()  # a standby with a copy, or active
        self.stop = stop or threading.Event()
        self.failure: BaseException | None = None
        self.last_heard = time.monotonic()  # the active was last heard from (a record, a probe)
        self.takeover: dict = {}  # how the takeover went (status, logs)
        self.node = uuid.uuid4().hex[:16]  # tells this process from another master with the same address
        self._channels: dict[str, grpc.Channel] = {}
        self._call = None
        self._thread: threading.Thread | None = None

    # -- answers ----------------------------------------------------------------------------------------
    def gate(self):
        """(code, one line) refusing a client call while this master is not active; None when it is."""
        role = self.role
        if role == "active":
            return None
        if role == "standby":
            return grpc.StatusCode.FAILED_PRECONDITION, standby_refusal(self.level, self.active)
        doing = "taking over" if role == "activating" else "starting"
        return grpc.StatusCode.UNAVAILABLE, f"this master of level {self.level} is {doing}; try again"

    def verify(self, kind: str, payload: bytes, header: str | None) -> bool:
        return verify_request(self.key, self.level, peer_digest(kind, payload), header)

    def view(self) -> PeerView:
        epoch, owner = self.store.epoch()
        role = {"active": "active", "activating": "active", "standby": "standby"}.get(self.role, "starting")
        return PeerView(role, epoch, self.store.last_seq(), self.address, self.synced, owner,
                        self.active if role == "standby" else "", self.node)

    def probe(self, request) -> pb.ProbeReply:
        v = self.view()
        return pb.ProbeReply(role=v.role, epoch=v.epoch, owner=v.owner, last_seq=v.last_seq, active=v.active,
                             address=v.address, synced=v.synced, node=v.node)

    async def follow(self, request_iterator, context):
        """A standby's Follow call (the caller's certificate and signature are checked)."""
        shipper = self.shipper
        if self.role != "active" or shipper is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"this master of level {self.level} is not the active one")
        try:
            first = await request_iterator.__anext__()
        except StopAsyncIteration:
            return
        epoch = (await asyncio.get_running_loop().run_in_executor(shipper.pool, self.store.epoch))[0]
        if first.epoch > epoch:
            limited.log(logging.ERROR, "follower-newer", "refused to be followed by %s: its epoch %d is newer than "
                        "this master's %d (this master was replaced while it ran: see docs/operations.md, Standby "
                        "masters)", first.follower, first.epoch, epoch)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"this master's epoch {epoch} is older than the follower's {first.epoch}")
        async for record in shipper.serve(first, request_iterator, context):
            yield record

    def counters(self) -> dict:
        out = {"epoch": self.store.epoch()[0]}
        if self.shipper is not None:
            out |= {"standbys_in_sync": self.shipper.in_sync(), "standby_attaches": self.shipper.attached,
                    "standby_detached": self.shipper.detached}
        return out

    def fenced(self, detail: str) -> None:
        """A worker refused this master for a newer epoch: step down (the process stops)."""
        if self.failure is None:
            self.failure = Fenced(f"fenced: {detail}; this master stopped (restart it: it follows the active one)")
            log.error("%s", self.failure)
        self.role = "starting"  # no client call is served from now on
        self.stop.set()

    # -- peers --------------------------------------------------------------------------------------------
    def _channel(self, address: str) -> grpc.Channel:
        ch = self._channels.get(address)
        if ch is None:
            opts = [("grpc.max_receive_message_length", MAX_MESSAGE), ("grpc.max_send_message_length", MAX_MESSAGE),
                    ("grpc.initial_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 1000)]
            if self.tls_dir is not None:  # as a master of this level, to a master of this level
                ch = secure_channel(address, self.tls_dir, "master", self.level, "master", opts)
            else:
                ch = grpc.insecure_channel(address, opts)
            self._channels[address] = ch
        return ch

    def _signed(self, kind: str, payload: bytes) -> tuple:
        return ((AUTH_HEADER, sign_request(self.key, self.level, peer_digest(kind, payload))),)

    def ask(self, address: str) -> PeerView | None:
        """A peer's answer to Probe (None: it does not answer)."""
        me = self.view()
        req = pb.ProbeRequest(asker=self.address, epoch=me.epoch, last_seq=me.last_seq)
        try:
            r = rpc.MasterStub(self._channel(address)).Probe(req, metadata=self._signed("probe", req.SerializeToString()),
                                                             timeout=PROBE_SECONDS)
        except grpc.RpcError:
            return None
        if r.node == self.node:  # a peer address that is this master itself: not a peer
            log.warning("peer %s is this master itself; not asking it again", address)
            self.peers = [p for p in self.peers if p != address]
            return None
        return PeerView(r.role, int(r.epoch), int(r.last_seq), r.address or address, bool(r.synced), r.owner, r.active,
                        r.node)

    def ask_all(self) -> dict:
        return {p: self.ask(p) for p in list(self.peers)}

    # -- the node's thread ----------------------------------------------------------------------------
    def start(self, activate) -> "Node":
        """Decide (in a thread): follow an active peer, or go active (``activate(epoch)`` builds and
        starts the serving master); a failure stops the process (:attr:`failure`)."""
        self._thread = threading.Thread(target=self._run, args=(activate,), name="standby", daemon=True)
        self._thread.start()
        return self

    def _run(self, activate) -> None:
        try:
            t0 = time.monotonic()
            told = ""
            while not self.stop.is_set():
                answers = self.ask_all()
                action, peer = start_decision(self.view(), answers, time.monotonic() - t0)
                if action == "active":
                    self._activate(activate, answers, "no active master of the level answers")
                    return
                if action == "follow":
                    self.active, self.role = peer, "standby"
                    log.warning("master %s of level %s starts as a standby of %s", self.address, self.level, peer)
                    self._standby(activate)
                    return
                why = ", ".join(f"{a}: {v.role if v else 'no answer'}" for a, v in answers.items())
                if why != told:
                    log.warning("waiting for the level's masters to settle (%s)", why)
                    told = why
                self.stop.wait(LOOK_SECONDS)
        except BaseException as e:  # noqa: BLE001 - the process stops with it (serve_replicated raises it)
            log.exception("master %s of level %s failed", self.address, self.level)
            self.failure = e
            self.stop.set()

    def _standby(self, activate) -> None:
        told = False
        while not self.stop.is_set():
            got = self._follow(self.active) if self.active else False
            if self.stop.is_set():
                return
            if not got:
                self.stop.wait(1.0)  # it answered as active but the stream gave nothing: not in a loop
            while not self.stop.is_set():
                answers = self.ask_all()
                if (answers.get(self.active) or PeerView("")).role == "active":
                    self.last_heard = time.monotonic()
                action, peer = takeover_decision(self.view(), answers, time.monotonic() - self.last_heard,
                                                 self.takeover_seconds)
                if action == "follow":
                    if peer != self.active:
                        log.warning("the active master of level %s is %s now; following it", self.level, peer)
                    self.active = peer
                    break
                if action == "takeover":
                    silent = time.monotonic() - self.last_heard
                    self._activate(activate, answers, f"the active master {self.active} has not answered for "
                                                      f"{silent:.1f} s", took_over_from=self.active, silent=silent)
                    return
                if not self.synced and not told:
                    log.warning("the active master %s does not answer and this standby never completed a copy of its "
                                "log: it cannot take over; waiting for an active master", self.active)
                    told = True
                self.stop.wait(LOOK_SECONDS)

    def _activate(self, activate, answers: dict, why: str, took_over_from: str | None = None,
                  silent: float = 0.0) -> None:
        t0 = time.monotonic()
        self.role = "activating"
        self.active = ""
        epoch = next_epoch(self.store.epoch()[0], answers)
        self.store.set_epoch(epoch, self.address)
        activate(epoch)
        self.role = "active"
        self.active = self.address
        seconds = time.monotonic() - t0
        if took_over_from:
            self.takeover = {"from": took_over_from, "silent_seconds": round(silent, 2), "restore_seconds":
                             round(seconds, 2), "epoch": epoch}
            log.warning("took over as the active master of level %s at epoch %d: %s; restored and serving in "
                        "%.2f s", self.level, epoch, why, seconds)
        else:
            log.warning("master %s of level %s is active at epoch %d (%s)", self.address, self.level, epoch, why)
        self.ready.set()

    def _follow(self, address: str) -> bool:
        """Follow ``address`` until its stream ends or breaks; True if any record came."""
        out: queue.SimpleQueue = queue.SimpleQueue()
        epoch, owner = self.store.epoch()
        first = pb.FollowRequest(epoch=epoch, owner=owner, last_seq=self.store.last_seq(), follower=self.address)

        def requests():
            yield first
            while True:
                m = out.get()
                if m is None:
                    return
                yield m

        incoming = self.store.path.with_name(self.store.path.name + ".incoming")
        fh = None
        got = False
        last = [time.monotonic()]
        done = threading.Event()
        call = rpc.MasterStub(self._channel(address)).Follow(requests(), metadata=self._signed("follow", b""))
        self._call = call

        def watchdog():  # a stream that carries nothing (not even pings) counts as broken
            while not done.wait(0.5):  # (the copy of a large file may take a while before its first piece)
                if time.monotonic() - last[0] > (STALL_SECONDS if got else FIRST_RECORD_SECONDS) or self.stop.is_set():
                    call.cancel()
                    return

        threading.Thread(target=watchdog, name="follow-watchdog", daemon=True).start()
        why = "the active master ended the stream"
        try:
            for rec in call:
                last[0] = self.last_heard = time.monotonic()
                got = True
                if rec.kind == "snapshot":
                    if fh is None:
                        fh = os.fdopen(os.open(incoming, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb")
                    fh.write(rec.data)
                elif rec.kind == "snapshot_end":
                    if fh is None:
                        raise ValueError("the active master sent no copy of its state file")
                    fh.flush()
                    os.fsync(fh.fileno())
                    fh.close()
                    fh = None
                    self.store.install_snapshot(incoming)
                    self.synced = True
                    out.put(pb.FollowRequest(confirmed=rec.lsn))
                    log.warning("following %s: its state file installed (%s bytes, record %d, last event %d)",
                                address, json.loads(rec.body or b"{}").get("bytes"), rec.lsn, self.store.last_seq())
                    self.ready.set()
                elif rec.kind == "ping":
                    continue
                else:
                    self.store.apply_shipped(rec.kind, json.loads(rec.body), rec.data or None)
                    out.put(pb.FollowRequest(confirmed=rec.lsn))
        except grpc.RpcError as e:
            code = e.code()
            why = f"{getattr(code, 'name', code)}: {one_line(e.details() or '')}"
        except (StateMismatch, ValueError, KeyError, OSError) as e:  # a copy or record it cannot take
            why = f"cannot follow: {one_line(e)}"
            log.error("standby of %s: %s", address, why)
            call.cancel()
            self.stop.wait(5.0)
        finally:
            done.set()
            out.put(None)
            self._call = None
            if fh is not None:
                fh.close()
            incoming.unlink(missing_ok=True)
        if not self.stop.is_set():
            limited.warning("follow-ended", "follow stream from %s ended: %s", address, why)
        return got

    def close(self) -> None:
        """Stop the node's thread (a standby stops following)."""
        self.stop.set()
        call = self._call
        if call is not None:
            call.cancel()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)
        for ch in self._channels.values():
            ch.close()


def serve_replicated(config, level: str, listen: str, spec, users, peers: list[str], state_path,
                     chunk_instants: int = 1, ready=None, stop_event: threading.Event | None = None, tls_dir=None,
                     owner: str | None = None, takeover_seconds: float = DEFAULT_TAKEOVER_SECONDS,
                     ack_seconds: float = DEFAULT_ACK_SECONDS) -> None:
    """Run a master of ``level`` with ``peers`` (the level's other masters) until SIGTERM/SIGINT (or
    ``stop_event``): a standby of the active one, or the active one (:class:`Node`).  Raises what
    stopped it (:class:`Fenced`, a :class:`StateMismatch` of its state file)."""
    lv = config.lattice.parse(level)
    warm_up(config, lv)
    store = MasterStore(state_path, lv, config_fingerprint(config))
    stop = stop_event or threading.Event()
    if stop_event is None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
    node = Node(lv, store, [p for p in peers if p != listen], spec.key, tls_dir, takeover_seconds, ack_seconds,
                stop=stop)
    creds, client_check = client_tls(tls_dir, lv, node.client_refused)
    server = MasterServer(None, listen, credentials=creds, peer_check=client_check, replication=node)
    node.address = server.address
    node.peers = [p for p in node.peers if p != node.address]
    parts: dict = {}

    def activate(epoch: int) -> None:
        shipper = LogShipper(store, ack_seconds)  # before anything is written: every write is shipped
        core, sessions, restored = build_core(config, level, store, users, chunk_instants, owner)
        if any(restored.values()):
            log.warning("restored from %s: %s", state_path, restored)
        core.refused = node.client_refused
        servicer = MasterServicer(core, sessions)
        servicer.replicate = shipper.wait
        servicer.extra_counters = node.counters
        server.front.install(servicer)
        loops = MasterLoops(core, sessions, users, spec, node.address, tls_dir, store, epoch=epoch,
                            on_fenced=node.fenced)
        parts.update(core=core, loops=loops)
        loops.start()
        node.shipper = shipper

    server.start()
    node.start(activate)
    log.info("master %s level %s started with peers %s", node.address, level, ", ".join(node.peers))

    def on_ready():
        while not node.ready.wait(0.2):
            if stop.is_set():
                return
        if ready is not None:
            loops = parts.get("loops")
            ready(node.address, parts.get("core"), loops.member if loops is not None else None)

    def cleanup():
        node.close()
        if "loops" in parts:
            parts["loops"].stop()
        server.stop(grace=2)  # ends the Follow streams too
        if node.shipper is not None:
            node.shipper.pool.shutdown(wait=False, cancel_futures=True)
        store.close()

    run_until_stopped(stop, on_ready, cleanup)
    if node.failure is not None:
        raise node.failure
