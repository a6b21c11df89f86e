"""The main job: a battlefield replay on an embedded local cluster (`./dev run`, ``strata demo``)."""

from __future__ import annotations

import csv
import json
import os
import secrets
import sys
import time
from pathlib import Path

import numpy as np

from strata.config import load_config
from strata.examples import BATTLEFIELD_TOML
from strata.users import UserStore

from .local import default_workers
from .replay import replay

QUERIES = [
    "SELECT sid, bp FROM Vitals [ROWS 100] WHERE bp > 150",
    "SELECT sid, AVG(bp) AS avg_bp FROM Vitals [ROWS 100] GROUP BY sid",
    "SELECT AVG(bp) FROM Vitals [ROWS 100 level in {U, C}]",
    "SELECT V.sid, V.bp, P.lat FROM Vitals [ROWS 100] V, Positions [ROWS 100] P WHERE V.sid = P.sid AND V.bp > 170",
]
LEVELS = ["U", "C", "S", "TS"]


def battlefield_data(instants: int, per_instant: int, soldiers: int = 40, seed: int = 7):
    """Vitals and Positions with 1/4 of the tuples at each level (dissertation §9.2)."""
    rng = np.random.default_rng(seed)
    n = instants * per_instant
    ts = np.repeat(np.arange(1, instants + 1), per_instant)
    level = np.array(LEVELS)[rng.integers(0, 4, n)]
    sid = np.char.add("s", rng.integers(0, soldiers, n).astype(str))
    vitals = {"ts": ts, "level": level, "sid": sid, "bp": rng.normal(130, 20, n).round(1),
              "pr": rng.normal(80, 10, n).round(1), "weight": rng.normal(75, 8, n).round(1)}
    m = instants * max(1, per_instant // 4)
    pts = np.repeat(np.arange(1, instants + 1), max(1, per_instant // 4))
    positions = {"ts": pts, "level": np.array(LEVELS)[rng.integers(0, 4, m)],
                 "sid": np.char.add("s", rng.integers(0, soldiers, m).astype(str)),
                 "lat": rng.uniform(30, 40, m).round(4), "lon": np.array(["4E", "5E", "6W"])[rng.integers(0, 3, m)]}
    return vitals, positions


def write_csv(path: Path, cols: dict) -> None:
    keys = list(cols)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(keys)
        for row in zip(*(cols[k] for k in keys)):
            w.writerow(row)


def run_demo(workdir: Path, workers: int = 2, instants: int = 20, per_instant: int = 400) -> int:
    workdir.mkdir(parents=True, exist_ok=True)
    cfg_path = workdir / "battlefield.toml"
    cfg_path.write_text(BATTLEFIELD_TOML)
    cfg = load_config(cfg_path)
    password = secrets.token_urlsafe(16)
    UserStore(cfg.users_path, cfg.lattice).add("commander", "TS", password, replace=True)
    vitals, positions = battlefield_data(instants, per_instant)
    write_csv(workdir / "vitals.csv", vitals)
    write_csv(workdir / "positions.csv", positions)
    os.environ["STRATA_PASSWORD"] = password
    print(f"[strata] demo: {instants * per_instant} Vitals tuples over {instants} instants, 4 levels, "
          f"user 'commander' logged in at S (clearance TS)", file=sys.stderr)
    t0 = time.monotonic()
    timings: dict = {}
    rc = replay(str(cfg_path), "commander", "S", QUERIES,
                [f"Vitals={workdir / 'vitals.csv'}", f"Positions={workdir / 'positions.csv'}"],
                str(workdir / "results"), workers=workers, timings=timings)
    total = time.monotonic() - t0
    start = float(timings.get("start", 0.0))
    ready = timings.get("workers_ready") or []
    split = {"start": round(start, 2), "first_worker": (timings.get("start_split") or {}).get("first"),
             "workers_ready": ready, "after_ready": round(total - start, 2), "process": timings.get("process"),
             "replay": round(total, 2)}
    staggered = len(ready) > 1 and (timings.get("start_split") or {}).get("all") is None
    later = [f"ready after {r:.1f} s" if r is not None else "not ready by the end"
             for r in sorted(ready, key=lambda r: (r is None, r or 0.0))[1:]]
    print(f"[strata] demo took {total:.1f} s: cluster start-up {start:.1f} s"
          + (f" (the master and the first worker; on few cores a later worker starts only once the run has "
             f"lasted as long as that start-up: {', '.join(later)})" if staggered else "")
          + f", then {total - start:.1f} s (results after {float(timings.get('process') or 0):.1f} s of processing)",
          file=sys.stderr)
    print("[strata] timings " + json.dumps(split), file=sys.stderr, flush=True)
    for i, q in enumerate(QUERIES, 1):
        path = workdir / "results" / f"q{i}.csv"
        rows = path.read_text().splitlines()
        print(f"q{i}: {q}\n    {len(rows) - 1} result rows -> {path}")
        for line in rows[1:4]:
            print(f"    {line}")
    return rc


def cmd_demo(args) -> int:
    return run_demo(Path(args.dir), workers=args.workers)


def add_parsers(sub) -> None:
    d = sub.add_parser("demo", help="the main job: battlefield replay on an embedded cluster")
    d.add_argument("--dir", default="out/demo")
    d.add_argument("--workers", type=int, default=default_workers())
    d.set_defaults(func=cmd_demo)
