"""The elastic scaler: policy (unit and property tests), the worker actor's process
handling, and an end-to-end run of ``strata scale`` on a private Ray cluster.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from strata.deploy.scaler_policy import Decision, Observation, PolicySettings, ScalingPolicy, WorkerObs

from .helpers import alive
from .polling import poll


def W(sid, cpu=10.0, in_flight=0, done=0, ours=True, state="ready"):
    return WorkerObs(sid=sid, cpu=cpu, in_flight=in_flight, chunks_done=done, state=state, drainable=ours)


FAST = PolicySettings(min_workers=1, max_workers=4, up_backlog=4, up_sustain=2, up_cooldown=10, max_step_up=2,
                      down_backlog=0, down_cpu=50, down_idle=30, down_cooldown=30)


# ---- policy: unit tests -------------------------------------------------------------------------------
def test_settings_are_validated():
    for bad in (dict(min_workers=3, max_workers=2), dict(max_workers=0, min_workers=0), dict(min_workers=-1),
                dict(up_backlog=2, down_backlog=2), dict(down_cpu=95), dict(cpu_threshold=0), dict(up_sustain=-1),
                dict(max_step_up=0)):
        with pytest.raises(ValueError):
            PolicySettings(**bad)


def test_below_minimum_starts_the_missing_workers_at_once():
    p = ScalingPolicy(PolicySettings(min_workers=3, max_workers=5))
    d = p.decide(Observation(now=0, backlog_chunks=0, workers=(W("a"),)))
    assert d.delta == 2 and "minimum" in d.reason
    # workers still starting count: no second round
    d = p.decide(Observation(now=1, backlog_chunks=0, workers=(W("a"),), starting=2))
    assert d.delta == 0


def test_above_maximum_drains_idle_workers_of_ours_first():
    p = ScalingPolicy(PolicySettings(min_workers=1, max_workers=2))
    ws = (W("a", in_flight=2), W("b", in_flight=0, cpu=80), W("c", in_flight=1), W("d", ours=False))
    d = p.decide(Observation(now=0, backlog_chunks=9, workers=ws))
    assert d.delta == -2 and d.drain == ("b", "c")  # idle b first, then the least busy; never d (not ours)


def test_scale_up_needs_a_sustained_backlog_then_cools_down():
    p = ScalingPolicy(FAST)
    busy = (W("a", in_flight=2),)
    assert p.decide(Observation(now=0, backlog_chunks=12, workers=busy)).delta == 0  # 10 waiting, just seen
    assert p.decide(Observation(now=1, backlog_chunks=12, workers=busy)).delta == 0
    d = p.decide(Observation(now=2.5, backlog_chunks=12, workers=busy))
    assert d.delta == 2 and "waiting" in d.reason  # ceil(10 / 4) = 3, capped at max_step_up 2
    # the new workers are starting: nothing more
    assert p.decide(Observation(now=3, backlog_chunks=12, workers=busy, starting=2)).delta == 0
    three = busy + (W("b", in_flight=2), W("c", in_flight=2))
    for t in (20, 21):
        assert p.decide(Observation(now=t, backlog_chunks=16, workers=three)).delta == 0  # cooldown / sustain
    d = p.decide(Observation(now=22.5, backlog_chunks=16, workers=three))
    assert d.delta == 1 and "waiting" in d.reason  # capped by max 4
    four = three + (W("d", in_flight=2),)
    d = p.decide(Observation(now=40, backlog_chunks=30, workers=four))
    assert d.delta == 0 and "maximum" in d.reason


def test_all_workers_busy_with_waiting_chunks_is_behind():
    """Algorithm 5 gives nothing to a worker at >= 90 % CPU: waiting chunks then wait for a new worker."""
    p = ScalingPolicy(FAST)
    ws = (W("a", cpu=95, in_flight=0),)
    p.decide(Observation(now=0, backlog_chunks=1, workers=ws))
    d = p.decide(Observation(now=3, backlog_chunks=1, workers=ws))
    assert d.delta == 1 and "CPU" in d.reason
    # one worker below the threshold: not behind with a small queue
    p = ScalingPolicy(FAST)
    ws = (W("a", cpu=95), W("b", cpu=20))
    for t in range(0, 20):
        assert p.decide(Observation(now=t, backlog_chunks=2, workers=ws)).delta == 0


def test_a_backlog_in_flight_on_too_few_workers_is_behind():
    """Adaptive chunking: a busy worker takes every waiting chunk into its next merged job, so the queue
    is empty at most ticks while the backlog (in flight) stays above the threshold per worker."""
    p = ScalingPolicy(FAST)
    for t, waiting in ((0, 3), (1, 0), (2, 3)):  # never more than 4 waiting
        d = p.decide(Observation(now=t, backlog_chunks=12, workers=(W("a", in_flight=12 - waiting),),
                                 ready_chunks=waiting))
    assert d.delta == 1 and "12 chunks in the backlog of 1 worker(s) (threshold 4 per worker)" in d.reason
    # the same backlog over three workers: 4 each, not behind
    p = ScalingPolicy(FAST)
    ws = tuple(W(x, in_flight=4) for x in "abc")
    assert all(p.decide(Observation(now=t, backlog_chunks=12, workers=ws, ready_chunks=0)).delta == 0
               for t in range(10))


def test_scale_down_after_an_idle_period_one_at_a_time():
    p = ScalingPolicy(FAST)
    ws = (W("a", ours=False), W("b", done=5), W("c", done=1, cpu=5))
    for t in range(0, 30, 5):
        assert p.decide(Observation(now=t, backlog_chunks=0, workers=ws)).delta == 0
    d = p.decide(Observation(now=31, backlog_chunks=0, workers=ws))
    assert d == Decision(-1, d.reason, ("c",)) and "idle" in d.reason
    ws2 = (W("a", ours=False), W("b"))
    for t in (32, 50, 61.5):  # idle again from 32: 30 s more, and the cooldown after 31
        assert p.decide(Observation(now=t, backlog_chunks=0, workers=ws2, draining=("c",))).delta == 0
    d = p.decide(Observation(now=62, backlog_chunks=0, workers=ws2))
    assert d.delta == -1 and d.drain == ("b",)
    # at the minimum: never below, and never a worker we do not own
    ws3 = (W("a", ours=False),)
    for t in range(100, 400, 10):
        assert p.decide(Observation(now=t, backlog_chunks=0, workers=ws3)).delta == 0


def test_no_scale_down_with_a_backlog_or_busy_cpu():
    p = ScalingPolicy(FAST)
    ws = (W("a"), W("b"))
    for t in range(0, 200, 5):
        assert p.decide(Observation(now=t, backlog_chunks=1, workers=(W("a", in_flight=1), W("b")))).delta == 0
    p = ScalingPolicy(FAST)
    for t in range(0, 200, 5):
        assert p.decide(Observation(now=t, backlog_chunks=0, workers=(W("a", cpu=70), W("b", cpu=60)))).delta == 0
    # an idle spell interrupted by a little work starts over
    p = ScalingPolicy(FAST)
    p.decide(Observation(now=0, backlog_chunks=0, workers=ws))
    p.decide(Observation(now=25, backlog_chunks=1, workers=(W("a", in_flight=1), W("b"))))
    assert p.decide(Observation(now=40, backlog_chunks=0, workers=ws)).delta == 0  # idle again from 40
    assert p.decide(Observation(now=69, backlog_chunks=0, workers=ws)).delta == 0
    assert p.decide(Observation(now=70, backlog_chunks=0, workers=ws)).delta == -1


def test_load_hovering_at_the_threshold_does_not_flap():
    """A backlog oscillating around up_backlog every tick never holds for up_sustain: no action at all."""
    p = ScalingPolicy(FAST)
    ws = (W("a", in_flight=2), W("b", in_flight=2))
    deltas = []
    for i in range(300):
        backlog = 4 + (9 if i % 2 else 0)  # waiting 0 or 9, alternating each second
        deltas.append(p.decide(Observation(now=i, backlog_chunks=backlog, workers=ws)).delta)
    assert set(deltas) == {0}


def test_ready_chunks_from_the_master_take_precedence():
    obs = Observation(now=0, backlog_chunks=10, workers=(W("a", in_flight=2),), ready_chunks=3)
    assert obs.waiting == 3
    assert Observation(now=0, backlog_chunks=10, workers=(W("a", in_flight=2),)).waiting == 8


def test_observation_from_a_status_reply():
    from strata.deploy.scaler import observation_from_status
    from strata.rpc import strata_pb2 as pb

    st_ = pb.StatusReply(level="S", backlog_chunks=7, ready_chunks=4, workers=[
        pb.WorkerStatus(sid="a:1", cpu=95.0, in_flight=2, chunks_done=4, state="ready"),
        pb.WorkerStatus(sid="b:2", cpu=5.0, in_flight=1, chunks_done=1, state="ready")])
    obs = observation_from_status(st_, 12.0, owned={"b:2": object()}, starting=1, draining={"x:9"})
    assert obs.now == 12.0 and obs.backlog_chunks == 7 and obs.waiting == 4 and obs.size == 3
    assert [(w.sid, w.drainable) for w in obs.workers] == [("a:1", False), ("b:2", True)]


def test_scale_cli_rejects_bad_bounds():
    r = subprocess.run([sys.executable, "-m", "strata", "scale", "--config", "x.toml", "--level", "S", "--master",
                        "127.0.0.1:1", "--user", "u", "--state-dir", "/nonexistent", "--min", "3", "--max", "2"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "min (3) <= max (2)" in r.stderr


RAY_DID_NOT_START = re.compile(r"timed out during startup|Timed out waiting for file .*gcs_server_port")


# ---- policy: properties ---------------------------------------------------------------------------------
bounds = st.tuples(st.integers(0, 4), st.integers(1, 6)).filter(lambda t: t[0] <= t[1])
worker = st.builds(lambda i, cpu, inf, ours, state: W(f"w{i}", cpu=cpu, in_flight=inf, ours=ours, state=state),
                   st.integers(0, 9), st.floats(0, 100), st.integers(0, 3), st.booleans(),
                   st.sampled_from(["ready", "ready", "draining"]))
observation = st.builds(
    lambda ws, backlog, starting, drain_n: Observation(
        now=0.0, backlog_chunks=backlog + sum(w.in_flight for w in ws), workers=tuple(ws), starting=starting,
        draining=tuple(w.sid for w in ws[:drain_n])),
    st.lists(worker, max_size=8, unique_by=lambda w: w.sid), st.integers(0, 40), st.integers(0, 3),
    st.integers(0, 2))


@st.composite
def runs(draw):
    lo, hi = draw(bounds)
    s = PolicySettings(min_workers=lo, max_workers=hi, up_backlog=draw(st.integers(1, 6)),
                       up_sustain=draw(st.sampled_from([0, 1, 2.5])), up_cooldown=draw(st.sampled_from([0, 5, 10])),
                       max_step_up=draw(st.integers(1, 3)), down_idle=draw(st.sampled_from([0, 3, 30])),
                       down_cooldown=draw(st.sampled_from([0, 4, 30])))
    steps = draw(st.lists(st.tuples(st.floats(0.1, 20), observation), min_size=1, max_size=25))
    return s, steps


def _check(s: PolicySettings, obs: Observation, d: Decision) -> None:
    n = obs.size
    after = n + d.delta
    if n < s.min_workers:
        assert d.delta == s.min_workers - n
    elif n > s.max_workers:
        assert d.delta <= 0 and after >= s.max_workers
    else:
        assert s.min_workers <= after <= s.max_workers, (n, d)
    if d.delta < 0:
        live = {w.sid: w for w in obs.live}
        assert len(d.drain) == -d.delta == len(set(d.drain))
        assert all(sid in live and live[sid].drainable and live[sid].state == "ready" for sid in d.drain)
        if n <= s.max_workers:  # never scale down while work is queued
            assert obs.backlog_chunks <= s.down_backlog and obs.waiting == 0
        chosen_busy = any(live[sid].in_flight > 0 for sid in d.drain)
        idle_left = [w for w in obs.live if w.drainable and w.state == "ready" and w.in_flight == 0
                     and w.sid not in d.drain]
        assert not (chosen_busy and idle_left), "an idle worker of ours was passed over"
    else:
        assert d.drain == ()
    if d.delta > 0 and n >= s.min_workers:
        assert obs.starting == 0 and d.delta <= s.max_step_up


@settings(max_examples=300, deadline=None)
@given(runs())
def test_property_bounds_and_no_scale_down_under_backlog(run):
    s, steps = run
    p = ScalingPolicy(s)
    now = 0.0
    for dt, obs in steps:
        now += dt
        obs = Observation(now=now, backlog_chunks=obs.backlog_chunks, workers=obs.workers, starting=obs.starting,
                          draining=obs.draining)
        _check(s, obs, p.decide(obs))


@st.composite
def closed_loop(draw):
    lo, hi = draw(bounds)
    s = PolicySettings(min_workers=lo, max_workers=hi, up_backlog=draw(st.integers(1, 6)),
                       up_sustain=draw(st.sampled_from([1, 2.5])), up_cooldown=draw(st.sampled_from([0, 5])),
                       down_idle=draw(st.sampled_from([3, 30])), down_cooldown=draw(st.sampled_from([4, 30])))
    start = draw(st.integers(lo, hi))
    load = draw(st.lists(st.tuples(st.integers(0, 30), st.floats(0, 100)), min_size=1, max_size=60))
    return s, start, load


@settings(max_examples=200, deadline=None)
@given(closed_loop())
def test_property_closed_loop_stays_in_bounds_and_spaces_opposite_actions(case):
    """Decisions applied to a simulated group: always within [min, max]; a scale-down
    never follows a scale-up within down_cooldown, nor a scale-up a scale-down within up_sustain;
    a constant load moves the group in one direction only."""
    s, start, load = case
    for constant in (False, True):
        p = ScalingPolicy(s)
        group = [W(f"s{i}", ours=True) for i in range(start)]
        next_id = start
        actions: list[tuple[float, int]] = []
        for i in range(len(load) * (4 if constant else 1)):
            waiting, cpu = load[0] if constant else load[i]
            now = i * 1.0
            ws = tuple(W(w.sid, cpu=cpu) for w in group)
            obs = Observation(now=now, backlog_chunks=waiting, workers=ws)
            d = p.decide(obs)
            _check(s, obs, d)
            if d.delta > 0:
                group += [W(f"s{next_id + j}") for j in range(d.delta)]
                next_id += d.delta
            elif d.delta < 0:
                group = [w for w in group if w.sid not in d.drain]
            if d.delta:
                actions.append((now, d.delta))
            assert s.min_workers <= len(group) <= s.max_workers
        for (t0, a), (t1, b) in zip(actions, actions[1:]):
            if a > 0 > b:
                assert t1 - t0 >= s.down_cooldown
            if a < 0 < b:
                assert t1 - t0 >= s.up_sustain
        if constant:
            signs = {a > 0 for _, a in actions}
            assert len(signs) <= 1, actions


# ---- the worker actor's body, without Ray -----------------------------------------------------------------
FAKE_WORKER = textwrap.dedent("""
    import json, os, signal, subprocess, sys, time
    ready = sys.argv[1]
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # stands in for the JVM
    stop = []
    signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
    with open(ready + ".tmp", "w") as f:
        json.dump({"address": "127.0.0.1:1", "pid": os.getpid(), "child": child.pid}, f)
    os.replace(ready + ".tmp", ready)
    while not stop:
        time.sleep(0.05)
    if os.environ.get("FAKE_HANG"):
        while True:
            time.sleep(1)
""")


def _poll(pred, timeout=30.0, interval=0.05):
    return poll(pred, timeout, interval)


@pytest.mark.parametrize("hang", [False, True])
def test_worker_process_spawn_poll_stop(tmp_path, hang):
    from strata.deploy.ray_pool import WorkerProcess

    script = tmp_path / "fake.py"
    script.write_text(FAKE_WORKER)
    ready = tmp_path / "ready.json"
    wp = WorkerProcess([sys.executable, str(script), str(ready)], str(ready), str(tmp_path / "w.log"),
                       env={"FAKE_HANG": "1"} if hang else {})
    pid = wp.spawn()
    st_ = _poll(lambda: wp.poll()["address"] and wp.poll())
    assert st_["address"] == "127.0.0.1:1" and st_["pid"] == pid and st_["returncode"] is None
    child = json.loads(ready.read_text())["child"]
    assert set(_poll(lambda: child in wp.pids() and wp.pids())) >= {pid, child}
    t0 = time.monotonic()
    res = wp.stop(grace=1.0)
    assert res["forced"] is hang and (time.monotonic() - t0) < 12
    assert not alive(pid) and _poll(lambda: not alive(child), 10)  # the process group goes too
    assert not ready.exists()


def test_worker_dies_with_its_actor_process(tmp_path):
    """kill -9 the process owning the WorkerProcess: the worker gets SIGKILL (PR_SET_PDEATHSIG)."""
    script = tmp_path / "fake.py"
    script.write_text(FAKE_WORKER)
    ready = tmp_path / "ready.json"
    owner = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from strata.deploy.ray_pool import WorkerProcess
        wp = WorkerProcess([sys.executable, {str(script)!r}, {str(ready)!r}], {str(ready)!r}, {str(tmp_path / 'w.log')!r})
        print(wp.spawn(), flush=True)
        time.sleep(600)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(owner.stdout.readline())
        assert _poll(lambda: ready.exists())
        owner.kill()
        owner.wait(10)
        assert _poll(lambda: not alive(pid), 10), "worker outlived its actor"
    finally:
        owner.kill()
        child = json.loads(ready.read_text())["child"] if ready.exists() else None
        for p in (pid, child):
            if p and alive(p):
                os.kill(p, signal.SIGKILL)


# ---- end to end: strata scale on a private Ray cluster -------------------------------------------------------
LOOPBACK = {"127.0.0.1", "::ffff:127.0.0.1", "::1"}
# Workers report an injected CPU reading (as in tests/test_cluster_e2e.py) so that "idle" does not depend on
# whatever else loads the test host; the scaled worker inherits it through the scaler's Ray actors.
CPU = {"STRATA_CPU_OVERRIDE": "10"}


def _tree(pid: int) -> set[int]:
    import psutil

    try:
        p = psutil.Process(pid)
        return {p.pid} | {c.pid for c in p.children(recursive=True)}
    except psutil.Error:
        return set()


def _exposed(pids) -> list[tuple]:
    """Sockets of these processes reachable from outside the host: TCP listeners and bound UDP
    sockets on an address that is neither loopback nor a multicast group."""
    import socket as so

    import psutil

    out = []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            cmd = " ".join(proc.cmdline())
            conns = proc.net_connections(kind="inet") if hasattr(proc, "net_connections") else proc.connections("inet")
        except psutil.Error:
            continue
        for c in conns:
            if not c.laddr or c.laddr.ip in LOOPBACK or ipaddress.ip_address(c.laddr.ip).is_multicast:
                continue
            if c.type == so.SOCK_STREAM and c.status == psutil.CONN_LISTEN:
                out.append((pid, cmd[:80], "tcp", c.laddr.ip, c.laddr.port))
            elif c.type == so.SOCK_DGRAM and not c.raddr and "strata worker" not in cmd:
                # (a strata worker's heartbeat *sender* is an unbound UDP socket that sendto() binds to
                # 0.0.0.0:ephemeral -- strata/groups/membership.py, reported separately; everything else must not)
                out.append((pid, cmd[:80], "udp", c.laddr.ip, c.laddr.port))
    return out


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_scaler_adds_a_worker_under_backlog_and_cleans_up(tmp_path):
    import pyarrow as pa

    from strata.client import Client
    from strata.deploy.local import start_cluster, stop_cluster
    from strata.examples import BATTLEFIELD_TOML

    from .helpers import PASSWORD, write_config

    cfg = write_config(tmp_path, BATTLEFIELD_TOML, {"ops": "S"})
    state = tmp_path / "state"
    t_start = time.monotonic()
    masters = start_cluster(str(cfg), ["S"], 1, state, worker_env={0: CPU})
    marks = {"cluster up": time.monotonic() - t_start}
    record = json.loads((state / "cluster.json").read_text())
    first = [p["address"] for p in record["processes"] if p["role"] == "worker"]
    scaler = None
    seen: set[int] = set()
    log = tmp_path / "scaler.log"
    try:
        c = Client(masters["masters"]["S"], tls_dir=masters["tls_dir"], level="S")
        c.login("ops", PASSWORD, "S")
        c.register(["SELECT sid, AVG(bp), COUNT(*) FROM Vitals [ROWS 400] GROUP BY sid",
                    "SELECT V.sid, P.lat FROM Vitals [ROWS 30] V, Positions [NOW] P WHERE V.sid = P.sid"])
        with open(log, "wb") as out:
            scaler = subprocess.Popen(
                [sys.executable, "-m", "strata", "scale", "--config", str(cfg), "--level", "S",
                 "--master", masters["masters"]["S"], "--user", "ops", "--state-dir", str(state), "--min", "1",
                 "--max", "2", "--interval", "0.5", "--up-backlog", "2", "--up-sustain", "1", "--down-idle", "3",
                 "--down-cooldown", "5"],
                stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "STRATA_PASSWORD": PASSWORD, **CPU})
        ts = 0

        def feed(n):
            nonlocal ts
            rows_v, rows_p = [], []
            for _ in range(n):
                ts += 1
                rows_v += [{"ts": ts, "level": "U", "sid": f"s{k % 40}", "bp": float(90 + k % 70), "pr": 1.0,
                            "weight": 1.0} for k in range(120)]
                rows_p += [{"ts": ts, "level": "U", "sid": f"s{k}", "lat": float(k), "lon": "E"} for k in range(40)]
            c.ingest([("Vitals", pa.Table.from_pylist(rows_v)), ("Positions", pa.Table.from_pylist(rows_p))],
                     labelled=True)
            c.advance(upto_ts=ts)

        # let Ray come up before loading the host (its raylet has a fixed 30 s to register)
        up_deadline = time.monotonic() + 300
        while not (state / "run" / "scaler-S.json").exists() and time.monotonic() < up_deadline:
            if scaler.poll() is not None:
                text = log.read_text()
                if RAY_DID_NOT_START.search(text):  # Ray's own start-up, after the pool's retries
                    pytest.skip("Ray itself did not start on this host (its GCS/raylet missed Ray's fixed "
                                "start-up timeouts twice); the scaler was not exercised: " + text[-500:])
                raise AssertionError(text[-3000:])
            time.sleep(0.2)
        # keep a backlog in front of the single worker until a scaled worker has done chunks
        new_sid = None
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            assert scaler.poll() is None, log.read_text()[-3000:]
            seen |= _tree(scaler.pid)
            st_ = c.status()
            if st_.backlog_chunks < 12:
                feed(6)
            others = [w for w in st_.workers if w.sid not in first]
            if others:
                new_sid = others[0].sid
                marks.setdefault("scaled worker joined", time.monotonic() - t_start)
                if others[0].chunks_done > 0:
                    marks["scaled worker did a chunk"] = time.monotonic() - t_start
                    break
            time.sleep(0.2)
        else:
            pytest.fail(f"no scaled worker did chunks; status {c.status()}\n{log.read_text()[-3000:]}")
        state_file = json.loads((state / "run" / "scaler-S.json").read_text())
        mine = [w for w in state_file["workers"] if w["sid"] == new_sid]
        assert mine and mine[0]["pid"] > 0, state_file
        seen |= _tree(scaler.pid) | set(mine[0]["tree"])
        assert mine[0]["pid"] in seen
        # every listener of the scaler's tree (Ray's GCS, raylet, actors, the worker and its JVM) is on loopback
        outside = _exposed(_tree(scaler.pid))
        assert not outside, outside
        text = log.read_text()
        assert "decision +1" in text and "behind" in text, text[-3000:]
        assert len([w for w in c.status().workers]) == 2
        # no more input: the backlog drains, the group idles, and the scaler drains its own worker
        # (never the one it did not start)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and new_sid in {w.sid for w in c.status().workers}:
            assert scaler.poll() is None, log.read_text()[-3000:]
            time.sleep(0.2)
        marks["scaled worker drained"] = time.monotonic() - t_start
        assert [w.sid for w in c.status().workers] == first, log.read_text()[-3000:]
        assert f"draining {new_sid}" in log.read_text() and "decision -1" in log.read_text()
        assert _poll(lambda: not [p for p in mine[0]["tree"] if alive(p)], 30), "drained worker still running"
        c.close()
    finally:
        if scaler is not None:
            seen |= _tree(scaler.pid)
            scaler.send_signal(signal.SIGTERM)
            try:
                scaler.wait(90)
            except subprocess.TimeoutExpired:
                scaler.kill()
                for pid in seen:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except OSError:
                        pass
                pytest.fail("scaler did not stop within 90 s")
        stop_cluster(state)
    marks["scaler stopped"] = time.monotonic() - t_start
    left = _poll(lambda: not [p for p in seen if alive(p)], 20) or [p for p in seen if alive(p)]
    if left is not True:
        for pid in left:  # leave nothing running, then fail
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    assert left is True, f"processes left behind: {left}"
    assert scaler.returncode == 0, log.read_text()[-3000:]
    assert "Ray cluster of level S stopped" in log.read_text()
    assert not (state / "run" / "scaler-S.json").exists()
    ray_dir = state / "ray" / "S"
    assert not ray_dir.is_symlink() or not ray_dir.exists()
    print("scaler end-to-end: " + ", ".join(f"{k} at {v:.0f} s" for k, v in marks.items()))


def test_pool_workers_report_their_own_load(tmp_path):
    """A pool's workers share one host: by default each reports its own processes' CPU
    (worker/load.py), so neither the shared host nor another level's load drives scaling."""
    from strata.deploy.ray_pool import worker_command

    cmd = worker_command("c.toml", "S", tmp_path, tmp_path / "r.json")
    assert cmd[cmd.index("--load-reading") + 1] == "process"
    assert "--load-reading" not in worker_command("c.toml", "S", tmp_path, tmp_path / "r.json", load_reading=None)
    assert worker_command("c.toml", "S", tmp_path, tmp_path / "r.json", load_reading="host")[-1] == "host"
