"""The trusted processes' scheduler (strata/turns.py, issue 33): levels take turns inside one process.

* The admission rule and the readings, step by step on a hand-driven clock (no thread).
* A call of each policy on a real round thread with fake work (sleeps, short slots): who may start
  when, per algorithm (fixed slot, revised fixed slot, round robin, dynamic threshold).
* The promise, measured (``slow``): a trusted :class:`~strata.worker.service.WorkerCore` of S and TS
  with the test session's Spark; S sends a light chunk once a round at a fixed phase of the round, in
  blocks alternately while a TS thread keeps the worker busy with heavy chunks and while TS is idle.
  Under ``fixed_slot`` S's latency does not depend on TS's load (the block difference within
  :data:`TOLERANCE`); under ``round_robin`` it does (S waits for TS's quantum): the channel the slot
  policies close.  Every S result equals the expected rows.
"""

from __future__ import annotations

import statistics
from collections import deque
import threading
import time

import pyarrow as pa
import pytest

from strata.chunking.codec import decode_result, encode_chunk
from strata.config import parse_config
from strata.examples import BATTLEFIELD_TOML
from strata.master.pipeline import QueryPipeline
from strata.scheduling import Scheduler
from strata.worker.service import QuerySpecData, WorkerCore
from strata.turns import LOWER_GRACE, OVERLONG_START, Turns, grid_start, make_turns

from .polling import wait_for


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def lattice():
    return parse_config(BATTLEFIELD_TOML).lattice


def turns(policy: str, slot=0.25, clock=None, **kw) -> Turns:
    lat = lattice()
    return Turns(Scheduler(policy, ("S", "TS"), lat.leq, slot_seconds=slot, max_pause=float("inf"), seed=1, **kw),
                 clock=clock or time.monotonic)


# ---- the admission rule and the readings, on a hand-driven clock ------------------------------------------
def hand_round():
    """A fixed-slot round of S and TS on a hand-driven clock: (clock, turns, plan, timeline)."""
    c = Clock()
    t = turns("fixed_slot", clock=c)
    plan = t.plan_round(c.t)
    return c, t, plan, plan.timeline()


def test_a_call_starts_only_in_its_levels_slot_and_when_its_own_estimate_fits_before_its_deadline():
    c, t, plan, tl = hand_round()
    (s0, s1, s_runs), (t0, t1, t_runs) = tl
    assert s_runs == ("S",) and t_runs == ("TS",) and s1 == t0
    t.open_slot(s_runs, s0, s1, tl[1:], plan.end)
    assert t.may_start("S", c.t) and not t.may_start("TS", c.t)
    # S may run on into any slot (every level served dominates S): it has no deadline
    assert t.deadline("S") == float("inf")
    t._recent["S"].extend([0.05, 2.0])  # its longest recent call: 2 s
    c.t = s1 - 0.01
    assert t.may_start("S", c.t)
    c.t = s1
    assert not t.may_start("S", c.t)  # S's slot is over
    # TS's calls must end before the next round's S slot
    t.open_slot(t_runs, t0, t1, (), plan.end)
    assert t.deadline("TS") == t1
    t._recent["TS"].append(0.1)  # needs 0.125 s
    c.t = t0 + 0.1
    assert t.may_start("TS", c.t) and not t.may_start("S", c.t)
    c.t = t0 + 0.15
    assert not t.may_start("TS", c.t)
    # a call longer than all the time to its deadline starts only in the first OVERLONG_START of its slot
    t._recent["TS"].append(0.4)
    c.t = t0 + 0.5 * OVERLONG_START * 0.25
    assert t.may_start("TS", c.t)
    c.t = t0 + 2 * OVERLONG_START * 0.25
    assert not t.may_start("TS", c.t)


def test_a_levels_first_call_of_a_kind_starts_only_at_its_slots_start():
    """No estimate yet: the call may be as long as any, so it starts as an overlong one would (the bottom
    level, without a deadline, at any time)."""
    c, t, plan, tl = hand_round()
    (s0, s1, s_runs), (t0, t1, t_runs) = tl
    t.open_slot(s_runs, s0, s1, tl[1:], plan.end)
    c.t = s1 - 0.01
    assert t.may_start("S", c.t)  # S: no deadline
    t.open_slot(t_runs, t0, t1, (), plan.end)
    c.t = t0 + 0.5 * OVERLONG_START * (t1 - t0)
    assert t.may_start("TS", c.t) and t.may_start("TS", c.t, kind="ingest")
    c.t = t0 + 2 * OVERLONG_START * (t1 - t0)
    assert not t.may_start("TS", c.t) and not t.may_start("TS", c.t, kind="ingest")
    t._kinds[("TS", "ingest")] = deque([0.01])  # an ingest batch's estimate: it fits
    assert t.may_start("TS", c.t, kind="ingest") and not t.may_start("TS", c.t)


def test_a_higher_levels_call_waits_for_a_lower_levels_call_that_ran_on_into_its_slot():
    """S's call runs on into TS's slot (it may: TS dominates S); a TS call waits until it has ended instead
    of sharing the worker with it, and is let in as soon as it ends (on a hand-driven clock)."""
    c, t, plan, tl = hand_round()
    (s0, s1, s_runs), (t0, t1, t_runs) = tl
    t._recent["TS"].append(0.001)
    t.open_slot(s_runs, s0, s1, tl[1:], plan.end)
    in_s, release, ts_in = threading.Event(), threading.Event(), threading.Event()

    def s_call():
        with t.turn("S"):
            in_s.set()
            release.wait(10)

    def ts_call():
        with t.turn("TS"):
            ts_in.set()

    s_th = threading.Thread(target=s_call)
    s_th.start()
    assert in_s.wait(5)
    c.t = t0 + 0.001
    t.open_slot(t_runs, t0, t1, (), plan.end)  # TS's slot: S's call still running
    ts_th = threading.Thread(target=ts_call)
    ts_th.start()
    wait_for(lambda: t._waiting["TS"] == 1, 5, "TS's call waiting")
    assert not t.may_start("TS", c.t) and not ts_in.wait(0.1)  # its slot, its estimate fits: S's call runs
    release.set()
    s_th.join(5)
    assert ts_in.wait(5), "TS's call was not let in when S's ended"
    ts_th.join(5)
    assert t.may_start("TS", c.t)


def test_a_waiting_call_starts_once_the_grace_ends_beside_a_lower_call_that_still_runs():
    c, t, plan, tl = hand_round()
    (s0, s1, s_runs), (t0, t1, t_runs) = tl
    t._recent["TS"].append(0.001)
    c.t = t0 + 0.001
    t.open_slot(t_runs, t0, t1, (), plan.end)
    t._running["S"] = 1  # an S call that runs on (and on)
    ts_in = threading.Event()

    def ts_call():
        with t.turn("TS"):
            ts_in.set()

    th = threading.Thread(target=ts_call)
    th.start()
    wait_for(lambda: t._waiting["TS"] == 1, 5, "TS's call waiting")
    assert not ts_in.wait(0.05)
    c.t = t0 + LOWER_GRACE * (t1 - t0)  # no notification: the waiting call wakes by its own timeout
    assert ts_in.wait(5), "TS's call did not start after the grace"
    th.join(5)


def test_the_wait_for_a_lower_levels_call_lasts_the_grace_and_the_slot_opens_when_it_ends():
    """A lower level's call holds a higher level's calls back only for the first LOWER_GRACE of its slot (a
    long S call does not stop TS); "the first share of its slot" of an overlong call or a first call counts
    from when the slot opened for it."""
    c, t, plan, tl = hand_round()
    (s0, s1, s_runs), (t0, t1, t_runs) = tl
    slot = t1 - t0
    t.open_slot(t_runs, t0, t1, (), plan.end)
    t._running["S"] = 1  # S's call ran on into TS's slot
    t._recent["TS"].append(0.001)
    c.t = t0 + 0.9 * LOWER_GRACE * slot
    assert not t.may_start("TS", c.t)
    c.t = t0 + LOWER_GRACE * slot
    assert t.may_start("TS", c.t)  # the grace is over: beside S's call
    t._recent["TS"].append(10.0)  # overlong: only in the first share from the grace's end
    c.t = t0 + (LOWER_GRACE + 0.5 * OVERLONG_START) * slot
    assert t.may_start("TS", c.t)
    c.t = t0 + (LOWER_GRACE + 2 * OVERLONG_START) * slot
    assert not t.may_start("TS", c.t)
    # S's call ends 0.2 of the slot in: the slot opens for TS then
    t._running["S"] = 0
    t._ended["S"] = t0 + 0.2 * slot
    c.t = t0 + (0.2 + 0.5 * OVERLONG_START) * slot
    assert t.may_start("TS", c.t)
    c.t = t0 + (0.2 + 2 * OVERLONG_START) * slot
    assert not t.may_start("TS", c.t)
    t._ended["S"] = t0 - 0.1  # ended before the slot: it opened at its start
    c.t = t0 + 0.5 * OVERLONG_START * slot
    assert t.may_start("TS", c.t)


def test_the_deadline_is_the_next_slot_of_a_level_that_does_not_dominate_the_caller():
    c = Clock()
    # A and B incomparable, T above both
    t = Turns(Scheduler("fixed_slot", ("A", "B", "T"), lambda a, b: a == b or b == "T", slot_seconds=0.25,
                        max_pause=float("inf")), clock=c)
    plan = t.plan_round(c.t)
    tl = plan.timeline()
    t.open_slot(tl[0][2], tl[0][0], tl[0][1], tl[1:], plan.end)
    assert tl[0][2] == ("A",) and t.deadline("A") == tl[1][0]  # not into B's slot
    t.open_slot(tl[1][2], tl[1][0], tl[1][1], tl[2:], plan.end)
    assert t.deadline("B") == plan.end  # on into T's slot (T dominates B), not into the next round's A slot


def test_readings_are_each_levels_own_calls():
    c = Clock()
    t = turns("round_robin", clock=c)
    t.open_slot(("S", "TS"), c.t, c.t + 10)
    with t.turn("TS"):
        c.t += 0.3
        r = t.readings(c.t)  # a round ends while TS's call runs: its time so far counts, it is pending
    assert r["TS"].cpu_seconds == pytest.approx(0.3) and r["TS"].pending
    assert r["S"].cpu_seconds == 0 and not r["S"].pending
    with t.turn("S"):
        c.t += 0.1
    r = t.readings(c.t)
    assert r["S"].cpu_seconds == pytest.approx(0.1) and not r["S"].pending
    assert r["TS"].cpu_seconds == 0  # TS's call ended before this round
    assert t.stats("S") == {"policy": "round_robin", "calls": 1, "waited_ms": 0}
    assert t.stats("TS")["calls"] == 1  # each level's figures its own
    with pytest.raises(ValueError, match="no turns for level C"):
        with t.turn("C"):
            pass


def test_an_overrun_is_counted_for_its_level_only():
    c = Clock()
    t = turns("fixed_slot", clock=c)
    t.open_slot(("TS",), c.t, c.t + 0.25)
    with t.turn("TS"):
        c.t += 0.4
    assert t.stats("TS")["overruns"] == 1 and t.stats("TS")["overrun_ms"] == 150
    assert "overruns" not in t.stats("S")


def test_make_turns_reads_the_cluster_settings():
    cfg = parse_config(BATTLEFIELD_TOML + '\n[cluster]\nscheduler = "revised_fixed_slot"\nslot_seconds = 0.1\n')
    t = make_turns(cfg.cluster, cfg.lattice, ("TS", "S"))
    try:
        assert t.scheduler.policy == "revised_fixed_slot" and t.levels == ("S", "TS")
        assert t.scheduler.slot_seconds == 0.1
    finally:
        t.stop()
    assert make_turns(cfg.cluster, cfg.lattice, ("TS",)) is None
    assert make_turns(parse_config(BATTLEFIELD_TOML).cluster, cfg.lattice, ("S", "TS")) is None  # shared


def test_grid_start_is_the_next_multiple_of_the_period_on_the_wall_clock():
    assert grid_start(10.0, 0.5, 1000.2) == pytest.approx(10.3)  # wall 1010.2 -> 1010.5
    assert grid_start(10.0, 0.5, 1000.0) == pytest.approx(10.0)  # on the grid already: now
    assert grid_start(3.0, 0.75, -2.0) == pytest.approx(3.5)  # wall 1.0 -> 1.5


def test_make_turns_puts_the_rounds_on_the_epochs_grid():
    """Two processes' turns (a trusted master and its worker) open each level's fixed slot at the same
    moments: every slot starts on a multiple of the round's length of the wall clock."""
    cfg = parse_config(BATTLEFIELD_TOML + '\n[cluster]\nscheduler = "fixed_slot"\nslot_seconds = 0.05\n')
    a, b = make_turns(cfg.cluster, cfg.lattice, ("S", "TS")), make_turns(cfg.cluster, cfg.lattice, ("TS", "S"))
    try:
        wait_for(lambda: a.rounds >= 3 and b.rounds >= 3, 10, "three rounds")
        for t in (a, b):
            with t.turn("TS"):
                runs, start, end, _ = t.admissions["TS"][-1]
            wall = start + time.time() - time.monotonic()
            assert runs == ("TS",) and end - start == pytest.approx(0.05)
            assert abs(wall - 0.05 - round((wall - 0.05) / 0.1) * 0.1) < 0.005  # S's slot first, then TS's
    finally:
        a.stop()
        b.stop()


# ---- each policy on a real round thread, fake work ---------------------------------------------------------
def _calls(t: Turns, level: str, n: int, work: float, gap: float = 0.0) -> list[tuple[float, float]]:
    """``n`` calls of ``level`` one after the other: (asked, started) of each, monotonic."""
    out = []
    for _ in range(n):
        asked = time.monotonic()
        with t.turn(level):
            out.append((asked, time.monotonic()))
            time.sleep(work)
        if gap:
            time.sleep(gap)
    return out


def _busy(t: Turns, level: str, stop: threading.Event, work: float) -> threading.Thread:
    def run():
        while not stop.is_set():
            with t.turn(level):
                time.sleep(work)
    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th


def test_fixed_slot_starts_each_level_in_its_own_slot_whatever_the_other_does():
    t = turns("fixed_slot", slot=0.05).start()
    stop = threading.Event()
    try:
        _calls(t, "S", 10, 0.005, gap=0.013)
        th = _busy(t, "TS", stop, 0.01)
        _calls(t, "S", 10, 0.005, gap=0.013)
        stop.set()
        th.join()
        # every call started in a slot of its own level alone, within it
        for lv in ("S", "TS"):
            assert t.admissions[lv] and all(runs == (lv,) and a <= t0 < b for runs, a, b, t0 in t.admissions[lv])
        assert len(t.admissions["S"]) == 20 and t.stats("TS")["calls"] > 5
        # S's slots are on one grid of the clock, a round apart: whatever TS did
        period = 2 * 0.05
        starts = sorted({a for _, a, _, _ in t.admissions["S"]})
        assert all(abs((b - starts[0]) / period - round((b - starts[0]) / period)) < 1e-6 for b in starts) \
            or max(t.late_edges) > 0.05  # (the round thread restarts its grid only after a stall of a slot)
    finally:
        t.stop()


def test_revised_fixed_slot_lends_an_idle_lower_slot_upward_only():
    t = turns("revised_fixed_slot", slot=0.05).start()
    stop = threading.Event()
    try:
        th = _busy(t, "TS", stop, 0.01)
        # S idle: its slot goes to TS (TS runs in both slots of a round)
        wait_for(lambda: t.scheduler.last is not None and t.scheduler.last.ran("TS") == pytest.approx(0.1),
                 timeout=5, what="TS running in S's idle slot too")
        # S with work: it gets its slot back at a round's start, and TS never gets it while S has work
        s = _calls(t, "S", 6, 0.005, gap=0.0)
        assert all(started - asked < 0.2 for asked, started in s)
        stop.set()
        th.join()
    finally:
        t.stop()


def test_round_robin_makes_a_lower_level_wait_for_a_busy_higher_one():
    t = turns("round_robin", slot=0.05).start()
    stop = threading.Event()
    try:
        wait_for(lambda: t.rounds > 2, timeout=5, what="the first rounds (each level's first probe)")
        idle = [b - a for a, b in _calls(t, "S", 12, 0.003, gap=0.037)]
        th = _busy(t, "TS", stop, 0.01)
        busy = [b - a for a, b in _calls(t, "S", 12, 0.003, gap=0.037)]
        stop.set()
        th.join()
        # idle: everyone runs together, S at once; busy: S waits for the rest of TS's quantum (0.05 s)
        assert statistics.mean(busy) > statistics.mean(idle) + 0.004, (idle, busy)
    finally:
        t.stop()


def test_dynamic_threshold_penalises_a_level_that_takes_the_rounds():
    t = turns("dynamic_threshold", slot=0.05, threshold=0.6, share=(0.3, 0.3), rounds=(3, 3)).start()
    stop = threading.Event()
    try:
        th = _busy(t, "TS", stop, 0.01)
        # S has a little work all along (a call of 6 ms every 20 ms): TS takes most of each round
        s = threading.Thread(target=lambda: [_calls(t, "S", 1, 0.006, gap=0.02) for _ in iter(stop.is_set, True)],
                             daemon=True)
        s.start()
        wait_for(lambda: "TS" in t.scheduler.penalties, timeout=10, what="TS penalised")
        assert t.scheduler.penalties["TS"].share == 0.3 and "S" not in t.scheduler.penalties
        stop.set()
        th.join()
        s.join()
    finally:
        t.stop()


def test_stop_lets_every_waiting_call_run():
    t = turns("fixed_slot", slot=1.0)
    t.open_slot(("TS",), time.monotonic(), time.monotonic() + 60)
    done = threading.Event()

    def s_call():
        with t.turn("S"):
            done.set()
    th = threading.Thread(target=s_call, daemon=True)
    th.start()
    assert not done.wait(0.05)
    t.stop()
    assert done.wait(5)


# ---- the promise, measured with Spark --------------------------------------------------------------------
SLOT = 0.5  # a Spark call here takes 0.05-0.3 s (more under load): a slot holds several
ROUND = 2 * SLOT
PHASES = 6  # S's sends in a block: one a round, each at the next phase of the round
BLOCKS = 1  # blocks per condition, alternating busy and idle
#: the most TS's load may move S's mean wait for its turn in a block under fixed slots (s): what the scheduler
#: decides, from the clock alone; the thread wake-ups and S's own estimate (its calls slowed by TS's overruns)
WAIT_TOLERANCE = 0.05
#: the most TS's load may move S's mean latency in a block under fixed slots, besides TS's overruns (below): a
#: quarter of a slot (the process's other shared parts: the interpreter's lock, the JVM's collector, caches)
TOLERANCE = SLOT / 4


def _chunks(cfg, level: str, text: str, rows: list[tuple[int, str]], n: int):
    p = QueryPipeline(cfg, level)
    qid = p.add_query(text)[0]
    p.ingest("Vitals", pa.table({"ts": pa.array([t for t, _ in rows], pa.int64()), "level": [lv for _, lv in rows],
                                 "sid": [f"s{i % 50}" for i in range(len(rows))],
                                 "bp": [float(i % 97) for i in range(len(rows))], "pr": [1.0] * len(rows),
                                 "weight": [1.0] * len(rows)}))
    chunks = p.finish()
    return [QuerySpecData(qid, text, level)], [encode_chunk(c) for c in chunks][:n]


def _measure(core: WorkerCore, s_specs, s_chunk, ts_specs, ts_chunks) -> dict:
    """S's waits and latencies per block, alternately with TS busy and idle; S's sends phase-locked to the
    round, one a round, the i-th of every block at the same phase."""
    turns_ = core.turns
    out = {"busy": [], "idle": [], "busy_wait": [], "idle_wait": [], "overrun": 0.0}
    first = turns_.scheduler.last.start
    for block in range(2 * BLOCKS):
        cond = "busy" if block % 2 == 0 else "idle"
        stop = threading.Event()
        th = None
        if cond == "busy":
            def load():
                i = 0
                while not stop.is_set():
                    core.execute("TS", ts_specs, ts_chunks[i % len(ts_chunks)])
                    i += 1
            th = threading.Thread(target=load, daemon=True)
            th.start()
        lat, waits = [], []
        overrun = turns_.stats("TS").get("overrun_ms", 0)
        base = first + ROUND * (int((time.monotonic() - first) / ROUND) + 2)  # a round of load first
        for i in range(PHASES):
            send = base + i * ROUND + i * ROUND / PHASES
            time.sleep(max(0.0, send - time.monotonic()))  # the send's phase (a measurement design, not a wait)
            waited = turns_.stats("S").get("waited_ms", 0)
            t0 = time.monotonic()
            res = [decode_result(b) for b in core.execute("S", s_specs, s_chunk)]
            lat.append(time.monotonic() - t0)
            waits.append((turns_.stats("S")["waited_ms"] - waited) / 1000)
            assert res[0].error is None and res[0].rows.num_rows == 1
        out[cond].append(statistics.mean(lat))
        out[cond + "_wait"].append(statistics.mean(waits))
        stop.set()
        if th is not None:
            th.join()
        if cond == "busy":  # TS's calls that ran on past their deadline, into S's slot, during the block
            out["overrun"] += (turns_.stats("TS").get("overrun_ms", 0) - overrun) / 1000
    out["difference"] = statistics.median(out["busy"]) - statistics.median(out["idle"])
    out["wait_difference"] = statistics.median(out["busy_wait"]) - statistics.median(out["idle_wait"])
    return out


@pytest.mark.slow
@pytest.mark.spark
def test_fixed_slots_keep_a_lower_levels_timing_from_a_higher_levels_load_and_round_robin_does_not(spark):
    from strata.worker.engine import Engine

    cfg = parse_config(BATTLEFIELD_TOML)
    core = WorkerCore(cfg, "TS", Engine(spark, cfg), levels=("S", "TS"))
    s_specs, s_chunks = _chunks(cfg, "S", "SELECT bp FROM Vitals [NOW]", [(0, "S")], 1)
    ts_text = "SELECT V.sid, COUNT(*) AS n FROM Vitals [RANGE 3] V, Vitals [RANGE 3] W WHERE V.sid = W.sid GROUP BY V.sid"
    ts_specs, ts_chunks = _chunks(cfg, "TS", ts_text, [(t, "TS" if i % 2 else "S") for t in range(4)
                                                       for i in range(100)], 4)
    for _ in range(2):  # the shapes compiled and Spark warm
        core.execute("S", s_specs, s_chunks[0])
        core.execute("TS", ts_specs, ts_chunks[0])
    found = {}
    for policy in ("fixed_slot", "round_robin"):
        core.turns = turns(policy, slot=SLOT).start()
        try:
            wait_for(lambda: core.turns.scheduler.last is not None, timeout=5, what="the first round")
            found[policy] = _measure(core, s_specs, s_chunks[0], ts_specs, ts_chunks)
            found[policy]["ts"] = core.turns.stats("TS")
        finally:
            core.turns.stop()
    print({p: {k: (round(v, 3) if isinstance(v, float) else [round(x, 3) for x in v] if isinstance(v, list) else v)
               for k, v in f.items()} for p, f in found.items()})
    fixed, rr = found["fixed_slot"], found["round_robin"]
    # fixed slots: when S's calls start depends on the clock, not on TS
    assert abs(fixed["wait_difference"]) <= WAIT_TOLERANCE, found
    # ... and S's latency moves only by TS's overruns (a TS call that outlived its slot runs beside S's calls:
    # counted and timed, docs/trusted.md), spread over S's calls of the block, and a quarter of a slot
    assert abs(fixed["difference"]) <= TOLERANCE + fixed["overrun"] / PHASES, found
    # round robin: S waits for the rest of TS's quantum when TS is busy, runs at once when it is idle
    assert rr["wait_difference"] > WAIT_TOLERANCE, found
