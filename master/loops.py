"""A serving master put together: its core and sessions restored (:func:`build_core`), and the
threads beside its gRPC server (:class:`MasterLoops`).

The threads, each a loop over plain logic: the group member (encrypted, signed heartbeats in and
out, :class:`~strata.groups.membership.GroupMember`), the dispatch loop
(:class:`~strata.master.dispatch_loop.DispatchLoop`), the checkpointer (with a state file,
:class:`~strata.master.checkpoint.Checkpointer`) and the users-file watch
(:class:`~strata.master.users_watch.UsersWatch`).  Used by :func:`strata.master.server.serve_master`
and, when it becomes active, by a master with standbys (:mod:`strata.master.standby`).
"""

from __future__ import annotations

from strata.groups.membership import GroupMember

from .checkpoint import Checkpointer
from .core import MasterCore
from .dispatch_loop import DispatchLoop
from .sessions import Sessions
from .users_watch import UsersWatch

__all__ = ["build_core", "MasterLoops"]


def build_core(config, level: str, store, users, chunk_instants: int = 1, owner: str | None = None):
    """A master's core and sessions over ``store`` (None: in memory), restored from it: (core, sessions,
    what was restored)."""
    # [cluster] dispatch_linger = false: send ready chunks at once even while input floods in
    core = MasterCore(config, level, chunk_instants=chunk_instants, store=store,
                      linger=config.cluster.dispatch_linger)
    sessions = Sessions(users, core.level, persist=store, owner=owner)
    restored = {}
    if store is not None:
        restored = core.restore()
        restored["sessions"] = sessions.restore()
    return core, sessions, restored


class MasterLoops:
    """A serving master's threads besides its gRPC server: the group member (heartbeats), the dispatch
    loop, the checkpointer (with a store) and the users-file watch (checked once here: users removed
    while the master was down lose their restored sessions and queries)."""

    def __init__(self, core: MasterCore, sessions: Sessions, users, spec, address: str, tls_dir=None,
                 store=None, epoch: int = 0, on_fenced=None):
        self.member = GroupMember(spec, sid=address, role="master")
        self.member.state = "master"
        core.group_rejected = lambda: self.member.rejected
        self.dispatch = DispatchLoop(core, spec.key, self.member, tls_dir=tls_dir, epoch=epoch, on_fenced=on_fenced)
        self.checkpoints = Checkpointer(core) if store is not None else None
        self.watch = UsersWatch(core, sessions, users)
        self.watch.check()

    def start(self) -> "MasterLoops":
        self.member.start()
        self.dispatch.start()
        self.watch.start()
        if self.checkpoints is not None:
            self.checkpoints.start()
        return self

    def stop(self) -> None:
        self.watch.stop()
        if self.checkpoints is not None:
            self.checkpoints.stop()
        self.dispatch.stop()
        self.member.stop()
