"""Process logs stay bounded (issue 30 item 4): the master's load reading works (it imported a module
that had moved), a recurring warning is logged once per interval with a count, and a process's
``--log-file`` is rotated at a size, its children's output included."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections import Counter

import pytest

from strata.cpusets import host_cpu_percent
from strata.groups import group_spec
from strata.groups.membership import GroupMember, GroupSpec, decode_heartbeat, receiver
from strata.logs import RepeatLimiter, _RotatingSink

from .polling import wait_for


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def test_the_default_load_reading_is_a_percentage():
    """The reading every master sends (it failed on every heartbeat: the module it imported had moved)."""
    assert 0.0 <= host_cpu_percent() <= 100.0
    spec = GroupSpec(level="S", address="239.255.77.1", port=0, key=os.urandom(32))
    m = GroupMember.__new__(GroupMember)  # its reading() only: no sockets
    m.cpu_override, m._load, m.send_errors = None, __import__("strata.groups.membership", fromlist=["_cpu_percent"])._cpu_percent, Counter()
    m.limited = RepeatLimiter(logging.getLogger("test"))
    m.spec = spec
    assert 0.0 <= m.reading() <= 100.0 and not m.send_errors


def test_a_recurring_warning_is_logged_once_per_interval_with_a_count(caplog):
    clock = Clock()
    limiter = RepeatLimiter(logging.getLogger("strata.test"), interval=60.0, clock=clock)
    with caplog.at_level(logging.WARNING, logger="strata.test"):
        for i in range(100):  # 100 heartbeats at 0.5 s: 50 s
            limiter.warning("load", "load reading failed: %s", f"boom {i}")
            clock.t += 0.5
        assert [r.getMessage() for r in caplog.records] == ["load reading failed: boom 0"]
        assert limiter.held("load") == 99
        clock.t += 10  # a minute after the first report
        limiter.warning("load", "load reading failed: %s", "boom 100")
        limiter.warning("other", "another kind: %s", 1)  # keys are counted apart
    assert [r.getMessage() for r in caplog.records][1:] == [
        "load reading failed: boom 100 (99 more since the last report, 60 s ago)", "another kind: 1"]


def test_a_member_with_a_failing_reading_logs_it_once(caplog):
    """GroupMember.reading() with a load function that always fails: busy (100) every time, one line."""
    spec = GroupSpec(level="S", address="239.255.77.2", port=0, key=os.urandom(32))
    m = GroupMember.__new__(GroupMember)
    m.cpu_override, m.send_errors, m.spec = None, Counter(), spec
    m._load = lambda: (_ for _ in ()).throw(ModuleNotFoundError("No module named 'strata.groups.load'"))
    m.limited = RepeatLimiter(logging.getLogger("strata.group"), clock=Clock())
    with caplog.at_level(logging.WARNING, logger="strata.group"):
        assert [m.reading() for _ in range(100)] == [100.0] * 100
    assert len(caplog.records) == 1 and m.send_errors["load"] == 100


def test_the_log_file_is_rotated_at_its_size(tmp_path):
    sink = _RotatingSink(tmp_path / "p.log", max_bytes=1000, backups=2)
    for i in range(100):
        sink.write(f"line {i:04d} ".encode() * 10 + b"\n")  # 101 bytes each
    sink.close()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["p.log", "p.log.1", "p.log.2"]
    assert all((tmp_path / f).stat().st_size <= 1000 for f in files)
    assert all(oct((tmp_path / f).stat().st_mode & 0o777) == "0o600" for f in files)
    assert (tmp_path / "p.log").read_text().splitlines()[-1].startswith("line 0099")  # the newest lines kept


def test_a_process_and_its_children_write_into_the_rotated_file(tmp_path):
    """capture_output: Python's output, a child process's (as the Spark JVM's) and the last line before
    exit all reach the file; it never grows past max_bytes."""
    log = tmp_path / "worker.log"
    code = f"""
import subprocess, sys
from strata.logs import capture_output, flush_output
capture_output({str(log)!r}, max_bytes=4096, backups=1)
for i in range(200):
    print("python line", i, "x" * 40)
subprocess.run([sys.executable, "-c", "import sys; [print('child line', i, file=sys.stderr) for i in range(50)]"])
print("the last line", flush=True)
flush_output()
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    text = log.read_text()
    assert log.stat().st_size <= 4096 and (tmp_path / "worker.log.1").stat().st_size <= 4096
    assert text.rstrip().endswith("the last line") and "child line 49" in text
    assert not (tmp_path / "worker.log.2").exists()


@pytest.mark.slow
def test_a_masters_log_has_no_repeated_warning_after_100_heartbeats(tmp_path):
    """A real master (``strata up``'s process, heartbeats every 20 ms): after it sent 100 heartbeats its
    log file holds no warning, and no line twice."""
    from strata.deploy.local import start_cluster, stop_cluster

    from .conftest import BATTLEFIELD_TOML
    from .helpers import write_config

    cfg_path = write_config(tmp_path, BATTLEFIELD_TOML + "\n[cluster]\nheartbeat_seconds = 0.02\n", {"ann": "S"})
    state = tmp_path / "state"
    start_cluster(str(cfg_path), ["S"], 0, state)
    try:
        record = json.loads((state / "cluster.json").read_text())
        from strata.config import load_config

        spec = group_spec(load_config(cfg_path), "S", state)
        spec = GroupSpec(**{**spec.__dict__, "port": record["multicast_port"]})
        rx = receiver(spec)
        rx.settimeout(0.2)
        seen = []

        def a_hundred_heartbeats():
            try:
                hb = decode_heartbeat(rx.recv(65536), spec.key)
            except (OSError, ValueError):
                return False
            if hb.role == "master":
                seen.append(hb.seq)
            return bool(seen) and seen[-1] >= 100

        wait_for(a_hundred_heartbeats, 60, "the master's 100th heartbeat")
        rx.close()
        lines = (state / "logs" / "master-S.log").read_text(errors="replace").splitlines()
        assert not [ln for ln in lines if "WARNING" in ln or "failed" in ln], lines
        assert not [ln for ln, n in Counter(lines).items() if n > 1 and ln.strip()], lines
    finally:
        stop_cluster(state)
