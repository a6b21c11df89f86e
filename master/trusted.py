"""The trusted master (``[cluster] mode = "trusted"``, docs/trusted.md): one process, one address, the
sessions of every level it is trusted for.

It composes, in one process, one **level pipeline** per level (:class:`LevelPart`): the level's own
:class:`~strata.master.core.MasterCore` (stream shepherd, chunker, queries, dispatch state, event log,
status and counters), :class:`~strata.master.sessions.Sessions`, servicer, state file, dispatch loop,
checkpointer and users-file watch, each exactly what a master of that level alone has.  Nothing is
shared between two levels' pipelines but the process, the gRPC port and the group of workers: so
everything a session of level S receives is computed by S's pipeline from what S's shepherd kept.

* **Routing** (:class:`TrustedFront`): every call goes to the pipeline of the caller's level.  With
  TLS the level is the client certificate's (the link's level: a client of level S presents
  ``client-S`` and pins ``master.S.strata``; the server holds ``master-L`` for each of its levels and
  presents the one named, by SNI); the session token must then be one of that level's sessions, so a
  token of another level is "invalid or expired" here.  Without TLS (development) a login goes to the
  level it names, any other call to the level whose sessions hold its token.  Each level keeps its own
  ``grpc.aio`` front (:class:`~strata.master.aio_server.AioMaster`: its call and ingest pools, stream
  limits, waiting subscribers), so a level's calls never wait for a thread another level holds.
* **Dispatch**: one dispatch loop per level, each over its own core, sends its own chunks to the
  trusted worker group (one group, the top level's: heartbeats and group key), signed for its level
  and, with TLS, over a link presenting its level's master certificate; so S's chunks never queue
  behind TS's in the master.  Each level's Algorithm 5 sees the workers' heartbeats without their CPU
  reading (:class:`LevelView`): that reading mixes every level's load, and a lower level's dispatch
  (and its operators' status) must not depend on a higher level's load; dispatch goes by each level's
  own evaluation slots on each worker (credits).
* **Turns** (``[cluster] scheduler`` other than ``shared``, strata/turns.py): the levels take turns in
  this process by the same plans as in the trusted workers, on the same grid (so under ``fixed_slot`` a
  level's slot opens at the same moments in the master and in its workers).  Each level's work waits in
  its own turn: its front's pool calls (:class:`AioMaster` ``turn``: unary calls, ingest batches, the
  taking and encoding of result messages), its dispatch steps (cutting, encoding, merging replies:
  :class:`~strata.master.dispatch_loop.DispatchLoop` ``turn``) and its checkpoints.  So a higher
  level's ingest, chunks and results are handled in its own slots, never in a lower level's.
* **What is not per level**: transport refusals (a certificate of no served level) and refused
  heartbeats of the group are counted in the top level's status only.

Standby masters are not supported for a trusted master yet (``strata master --peers`` is refused).
"""

from __future__ import annotations

import functools
import logging
import sys
import threading
from dataclasses import dataclass, replace

import grpc

from strata.groups.membership import GroupMember
from strata.rpc import strata_pb2_grpc as rpc
from strata.serving import run_until_stopped
from strata.tls import PeerCheck, peer_identity, server_credentials
from strata.turns import make_turns

from .aio_server import AioMaster, MasterServer
from .checkpoint import Checkpointer
from .core import MasterCore
from .dispatch_loop import DispatchLoop
from .loops import build_core
from .server import MasterServicer, warm_up
from .sessions import Sessions
from .store import MasterStore, config_fingerprint
from .users_watch import UsersWatch

__all__ = ["LevelPart", "LevelView", "TrustedFront", "TrustedServer", "build_levels", "serve_trusted_master"]

log = logging.getLogger("strata.master")


@dataclass
class LevelPart:
    """One level's pipeline inside the trusted master: what a master of that level alone has."""

    level: str
    core: MasterCore
    sessions: Sessions
    servicer: MasterServicer
    store: MasterStore | None = None


def build_levels(config, levels, users, chunk_instants: int = 1, owner: str | None = None,
                 state_paths: dict | None = None) -> dict[str, LevelPart]:
    """A :class:`LevelPart` per level of ``levels`` (the top first), each restored from its own state file
    (``state_paths[level]``; None or missing: in memory)."""
    parts: dict[str, LevelPart] = {}
    for lv in levels:
        path = (state_paths or {}).get(lv)
        store = MasterStore(path, lv, config_fingerprint(config)) if path else None
        core, sessions, restored = build_core(config, lv, store, users, chunk_instants, owner)
        if any(restored.values()):
            log.warning("level %s restored from %s: %s", lv, path, restored)
        parts[core.level] = LevelPart(core.level, core, sessions, MasterServicer(core, sessions), store)
    return parts


class LevelView:
    """What one level's dispatch loop sees of the trusted group's member: the proven workers' heartbeats
    with their CPU reading left out (0).  A worker's reading mixes the load of every level it serves; a
    level's dispatch decisions and its operators' status must not depend on a higher level's load, so
    each level dispatches by its own slots on each worker only.  ``prove``: this view also runs the
    group's address proofs (the top level's loop: its Info probes are signed for the group's level)."""

    def __init__(self, member, prove: bool = False):
        self._member = member
        self._prove = prove

    def snapshot(self) -> dict:
        return {sid: replace(hb, cpu=0.0) for sid, hb in self._member.snapshot().items()}

    def __getattr__(self, name):
        if name.startswith("_") or not self.__dict__.get("_prove"):
            raise AttributeError(name)
        return getattr(self._member, name)


class TrustedFront(rpc.MasterServicer):
    """The one gRPC front of a trusted master: each call goes to the front (:class:`AioMaster`) of its
    caller's level.  The level is the client certificate's with TLS; without TLS a login's named level,
    else the level whose sessions hold the call's token."""

    def __init__(self, fronts: dict[str, AioMaster], parts: dict[str, LevelPart], lattice, tls: bool,
                 refused: dict):
        self.fronts = fronts
        self.parts = parts
        self.lattice = lattice
        self.top = next(iter(parts))
        self.tls = tls
        self.refused = refused  # the top level's transport refusals (master status: transport:*)
        self._serves = ", ".join(parts)
        self.peer_check = PeerCheck(self.top, ("client",), refused=refused, levels=tuple(parts)) if tls else None

    def shutdown(self) -> None:
        for f in self.fronts.values():
            f.shutdown()

    def _token_level(self, context) -> str:
        auth = dict(context.invocation_metadata() or ()).get("authorization", "")
        token = auth[7:] if auth.lower().startswith("bearer ") else None
        for lv, part in self.parts.items():
            if token and part.sessions.holds(token):
                return lv
        return self.top  # no such session: the top level's front refuses it (invalid or expired)

    async def _front(self, context, login=None) -> AioMaster:
        if self.peer_check is not None:  # the link's level: the client certificate's
            refusal = self.peer_check.refusal(context)
            if refusal is not None:
                await context.abort(*refusal)
            return self.fronts[peer_identity(context).level]
        if login is not None:
            try:
                lv = self.lattice.parse(login.level) if login.level else None
            except ValueError:
                lv = None
            if lv not in self.fronts:
                self.refused["login_level"] = self.refused.get("login_level", 0) + 1
                await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                    f"login failed: this master serves levels {self._serves}; log in at one of them")
            return self.fronts[lv]
        return self.fronts[self._token_level(context)]

    # -- unary calls ---------------------------------------------------------------------------
    async def Login(self, request, context):
        return await (await self._front(context, login=request)).Login(request, context)

    async def Logout(self, request, context):
        return await (await self._front(context)).Logout(request, context)

    async def Register(self, request, context):
        return await (await self._front(context)).Register(request, context)

    async def Advance(self, request, context):
        return await (await self._front(context)).Advance(request, context)

    async def Cancel(self, request, context):
        return await (await self._front(context)).Cancel(request, context)

    async def Status(self, request, context):
        return await (await self._front(context)).Status(request, context)

    async def AddStream(self, request, context):
        return await (await self._front(context)).AddStream(request, context)

    async def Streams(self, request, context):
        return await (await self._front(context)).Streams(request, context)

    async def Access(self, request, context):
        return await (await self._front(context)).Access(request, context)

    # -- streams ---------------------------------------------------------------------------------
    async def Subscribe(self, request, context):
        front = await self._front(context)
        async for message in front.Subscribe(request, context):
            yield message

    async def Ingest(self, request_iterator, context):
        return await (await self._front(context)).Ingest(request_iterator, context)

    async def IngestStream(self, request_iterator, context):
        front = await self._front(context)
        async for ack in front.IngestStream(request_iterator, context):
            yield ack

    # -- master to master: a trusted master has no standbys -----------------------------------------
    async def Probe(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "a trusted master has no standbys")

    async def Follow(self, request_iterator, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "a trusted master has no standbys")
        yield  # an async generator (never reached)


def level_turn(turns, level: str):
    """``level``'s turn in ``turns``: ``turn(kind)`` a context manager (each kind of work estimated from its
    own past: ``call``, ``ingest``, ``message``, ``dispatch``, ``checkpoint``); None without turns."""
    return None if turns is None else functools.partial(turns.turn, level)


class TrustedServer(MasterServer):
    """The trusted master's ``grpc.aio`` server: one port, a :class:`TrustedFront` over one
    :class:`AioMaster` per level (its own pools: a level's calls never wait for another level's)."""

    def __init__(self, parts: dict[str, LevelPart], lattice, listen: str, credentials=None,
                 call_threads: int = 8, ingest_threads: int = 4, turns=None):
        """``turns``: the levels' turns (strata/turns.py; None: the levels' calls run concurrently)."""
        self.parts, self.lattice, self.turns = parts, lattice, turns
        super().__init__(None, listen, credentials=credentials, call_threads=call_threads,
                         ingest_threads=ingest_threads)

    def make_front(self) -> TrustedFront:
        tls = self.credentials is not None
        fronts = {lv: AioMaster(p.servicer, PeerCheck(lv, ("client",), refused=p.core.refused) if tls else None,
                                *self.threads, turn=level_turn(self.turns, lv)) for lv, p in self.parts.items()}
        top = next(iter(self.parts.values()))
        return TrustedFront(fronts, self.parts, self.lattice, tls, top.core.refused)


class TrustedLoops:
    """The trusted master's threads besides its server: the group member (the top level's group: the
    trusted workers' heartbeats), and per level a dispatch loop, a checkpointer (with a state file) and
    a users-file watch."""

    def __init__(self, parts: dict[str, LevelPart], users, spec, address: str, tls_dir=None, turns=None):
        self.member = GroupMember(spec, sid=address, role="master")
        self.member.state = "master"
        top = next(iter(parts))
        parts[top].core.group_rejected = lambda: self.member.rejected  # refused heartbeats: the top's status only
        self.threads = []
        for lv, p in parts.items():
            turn = level_turn(turns, lv)
            self.threads.append(DispatchLoop(p.core, spec.key, LevelView(self.member, prove=lv == top), tls_dir=tls_dir,
                                             turn=turn))
            if p.store is not None:
                self.threads.append(Checkpointer(p.core, turn=turn))
            watch = UsersWatch(p.core, p.sessions, users)
            watch.check()
            self.threads.append(watch)

    def start(self) -> "TrustedLoops":
        self.member.start()
        for t in self.threads:
            t.start()
        return self

    def stop(self) -> None:
        for t in reversed(self.threads):
            t.stop()
        self.member.stop()


def serve_trusted_master(config, levels, listen: str, spec, users, chunk_instants: int = 1, ready=None,
                         stop_event: threading.Event | None = None, tls_dir=None, state_paths: dict | None = None,
                         owner: str | None = None) -> None:
    """Run a trusted master of ``levels`` (the top first: :func:`strata.trusted.trusted_levels`) until
    SIGTERM/SIGINT (or ``stop_event``).  ``spec``: the top level's group (the trusted workers');
    ``state_paths``: level -> its state file (None: in memory).  With ``tls_dir`` it serves the
    certificate ``master-L`` of each level L to clients of L, and dispatches L's chunks as ``master-L``."""
    levels = tuple(levels)
    warm_up(config, levels[0])
    parts = build_levels(config, levels, users, chunk_instants, owner, state_paths)
    creds = server_credentials(tls_dir, "master", levels[0], also=levels) if tls_dir is not None else None
    turns = make_turns(config.cluster, config.lattice, tuple(parts))
    if turns is not None:
        print(f"[strata] master: levels {', '.join(turns.levels)} take turns: {config.cluster.scheduler}, "
              f"{config.cluster.slot_seconds:g} s slots (strata/turns.py)", file=sys.stderr, flush=True)
    if turns is not None:  # each level's operators read the level's own turn figures (status timings)
        for lv, p in parts.items():
            p.core.turn_stats = functools.partial(turns.stats, lv)
    server = TrustedServer(parts, config.lattice, listen, credentials=creds, turns=turns)
    address = server.address
    loops = TrustedLoops(parts, users, spec, address, tls_dir, turns=turns)
    server.start()
    loops.start()
    log.info("trusted master %s serving levels %s", address, ", ".join(parts))
    top = parts[levels[0]]

    def cleanup():
        if turns is not None:  # every waiting call runs at once: nothing waits for a slot while stopping
            turns.stop()
            print(f"[strata] master: turns of each level: {({lv: turns.stats(lv) for lv in turns.levels})}",
                  file=sys.stderr, flush=True)
        loops.stop()
        server.stop(grace=2)
        for p in parts.values():
            if p.store is not None:
                p.store.close()

    run_until_stopped(stop_event, ready and (lambda: ready(address, top.core, loops.member)), cleanup)
