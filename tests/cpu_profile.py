"""Where the suite's CPU goes: an opt-in pytest plugin (``STRATA_TEST_CPU=DIR``).

Each pytest process (every xdist worker, or the one process) moves itself into a cgroup-v1
``cpuacct`` group of its own; the processes a test starts (masters, workers, their JVMs, sshd, Ray)
inherit it, so the group's counter is the CPU of everything that process ran.  The CPU seconds
between a test's start and its end are written per test to ``DIR/cpu-<process>.json``; the
daemons a module fixture keeps running count towards the tests that run meanwhile, so read the
figures per file (``python -m tests.cpu_profile DIR``).  Needs root and ``/sys/fs/cgroup/cpuacct``
(the development VM has both); anywhere else it says so once and records nothing.  Not used by CI.
"""

from __future__ import annotations

import collections
import json
import os
import sys
from pathlib import Path

ROOT = Path("/sys/fs/cgroup/cpuacct")


class CpuProfile:
    def __init__(self, out: Path):
        self.out = out
        self.name = os.environ.get("PYTEST_XDIST_WORKER", "main")
        self.group = ROOT / f"strata-tests-{os.getpid()}"
        self.times: dict[str, float] = {}
        self._start = 0.0
        for old in ROOT.glob("strata-tests-*"):  # groups of earlier runs whose processes are all gone
            try:
                old.rmdir()
            except OSError:
                pass
        self.group.mkdir(exist_ok=True)
        (self.group / "cgroup.procs").write_text(str(os.getpid()))

    def usage(self) -> float:
        return int((self.group / "cpuacct.usage").read_text()) / 1e9

    def pytest_runtest_logstart(self, nodeid, location):
        self._start = self.usage()

    def pytest_runtest_logfinish(self, nodeid, location):
        self.times[nodeid] = round(self.usage() - self._start, 3)

    def pytest_sessionfinish(self, session):
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / f"cpu-{self.name}.json").write_text(json.dumps({"total": self.usage(), "tests": self.times}))
        try:  # back to the root group; the empty group removed
            (ROOT / "cgroup.procs").write_text(str(os.getpid()))
            self.group.rmdir()
        except OSError:
            pass


def register(config) -> None:
    out = os.environ.get("STRATA_TEST_CPU")
    if not out:
        return
    if os.environ.get("PYTEST_XDIST_WORKER") is None and config.pluginmanager.hasplugin("xdist") \
            and getattr(config.option, "numprocesses", None):
        return  # the controller runs no test: its workers record
    try:
        config.pluginmanager.register(CpuProfile(Path(out)), "strata-cpu-profile")
    except OSError as e:
        print(f"STRATA_TEST_CPU: no cpuacct cgroup here ({e}); nothing recorded", file=sys.stderr)


def report(out: Path) -> None:
    per_file: collections.Counter = collections.Counter()
    total = 0.0
    for f in out.glob("cpu-*.json"):
        data = json.loads(f.read_text())
        total += data["total"]
        for nodeid, s in data["tests"].items():
            per_file[nodeid.split("::")[0]] += s
    print(f"CPU of all pytest processes and what they started: {total:.0f} s")
    for name, s in per_file.most_common(40):
        print(f"{s:8.1f} s  {name}")


if __name__ == "__main__":
    report(Path(sys.argv[1]))
