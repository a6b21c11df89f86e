"""How level groups sharing a host take turns (issue 33): the plans of strata/scheduling.py on a fake
clock, and the host's gate (deploy/slots.py) against a fake ``kill`` and, without Spark, against
real processes (``sleep``) and real signals.

The plans: each policy's; fixed slot's never depends on any reading; under revised fixed slot no
level's slots depend on the readings of a level it does not dominate (a total order and two partial
orders, randomised), while under round robin they do (the channel it leaves open); revised never
lends downward; dynamic threshold's penalties, their α and β in the configured ranges and their
duration; liveness (no level stays stopped longer than its workers survive) and the round check.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from strata.config import OPTIONS, ClusterSettings, ConfigError, parse_config
from strata.deploy.local import stop_cluster
from strata.deploy.slots import Gate, Record, check_round, continue_all, release
from strata.lattice import Categories, ChineseWall, TotalOrder
from strata.scheduling import (BUSY_FRACTION, POLICIES, PROBE_SECONDS, WORKER_TIMEOUT_SECONDS, Reading, Scheduler,
                               has_work, longest_pause, pause_budget, receiver, round_problem)

from .conftest import BATTLEFIELD_TOML
from .polling import poll, wait_for

BF = TotalOrder(["U", "C", "S", "TS"])
BUSY, IDLE = Reading(1.0), Reading(0.0)


def runs(plan) -> list[tuple]:
    return [(s.runs, s.seconds, s.owner) for s in plan.slots]


def rounds(sched: Scheduler, readings_of, n: int, start: float = 0.0):
    """``n`` plans back to back from ``start`` (the fake clock); ``readings_of(i)``: round i's readings."""
    out, now = [], start
    for i in range(n):
        plan = sched.next_round(now, readings_of(i))
        out.append(plan)
        now = plan.end
    return out


# ---- the policies -----------------------------------------------------------------------------------------
def test_fixed_slot_gives_every_level_its_slot_whatever_the_readings():
    sched = Scheduler("fixed_slot", BF.levels, BF.leq, slot_seconds=0.25)
    rng = random.Random(7)
    plans = rounds(sched, lambda i: {lv: Reading(rng.random(), rng.random() < 0.3) for lv in BF.levels
                                     if rng.random() < 0.8}, 50, start=10.0)
    for i, plan in enumerate(plans):
        assert runs(plan) == [(("U",), 0.25, "U"), (("C",), 0.25, "C"), (("S",), 0.25, "S"), (("TS",), 0.25, "TS")]
        assert plan.start == pytest.approx(10.0 + i)  # rounds of 4 x 0.25 s, back to back
    assert plans[0].timeline()[2] == (10.5, 10.75, ("S",))


def test_round_robin_skips_idle_levels_and_lets_everyone_run_when_nobody_has_work():
    sched = Scheduler("round_robin", ("S", "TS"), BF.leq, slot_seconds=0.25, max_pause=100)
    first = sched.next_round(0.0, {})  # nobody ran yet: both are due, each a probe
    assert runs(first) == [(("S",), PROBE_SECONDS, "S"), (("TS",), PROBE_SECONDS, "TS")]
    both = sched.next_round(first.end, {"S": Reading(0.2), "TS": Reading(0.1)})
    assert runs(both) == [(("S",), 0.25, "S"), (("TS",), 0.25, "TS")]
    alone = sched.next_round(both.end, {"S": Reading(0.2), "TS": Reading(0.001)})
    assert runs(alone) == [(("S",), 0.25, "S")]  # TS idle: skipped, S's next quantum comes at once
    nobody = sched.next_round(alone.end, {"S": Reading(0.0)})
    assert runs(nobody) == [(("S", "TS"), 0.25, None)]


def test_round_robin_leaks_a_higher_levels_work_into_a_lower_levels_timing():
    """The channel round robin leaves open: S's quanta come sooner when TS is idle."""
    def s_view(ts_busy: bool) -> list:
        sched = Scheduler("round_robin", ("S", "TS"), BF.leq, slot_seconds=0.25, max_pause=100)
        plans = rounds(sched, lambda i: {"S": BUSY, "TS": BUSY if ts_busy else IDLE}, 6)
        return [(a, b) for p in plans[1:] for a, b, r in p.timeline() if "S" in r]

    assert s_view(True) != s_view(False)


def test_revised_fixed_slot_lends_an_idle_slot_upward_never_downward():
    sched = Scheduler("revised_fixed_slot", BF.levels, BF.leq, slot_seconds=0.25, max_pause=100)
    sched.next_round(0.0, {})
    plan = sched.next_round(1.0, {"U": IDLE, "C": BUSY, "S": IDLE, "TS": BUSY})
    # U's slot to the first level above it with work (C); S's to TS; the round keeps its length
    assert runs(plan) == [(("C",), 0.25, "U"), (("C",), 0.25, "C"), (("TS",), 0.25, "S"), (("TS",), 0.25, "TS")]
    waiting = Reading(0.0, pending=True)  # U and S did not run: input waiting for them is their work
    plan = sched.next_round(2.0, {"U": waiting, "C": BUSY, "S": waiting, "TS": IDLE})
    # an idle TS lends to nobody: no level dominates it, and a lower one never gets a higher one's slot
    assert runs(plan) == [(("U",), 0.25, "U"), (("C",), 0.25, "C"), (("S",), 0.25, "S"), ((), 0.25, "TS")]


def test_receiver_needs_a_level_that_dominates_every_candidate_before_it():
    lat = Categories(["U", "S"], ["A", "B"])
    lv = {t: lat.parse(t) for t in ("(U,{})", "(U,{A})", "(U,{B})", "(S,{})", "(U,{A,B})", "(S,{A,B})")}
    busy = {lv["(U,{B})"], lv["(S,{A,B})"]}
    # (U,{}) idle: (U,{A}) is first but idle; (U,{B}) has work but does not dominate (U,{A}): skipped
    got = receiver(lv["(U,{})"], lat.levels, lat.leq, busy.__contains__)
    assert got == lv["(S,{A,B})"]
    assert receiver(lv["(U,{})"], lat.levels, lat.leq, {lv["(U,{A})"]}.__contains__) == lv["(U,{A})"]
    assert receiver(lat.top, lat.levels, lat.leq, lambda x: True) is None


def interference(lattice, policy: str) -> tuple[list[str], int]:
    """The levels whose slots differ between two schedulers fed the same readings for the levels each
    dominates and independent random readings for every other level (non-interference fails for
    them), and how many slots were lent."""
    levels, leaky, lent = lattice.levels, [], 0
    longest = len(levels) * 0.25
    for level in levels:
        mine = {x for x in levels if lattice.leq(x, level)}
        rng_a, rng_b, shared = random.Random(1), random.Random(2), random.Random(3)
        a, b = (Scheduler(policy, levels, lattice.leq, slot_seconds=0.25, max_pause=3 * longest + 1, seed=9)
                for _ in range(2))
        now_a = now_b = 0.0
        for _ in range(40):
            common = {x: Reading(shared.choice([0.0, 0.3]), shared.random() < 0.1) for x in mine}

            def other(rng):
                return {x: Reading(rng.choice([0.0, 0.3]), rng.random() < 0.1) for x in levels if x not in mine}

            pa, pb = a.next_round(now_a, {**common, **other(rng_a)}), b.next_round(now_b, {**common, **other(rng_b)})
            lent += sum(1 for sl in pa.slots if sl.runs and sl.runs != (sl.owner,))
            if [(t0, t1) for t0, t1, r in pa.timeline() if level in r] != \
                    [(t0, t1) for t0, t1, r in pb.timeline() if level in r]:
                leaky.append(level)
                break
            now_a, now_b = pa.end, pb.end
    return leaky, lent


LATTICES = [BF, Categories(["U", "S"], ["A", "B"]), ChineseWall([["1", "2"], ["A"]])]


@pytest.mark.parametrize("lattice", LATTICES, ids=["total", "categories", "chinese-wall"])
def test_under_the_slot_policies_no_level_s_slots_depend_on_a_level_it_does_not_dominate(lattice):
    assert interference(lattice, "fixed_slot") == ([], 0)
    leaky, lent = interference(lattice, "revised_fixed_slot")
    assert leaky == [] and lent > 0  # slots were lent, always upward


@pytest.mark.parametrize("lattice", LATTICES, ids=["total", "categories", "chinese-wall"])
def test_under_round_robin_and_dynamic_threshold_they_do(lattice):
    """The negative control of the test above: the channels these policies leave open."""
    for policy in ("round_robin", "dynamic_threshold"):
        leaky, _ = interference(lattice, policy)
        assert lattice.bottom in leaky, policy


def test_dynamic_threshold_penalises_a_level_that_takes_the_round_for_beta_rounds():
    sched = Scheduler("dynamic_threshold", ("S", "TS"), BF.leq, slot_seconds=0.25, max_pause=100,
                      threshold=0.8, share=(0.3, 0.8), rounds=(2, 4), seed=42)
    sched.next_round(0.0, {})
    plan = sched.next_round(1.0, {"S": Reading(0.03), "TS": Reading(0.24)})  # TS: 89 % of the CPU, S had work
    pen = sched.penalties.get("TS")
    assert pen is not None and "S" not in sched.penalties
    beta = pen.rounds + 1  # this round was its first
    alpha = runs(plan)[1][1] / 0.25
    assert 0.3 <= alpha <= 0.8 and 2 <= beta <= 4 and runs(plan)[0] == (("S",), 0.25, "S")
    n = 1
    while "TS" in sched.penalties:  # it lasts its beta rounds whatever TS does meanwhile
        plan = sched.next_round(plan.end, {"S": Reading(0.1), "TS": Reading(0.05)})
        assert runs(plan)[1][1] == pytest.approx(alpha * 0.25)
        n += 1
    assert n == beta
    plan = sched.next_round(plan.end, {"S": Reading(0.1), "TS": Reading(0.05)})
    assert runs(plan) == [(("S",), 0.25, "S"), (("TS",), 0.25, "TS")]  # over: a full quantum again
    # the same seed draws the same penalties; only one level with work is never penalised
    again = Scheduler("dynamic_threshold", ("S", "TS"), BF.leq, slot_seconds=0.25, max_pause=100, seed=42,
                      rounds=(2, 4))
    again.next_round(0.0, {})
    again.next_round(1.0, {"S": Reading(0.03), "TS": Reading(0.24)})
    assert again.penalties["TS"].share == pytest.approx(alpha)
    alone = Scheduler("dynamic_threshold", ("S", "TS"), BF.leq, slot_seconds=0.25, max_pause=100, seed=1)
    alone.next_round(0.0, {})
    alone.next_round(1.0, {"S": Reading(0.0), "TS": Reading(0.25)})
    assert not alone.penalties


def test_penalty_draws_stay_in_their_ranges():
    sched = Scheduler("dynamic_threshold", ("S", "TS"), BF.leq, slot_seconds=0.25, max_pause=100, seed=3,
                      share=(0.3, 0.8), rounds=(1, 10))
    seen = []
    now = 0.0
    for _ in range(300):
        plan = sched.next_round(now, {"S": Reading(0.03), "TS": Reading(0.24)})
        if "TS" in sched.penalties:
            seen.append((sched.penalties["TS"].share, sched.penalties["TS"].rounds))
        now = plan.end
    assert seen and all(0.3 <= a <= 0.8 and 0 <= b < 10 for a, b in seen)


@pytest.mark.parametrize("policy", [p for p in POLICIES if p != "shared"])
def test_no_level_stays_stopped_longer_than_its_workers_survive(policy):
    levels = BF.levels
    assert round_problem(policy, len(levels), 0.25, 0.5) is None
    sched = Scheduler(policy, levels, BF.leq, slot_seconds=0.25, heartbeat_seconds=0.5, seed=5)
    rng = random.Random(11)
    last_run: dict[str, float] = {}
    worst = 0.0
    for plan in rounds(sched, lambda i: {lv: Reading(rng.choice([0.0, 0.0, 0.2])) for lv in levels}, 400):
        for t0, t1, r in plan.timeline():
            for lv in r:
                worst = max(worst, t0 - last_run.get(lv, t0))
                last_run[lv] = t1
    assert worst <= pause_budget(0.5) + 1e-9
    assert worst <= longest_pause(policy, len(levels), 0.25) + 1e-9


def test_the_round_check_refuses_rounds_too_long_for_the_heartbeats_in_one_line(tmp_path):
    assert round_problem("fixed_slot", 2, 0.25, 0.5) is None
    msg = round_problem("round_robin", 5, 0.25, 0.5)
    assert msg and "\n" not in msg and "slot_seconds <= 0.2" in msg, msg
    assert round_problem("fixed_slot", 5, 0.6, 0.5)  # stopped for 2.4 s while 4 other levels run
    assert round_problem("shared", 50, 1.0, 0.5) is None
    cfg = tmp_path / "strata.toml"
    cfg.write_text(BATTLEFIELD_TOML + '\n[cluster]\nscheduler = "round_robin"\nslot_seconds = 0.5\n')
    from strata.config import load_config

    with pytest.raises(ConfigError) as e:
        check_round(load_config(cfg), 4)
    assert str(e.value).startswith(f"{cfg}: [cluster] slot_seconds = 0.5: round_robin with 4 levels")
    check_round(load_config(cfg), 1)


def test_the_copied_worker_timeout_is_the_masters():
    import inspect

    from strata.master.core import MasterCore
    from strata.master.dispatch import Dispatcher

    assert inspect.signature(MasterCore.__init__).parameters["worker_timeout"].default == WORKER_TIMEOUT_SECONDS
    assert Dispatcher().timeout == WORKER_TIMEOUT_SECONDS
    # a master's group table forgets a peer after max(3, 4 x heartbeat_seconds) (membership.py): no sooner
    assert "timeout=max(3.0, 4 * spec.interval)" in (Path(__file__).parents[1] / "strata" / "groups" /
                                                    "membership.py").read_text()


def test_work_is_input_waiting_or_cpu_use():
    assert has_work(Reading(0.0, pending=True), 0.0)
    assert not has_work(Reading(0.5), 0.0)  # it did not run: CPU it used is not this round's
    assert has_work(Reading(BUSY_FRACTION * 0.25), 0.25) and not has_work(Reading(0.01), 0.25)
    assert not has_work(None, 0.25)


def test_the_settings_declare_the_policies_and_their_ranges():
    scheduler = next(o for o in OPTIONS if (o.section, o.name) == ("cluster", "scheduler"))
    assert all(scheduler.check.ok(p) for p in POLICIES) and not scheduler.check.ok("fair")
    c = parse_config(BATTLEFIELD_TOML + '\n[cluster]\nscheduler = "dynamic_threshold"\nslot_seconds = 0.1\n'
                     'penalty_threshold = 0.7\npenalty_share = [0.5, 0.5]\npenalty_rounds = [3, 3]\n').cluster
    assert (c.scheduler, c.slot_seconds, c.penalty_threshold, c.penalty_share, c.penalty_rounds) == \
        ("dynamic_threshold", 0.1, 0.7, (0.5, 0.5), (3, 3))
    assert ClusterSettings().scheduler == "shared"


# ---- the gate, with a fake kill ----------------------------------------------------------------------------
def write_record(state: Path, procs: list[dict]) -> None:
    state.mkdir(parents=True, exist_ok=True)
    (state / "cluster.json").write_text(json.dumps({"config": "x", "processes": procs}))


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_the_gate_stops_and_continues_each_level_by_the_plan(tmp_path):
    write_record(tmp_path, [{"name": "master-S", "role": "master", "level": "S", "pid": 11},
                            {"name": "worker-S-0", "role": "worker", "level": "S", "pid": 12},
                            {"name": "master-TS", "role": "master", "level": "TS", "pid": 21},
                            {"name": "slots", "role": "gate", "level": "host", "pid": 99}])
    sent = []
    clock = FakeClock()
    gate = Gate(Record(tmp_path), Scheduler("fixed_slot", ("S", "TS"), BF.leq, slot_seconds=0.25),
                kill=lambda pid, sig: sent.append((pid, sig, clock.now)), clock=clock, sleep=clock.sleep)
    gate.run(rounds=2)
    STOP, CONT = signal.SIGSTOP, signal.SIGCONT
    assert sent[:6] == [(21, STOP, 100.0),  # S's slot: TS stopped (S runs already)
                        (11, STOP, 100.25), (12, STOP, 100.25), (21, CONT, 100.25),  # TS's: S stopped first
                        (21, STOP, 100.5), (11, CONT, 100.5)]
    assert all(pid != 99 for pid, _, _ in sent)  # the gate never signals itself
    # the end: every process group it knows is continued
    assert sorted((pid, sig) for pid, sig, _ in sent[-3:]) == [(11, CONT), (12, CONT), (21, CONT)]
    assert not gate.stopped


def test_the_gate_continues_everything_when_it_fails_and_when_the_record_goes(tmp_path):
    write_record(tmp_path, [{"name": "master-S", "role": "master", "level": "S", "pid": 11},
                            {"name": "master-TS", "role": "master", "level": "TS", "pid": 21}])
    sent, clock = [], FakeClock()

    def readings(groups, stopped):
        if len(sent) > 3:
            raise RuntimeError("reading failed")
        return {}

    gate = Gate(Record(tmp_path), Scheduler("round_robin", ("S", "TS"), BF.leq, max_pause=100),
                kill=lambda pid, sig: sent.append((pid, sig)), clock=clock, sleep=clock.sleep, readings=readings)
    with pytest.raises(RuntimeError):
        gate.run()
    assert set(sent[-2:]) == {(11, signal.SIGCONT), (21, signal.SIGCONT)} and not gate.stopped

    sent.clear()

    def gone_after(seconds):
        clock.sleep(seconds)
        if clock.now > 102:
            (tmp_path / "cluster.json").unlink(missing_ok=True)

    gate = Gate(Record(tmp_path), Scheduler("fixed_slot", ("S", "TS"), BF.leq),
                kill=lambda pid, sig: sent.append((pid, sig)), clock=clock, sleep=gone_after)
    gate.run()  # ends by itself once the record is gone (strata down)
    assert set(sent[-2:]) == {(11, signal.SIGCONT), (21, signal.SIGCONT)}


def test_a_restarted_process_is_gated_under_its_new_pid(tmp_path):
    procs = [{"name": "master-S", "role": "master", "level": "S", "pid": 11},
             {"name": "master-TS", "role": "master", "level": "TS", "pid": 21}]
    write_record(tmp_path, procs)
    sent, clock = [], FakeClock()
    gate = Gate(Record(tmp_path), Scheduler("fixed_slot", ("S", "TS"), BF.leq),
                kill=lambda pid, sig: sent.append((pid, sig)), clock=clock, sleep=clock.sleep)
    gate.round(clock())
    procs[1]["pid"] = 22
    write_record(tmp_path, procs)
    os.utime(tmp_path / "cluster.json", ns=(1, 1))  # a change the record notices whatever the clock
    gate.round(clock())
    assert (22, signal.SIGSTOP) in sent
    gate.release()
    assert (22, signal.SIGCONT) in sent and (21, signal.SIGCONT) in sent


def test_continue_all_reads_the_record(tmp_path):
    write_record(tmp_path, [{"name": "master-S", "role": "master", "level": "S", "pid": 11},
                            {"name": "slots", "role": "gate", "level": "host", "pid": 99}])
    sent = []
    assert continue_all(tmp_path, kill=lambda pid, sig: sent.append((pid, sig))) == 1
    assert sent == [(11, signal.SIGCONT)]
    assert continue_all(tmp_path / "nowhere") == 0


# ---- the gate with real processes and signals (no Spark) -------------------------------------------------
def state_of(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"


@pytest.fixture
def sleepers(tmp_path):
    """A cluster record of four ``sleep`` processes (each its own process group), levels S and TS, and
    its configuration (fixed slots of 0.1 s)."""
    cfg = tmp_path / "strata.toml"
    cfg.write_text(BATTLEFIELD_TOML + '\n[cluster]\nscheduler = "fixed_slot"\nslot_seconds = 0.1\n')
    procs = []
    for i, level in enumerate(["S", "S", "TS", "TS"]):
        p = subprocess.Popen(["sleep", "120"], start_new_session=True)
        procs.append({"name": f"p{i}", "role": "worker", "level": level, "pid": p.pid, "proc": p})
    state = tmp_path / "state"
    (state / "run").mkdir(parents=True)
    (state / "logs").mkdir()
    (state / "cluster.json").write_text(json.dumps({"config": str(cfg), "processes": [
        {k: v for k, v in p.items() if k != "proc"} for p in procs]}))
    yield state, procs
    for p in procs:
        try:
            os.killpg(p["pid"], signal.SIGCONT)
        except ProcessLookupError:
            pass
        p["proc"].kill()
        p["proc"].wait()


def gate_process(state: Path, *extra) -> subprocess.Popen:
    ready = state / "run" / "gate.json"
    ready.unlink(missing_ok=True)
    g = subprocess.Popen([sys.executable, "-m", "strata", "slots", "--state-dir", str(state), "--ready-file",
                          str(ready), *extra], start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    wait_for(ready.exists, 30, "the gate")
    return g


def test_the_gate_alternates_real_process_groups_and_continues_them_on_sigterm(sleepers):
    state, procs = sleepers
    g = gate_process(state)
    seen = set()

    def both_seen():
        seen.add(tuple(state_of(p["pid"]) for p in procs))
        return ("S", "S", "T", "T") in seen and ("T", "T", "S", "S") in seen

    assert poll(both_seen, 10, 0.01), seen  # S's slot, TS's slot; never both stopped
    assert ("T", "T", "T", "T") not in seen
    os.killpg(g.pid, signal.SIGTERM)
    out = g.communicate(timeout=10)[0].decode()
    assert g.returncode == 0 and "every level's processes run" in out, out
    assert [state_of(p["pid"]) for p in procs] == ["S"] * 4


def test_the_watchdog_continues_everything_when_the_gate_is_killed(sleepers):
    state, procs = sleepers
    g = gate_process(state)
    wait_for(lambda: "T" in [state_of(p["pid"]) for p in procs], 10, "a level stopped")
    os.kill(g.pid, signal.SIGKILL)  # no chance to clean up: its watchdog does
    g.wait()
    wait_for(lambda: [state_of(p["pid"]) for p in procs] == ["S"] * 4, 10, "every process continued")


def test_strata_down_stops_the_gate_first_and_the_rest_after(sleepers):
    state, procs = sleepers
    g = gate_process(state)
    record = json.loads((state / "cluster.json").read_text())
    record["processes"].append({"name": "slots", "role": "gate", "level": "host", "pid": g.pid})
    (state / "cluster.json").write_text(json.dumps(record))
    wait_for(lambda: "T" in [state_of(p["pid"]) for p in procs], 10, "a level stopped")
    t0 = time.monotonic()
    assert stop_cluster(state, timeout=10) == 5
    # a stopped process does not end on SIGTERM (only SIGKILL, after the timeout): continued first, all did
    assert time.monotonic() - t0 < 5
    g.wait(10)
    assert [p["proc"].wait(5) for p in procs] == [-signal.SIGTERM] * 4


def test_release_continues_a_stopped_record_without_a_gate(sleepers):
    state, procs = sleepers
    os.killpg(procs[0]["pid"], signal.SIGSTOP)
    wait_for(lambda: state_of(procs[0]["pid"]) == "T", 5, "stopped")
    release(json.loads((state / "cluster.json").read_text())["processes"])
    wait_for(lambda: state_of(procs[0]["pid"]) == "S", 5, "continued")


def test_strata_slots_refuses_shared_and_a_missing_cluster_in_one_line(tmp_path, sleepers):
    from .helpers import strata

    state, _ = sleepers
    r = strata("slots", "--state-dir", str(tmp_path / "none"))
    assert r.returncode == 1 and r.stderr.strip() == f"strata: no cluster in {tmp_path / 'none'} (no cluster.json; " \
                                                    f"start one with `strata up`)"
    cfg = Path(json.loads((state / "cluster.json").read_text())["config"])
    cfg.write_text(BATTLEFIELD_TOML)
    r = strata("slots", "--state-dir", str(state))
    assert r.returncode == 2 and r.stderr.startswith('strata: [cluster] scheduler is "shared"') and \
        len(r.stderr.strip().splitlines()) == 1
    cfg.write_text(BATTLEFIELD_TOML + '\n[cluster]\nscheduler = "fixed_slot"\nslot_seconds = 1\n'
                                      'heartbeat_seconds = 2\n')
    r = strata("slots", "--state-dir", str(state))
    assert r.returncode == 1 and "stops a level for up to 1.00 s" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_strata_up_starts_no_gate_for_a_single_level(tmp_path, capsys):
    """One level runs in every slot: ``start_gate`` says so and spawns nothing (no record entry)."""
    from strata.deploy.slots import start_gate

    record = {"processes": [{"name": "master-S", "role": "master", "level": "S", "pid": os.getpid()},
                            {"name": "worker-S-0", "role": "worker", "level": "S", "pid": os.getpid()}]}
    assert start_gate(tmp_path, record, "fixed_slot") is None
    assert [p["role"] for p in record["processes"]] == ["master", "worker"]
    assert "one level on this host: no slot gate" in capsys.readouterr().err
    assert not (tmp_path / "cluster.json").exists()
