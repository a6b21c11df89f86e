"""Login throttling (issue 14, item 6): attempts are counted before the password check, per user and
per client host; names are length-capped; failure records take bounded memory; no failure says
whether a user exists."""

from __future__ import annotations

import threading
import time

import pytest

from strata.master.sessions import LOGIN_FAILED, MAX_PASSWORD, MAX_USER_NAME, Sessions, _peer_host
from strata.users import AuthError, UserStore

HOST = "ipv4:10.0.0.5:40001"


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


@pytest.fixture
def users(battlefield, tmp_path):
    u = UserStore(tmp_path / "users.json", battlefield.lattice)
    u.add("ann", "S", "right", roles="analyst")
    return u


@pytest.fixture
def verifier(users, monkeypatch):
    """Stands in for the argon2 check: counts the checks that reach it (no 64 MiB hash per guess);
    ``verifier.delay[0]`` seconds each."""
    calls, delay, lock = [], [0.0], threading.Lock()
    real = users.authenticate

    def counting(name, password, level=None):
        with lock:
            calls.append(name)
        time.sleep(delay[0])
        if password != "right":
            raise AuthError(LOGIN_FAILED)
        return real(name, password, level)

    monkeypatch.setattr(users, "authenticate", counting)
    counting.calls, counting.delay = calls, delay
    return counting


def failure(sessions, user, password="wrong", peer=HOST) -> str:
    with pytest.raises(AuthError) as e:
        sessions.login(user, password, "S", peer=peer)
    return str(e.value)


def test_parallel_wrong_guesses_stop_at_the_lockout(users, verifier):
    sessions = Sessions(users, "S")
    verifier.delay[0] = 0.3  # every guess is still being checked when the others arrive
    start = threading.Barrier(16)
    errors = []

    def guess():
        start.wait()
        try:
            sessions.login("ann", "wrong", "S", peer=HOST)
        except AuthError as e:
            errors.append(str(e))

    threads = [threading.Thread(target=guess) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(verifier.calls) == sessions.max_failures == 5
    assert len(errors) == 16 and sessions.failed_logins == 16
    assert sum(e.startswith("login failed: too many failed attempts") for e in errors) == 11
    with pytest.raises(AuthError, match="too many failed attempts"):  # the right password too, for now
        sessions.login("ann", "right", "S", peer="ipv4:10.9.9.9:1")


def test_lockout_lasts_its_time_after_the_last_failure_and_a_success_starts_afresh(users, verifier):
    clock = Clock()
    sessions = Sessions(users, "S", clock=clock)
    for _ in range(4):
        failure(sessions, "ann")
    assert sessions.login("ann", "right", "S", peer=HOST).principal.user == "ann"  # resets ann
    for _ in range(5):
        assert failure(sessions, "ann") == LOGIN_FAILED
    checked = len(verifier.calls)
    clock.t += 29
    assert failure(sessions, "ann", "right") == "login failed: too many failed attempts; retry in 1 s"
    assert len(verifier.calls) == checked  # refused before the password check
    clock.t += 1
    assert sessions.login("ann", "right", "S", peer=HOST).principal.user == "ann"


def test_a_host_is_throttled_whatever_names_it_tries(users, verifier):
    clock = Clock()
    sessions = Sessions(users, "S", clock=clock)
    assert sessions.peer_max_failures == 20
    for i in range(20):  # four guesses for each of five names: no name reaches its own limit
        failure(sessions, f"user{i % 5}", peer=f"ipv4:10.0.0.5:{40000 + i}")  # a new port each time
    checked = len(verifier.calls)
    assert "too many failed attempts" in failure(sessions, "someone-else")
    assert "too many failed attempts" in failure(sessions, "ann", "right")
    assert len(verifier.calls) == checked
    # another host, and a user the attacker never named, are not held up
    assert sessions.login("ann", "right", "S", peer="ipv4:10.0.0.6:1").principal.user == "ann"
    clock.t += 30
    assert sessions.login("ann", "right", "S", peer=HOST).principal.user == "ann"


def test_long_names_are_refused_like_any_other_failure_and_never_kept(users, verifier):
    sessions = Sessions(users, "S")
    name = "x" * (MAX_USER_NAME + 1)
    message = failure(sessions, name)
    assert message == LOGIN_FAILED == failure(sessions, "nobody") == failure(sessions, "ann")
    assert name not in message
    assert verifier.calls == ["nobody", "ann"]  # the long name never reached the password check
    assert all(len(k) <= MAX_USER_NAME + 2 for k in sessions._failures)
    assert failure(sessions, "x" * MAX_USER_NAME) == LOGIN_FAILED  # at the cap: checked as usual


def test_huge_passwords_never_reach_argon2(users, verifier):
    sessions = Sessions(users, "S")
    assert failure(sessions, "ann", "y" * (MAX_PASSWORD + 1)) == LOGIN_FAILED
    assert verifier.calls == []  # refused before the password check, counted like any failure
    assert sessions.failed_logins == 1


def test_lockout_messages_do_not_say_whether_the_user_exists(users, verifier):
    clock = Clock()
    sessions = Sessions(users, "S", clock=clock)
    for _ in range(5):
        assert failure(sessions, "ann", peer="ipv4:10.0.0.7:1") == failure(sessions, "nobody",
                                                                           peer="ipv4:10.0.0.8:1")
    assert failure(sessions, "ann", peer="ipv4:10.0.0.7:1") == failure(sessions, "nobody", peer="ipv4:10.0.0.8:1")


def test_failure_records_take_bounded_memory(users, verifier):
    clock = Clock()
    sessions = Sessions(users, "S", clock=clock, max_records=50)
    for i in range(500):
        failure(sessions, f"name{i}", peer=f"ipv4:10.1.{i // 250}.{i % 250}:1")
        assert len(sessions._failures) <= 50
    clock.t += 31  # everything is older than the lockout: dropped at the next attempt
    failure(sessions, "ann")
    assert set(sessions._failures) == {"u:ann", "h:10.0.0.5"}


def test_a_success_gives_its_host_slot_back(users, verifier):
    sessions = Sessions(users, "S", peer_max_failures=3)
    for _ in range(2):
        failure(sessions, "bob")
    for _ in range(5):  # a host's own successful logins never lock it out
        sessions.login("ann", "right", "S", peer=HOST)
    failure(sessions, "bob")
    assert "too many failed attempts" in failure(sessions, "ann", "right")


@pytest.mark.parametrize("peer, host", [
    ("ipv4:127.0.0.1:5555", "127.0.0.1"),
    ("ipv6:[::1]:5555", "::/64"),
    ("ipv6:[2001:db8:1:2:aaaa::1]:443", "2001:db8:1:2::/64"),
    ("ipv6:[2001:db8:1:2:bbbb::9]:80", "2001:db8:1:2::/64"),
    ("ipv6:[::ffff:10.0.0.5]:1234", "10.0.0.5"),  # a dual-stack listener: the IPv4 client itself
    ("unix:/tmp/strata.sock", "unix"),
    ("", None),
    (None, None),
])
def test_peer_host(peer, host):
    assert _peer_host(peer) == host


def test_the_login_rpc_throttles_by_the_callers_peer(battlefield, tmp_path):
    import grpc

    from strata.master.core import MasterCore
    from strata.master.server import MasterServicer
    from strata.rpc import strata_pb2 as pb

    users = UserStore(tmp_path / "users.json", battlefield.lattice)
    users.add("ann", "S", "right", roles="analyst")
    sessions = Sessions(users, "S", peer_max_failures=2)
    servicer = MasterServicer(MasterCore(battlefield, "S"), sessions)

    class Context:
        def __init__(self, peer):
            self._peer = peer

        def peer(self):
            return self._peer

        def abort(self, code, message):
            raise RuntimeError(code, message)

    def login(user, password, peer):
        try:
            return servicer.Login(pb.LoginRequest(user=user, password=password, level="S"), Context(peer))
        except RuntimeError as e:
            assert e.args[0] == grpc.StatusCode.UNAUTHENTICATED
            return e.args[1]

    assert login("bob", "x", "ipv4:10.0.0.9:1") == LOGIN_FAILED
    assert login("cid", "x", "ipv4:10.0.0.9:2") == LOGIN_FAILED
    assert login("ann", "right", "ipv4:10.0.0.9:3").startswith("login failed: too many failed attempts")
    assert login("ann", "right", "ipv4:10.0.0.10:1").token


# ---- strata replay checks the credentials before it starts anything (issue 30 item 7) ----------------
def test_replay_checks_the_password_before_anything_starts_and_throttles(tmp_path):
    """A wrong password: one line, exit 3, and no embedded cluster started (no run directory made);
    five failures lock the name for the master's lockout, across runs (the records are in a 0600 file
    beside the users file), so the right password is refused too until then."""
    import os
    import stat
    import subprocess
    import sys

    from strata.examples import BATTLEFIELD_TOML

    from .helpers import PASSWORD, write_config

    cfg = write_config(tmp_path, BATTLEFIELD_TOML, {"ann": "S"})
    data = tmp_path / "v.csv"
    data.write_text("ts,level,sid,bp,pr,weight\n1,S,a,100,1,1\n")
    tmp = tmp_path / "tmp"
    tmp.mkdir()

    def replay(password):
        env = {**os.environ, "STRATA_PASSWORD": password, "TMPDIR": str(tmp)}
        r = subprocess.run([sys.executable, "-m", "strata", "replay", "--config", str(cfg), "--user", "ann",
                            "--query", "SELECT COUNT(*) FROM Vitals", "--input", f"Vitals={data}", "--output",
                            str(tmp_path / "out.csv")], capture_output=True, text=True, timeout=120, env=env)
        return r.returncode, r.stderr

    for _ in range(5):
        code, err = replay("wrong")
        assert (code, err) == (3, "strata: login failed: unknown user or wrong password\n")
    assert not list(tmp.iterdir())  # nothing was started: no embedded cluster's directory
    from strata.config import load_config
    from strata.deploy.replay import check_credentials
    from strata.errors import CliError

    with pytest.raises(CliError) as e:  # the next run's check (in this process: no start-up time passes)
        check_credentials(load_config(cfg), "ann", PASSWORD, None)
    assert e.value.code == 3 and str(e.value).startswith("login failed: too many failed attempts; retry in ")
    records = cfg.with_name("strata.users.json.failures")
    assert stat.S_IMODE(records.stat().st_mode) == 0o600
