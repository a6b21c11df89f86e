"""Per-level CPU sets: parsing, validation, pinning (and that Spark's JVM inherits the pin)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from strata.config import ConfigError, parse_config
from strata.cpusets import (CpuSetError, all_level_cpus, available_cpus, check_disjoint, format_cpus, level_cpus,
                            parse_cpus)
from strata.examples import BATTLEFIELD_TOML

CPUS = sorted(available_cpus())


def cfg_with(groups: dict[str, object]):
    text = BATTLEFIELD_TOML
    for level, cpus in groups.items():
        text += f'\n[groups."{level}"]\ncpus = {json.dumps(cpus)}\n'
    return parse_config(text)


# ---- parsing ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, want", [
    ("0", {0}), ("0-1,3", {0, 1, 3}), (" 2 , 4 - 6 ", {2, 4, 5, 6}), ("1,1,0-1", {0, 1}), (3, {3}),
    ([0, "2-3"], {0, 2, 3}),
])
def test_parse_cpus(text, want):
    assert parse_cpus(text) == frozenset(want)


@pytest.mark.parametrize("text", ["", " ", "a", "1-", "-1", "3-1", "1,,2", "1;2", "0x1", "1.5", True, None, [],
                                  "99999"])
def test_parse_cpus_rejects(text):
    with pytest.raises(CpuSetError):
        parse_cpus(text)


@given(st.sets(st.integers(0, 300), min_size=1))
def test_format_parse_round_trip(cpus):
    text = format_cpus(cpus)
    assert parse_cpus(text) == frozenset(cpus)
    assert text == format_cpus(parse_cpus(text))


def test_errors_are_config_and_cli_errors():
    from strata.errors import CliError

    with pytest.raises(ConfigError) as e:
        parse_cpus("x")
    assert isinstance(e.value, CliError) and e.value.code == 1


# ---- validation ------------------------------------------------------------------------------------------
def test_levels_without_cpus_are_not_pinned():
    cfg = cfg_with({})
    assert check_disjoint(cfg) == {} and level_cpus(cfg, "S") is None


def test_disjoint_sets_per_level():
    cfg = cfg_with({"U": str(CPUS[0]), "TS": format_cpus(CPUS[1:]) or str(CPUS[0])} if len(CPUS) > 1
                   else {"U": str(CPUS[0])})
    sets = check_disjoint(cfg)
    assert sets["U"] == {CPUS[0]}
    assert level_cpus(cfg, "u".upper()) == {CPUS[0]}


def test_overlapping_sets_name_both_levels():
    with pytest.raises(CpuSetError) as e:  # refused as soon as the configuration is loaded, by every process
        cfg_with({"U": "0", "TS": "0"})
    msg = str(e.value)
    assert "TS" in msg and "U" in msg and "share CPU 0" in msg and "disjoint" in msg


def test_cpus_must_exist_on_this_host():
    missing = max(CPUS) + 1
    cfg = cfg_with({"S": f"{CPUS[0]},{missing}"})
    with pytest.raises(CpuSetError, match=rf"CPU {missing} not available"):
        check_disjoint(cfg)
    assert all_level_cpus(cfg, check_exist=False)["S"] == {CPUS[0], missing}


def test_bad_text_names_the_level():
    with pytest.raises(CpuSetError, match=r'groups\."C"\].*bad item'):
        check_disjoint(cfg_with({"C": "zero"}))
    with pytest.raises(ConfigError, match=r'groups\."Q"'):  # a table of no level: refused by the config's parser
        check_disjoint(cfg_with({"Q": "0"}))  # not a level of the lattice


# ---- pinning (in child processes: the test process itself stays unpinned) -------------------------------------
PIN = textwrap.dedent("""
    import json, os, subprocess, sys, threading, time
    from strata.config import load_config
    from strata.cpusets import pin_current_process, thread_affinities
    t = threading.Thread(target=time.sleep, args=(2,), daemon=True); t.start()  # a thread from before the pin
    cfg = load_config(sys.argv[1])
    got = pin_current_process(sys.argv[2], cfg)
    child = subprocess.run(["grep", "Cpus_allowed_list", "/proc/self/status"], capture_output=True, text=True).stdout
    print(json.dumps({"pinned": sorted(got) if got is not None else None,
                      "threads": sorted({tuple(sorted(v)) for v in thread_affinities().values()}),
                      "child": child.split()[-1], "env": os.environ.get("STRATA_CPUS")}))
""")


def _pin(tmp_path, groups, level):
    p = tmp_path / "strata.toml"
    text = BATTLEFIELD_TOML + "".join(f'\n[groups."{lv}"]\ncpus = "{c}"\n' for lv, c in groups.items())
    p.write_text(text)
    r = subprocess.run([sys.executable, "-c", PIN, str(p), level], capture_output=True, text=True, timeout=60)
    return r


def test_pin_current_process_pins_every_thread_and_children(tmp_path):
    target = CPUS[-1]
    r = _pin(tmp_path, {"S": str(target)}, "S")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["pinned"] == [target]
    assert out["threads"] == [[target]]  # the thread started before the pin too
    assert out["child"] == str(target) and out["env"] == str(target)
    r = _pin(tmp_path, {"S": str(target)}, "U")  # a level without cpus: untouched
    assert r.returncode == 0 and json.loads(r.stdout)["pinned"] is None


def test_strata_master_refuses_overlapping_sets(tmp_path):
    cfg = tmp_path / "strata.toml"
    cfg.write_text(BATTLEFIELD_TOML + '\n[groups."U"]\ncpus = "0"\n[groups."S"]\ncpus = "0"\n')
    r = subprocess.run([sys.executable, "-m", "strata", "master", "--config", str(cfg), "--level", "S",
                        "--state-dir", str(tmp_path / "state"), "--insecure"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 1, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert "levels S and U share CPU 0" in last and "Traceback" not in r.stderr


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_worker_and_its_spark_jvm_run_on_the_levels_cpus(tmp_path):
    """A real ``strata worker`` with ``cpus``: the worker and every thread of its JVM are pinned."""
    import psutil

    from strata.serving import free_udp_port
    from strata.groups import group_spec

    target = CPUS[-1]
    cfg_path = tmp_path / "strata.toml"
    cfg_path.write_text(BATTLEFIELD_TOML + f'\n[groups."S"]\ncpus = "{target}"\n')
    state = tmp_path / "state"
    group_spec(parse_config(cfg_path.read_text(), cfg_path), "S", state, create_key=True)
    ready = tmp_path / "ready.json"
    with open(tmp_path / "worker.log", "wb") as log:
        w = subprocess.Popen([sys.executable, "-m", "strata", "worker", "--config", str(cfg_path), "--level", "S",
                              "--state-dir", str(state), "--insecure", "--ready-file", str(ready),
                              "--multicast-port", str(free_udp_port())],
                             stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not ready.exists() and time.monotonic() < deadline:
            assert w.poll() is None, (tmp_path / "worker.log").read_text()[-3000:]
            time.sleep(0.2)
        assert ready.exists(), "worker did not start"
        java = [p for p in psutil.Process(w.pid).children(recursive=True) if "java" in p.name()]
        assert java, "no JVM under the worker"
        for pid in [w.pid] + [p.pid for p in java]:
            status = Path(f"/proc/{pid}/status").read_text()
            assert f"Cpus_allowed_list:\t{target}\n" in status, (pid, status)
            for task in Path(f"/proc/{pid}/task").iterdir():  # every thread, the JVM's GC/JIT threads included
                try:
                    assert os.sched_getaffinity(int(task.name)) == {target}
                except ProcessLookupError:  # the thread ended meanwhile
                    pass
    finally:
        try:
            os.killpg(w.pid, signal.SIGTERM)
            w.wait(30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
        try:
            os.killpg(w.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        w.wait(10)
