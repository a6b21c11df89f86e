"""docs/dashboard.png: the Grafana dashboard (docs/grafana/strata.json) drawn from a real run, not by Grafana.

``python -m bench.dashboard_png [--seconds 120] [--out docs/dashboard.png]``

There is no Grafana (nor Prometheus) on the build machine, so this script does what they would do,
in the open:

1. starts an embedded cluster of level S (``strata up``'s ``start_cluster``: a master, 2 workers, mutual
   TLS) whose workers serve their own metrics (``[groups."S"] worker_metrics_port = 0``), issues the
   level's scraper certificate (``strata scraper-cert``) and starts the exporter of the master
   (``strata metrics``' :class:`~strata.metrics.MetricsServer`), logged in as an operator;
2. runs a workload through the client: battlefield Vitals rows labelled U, C, S and TS (the TS rows are
   dropped by the master's shepherd) at a rate that rises and falls, one instant per wall second, three
   queries (one of them overflows a 64-bit SUM midway: a query failure), and now and then a batch the
   master refuses (a missing column);
3. scrapes the exporter (job ``strata-S``) and every worker endpoint (job ``strata-S-workers``,
   ``instance`` its address) every ``--interval`` seconds, over TLS with the certificates a scraper
   would hold, as Prometheus would (it adds ``job`` and ``instance``);
4. evaluates each panel's PromQL expressions of the dashboard JSON at every scrape time with a small
   evaluator of the subset the dashboard uses (selectors with ``=``, ``!=``, ``=~``, ``!~``;
   ``rate``, ``increase``, ``sum by``, ``histogram_quantile``, ``/``; template variables as "All"),
   and draws each panel's series with matplotlib at the panel's ``gridPos`` (24 columns; rows of
   ``h`` units), with its title, unit and legend format.

The picture is titled as what it is: rendered from the dashboard JSON by this script from a real run,
not by Grafana.  A panel whose expressions find no series says "No data", as Grafana does.
"""

from __future__ import annotations

import argparse
import base64
import http.client
import json
import math
import re
import shutil
import ssl
import sys
import tempfile
import textwrap
import threading
import time
from collections import defaultdict
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from strata.client import Client
from strata.config import load_config
from strata.deploy.local import start_cluster, stop_cluster
from strata.examples import BATTLEFIELD_TOML
from strata.metrics import MetricsServer
from strata.tls import cert_paths
from strata.users import UserStore
from strata.worker.metrics import issue_scraper, metrics_file, scrape

ROOT = Path(__file__).resolve().parents[1]
BOARD = ROOT / "docs" / "grafana" / "strata.json"
OUT = ROOT / "docs" / "dashboard.png"
SCRIPT = "bench/dashboard_png.py"

CONFIG = BATTLEFIELD_TOML + """
[streams.Counts]
sid = "string"
n = "long"

[groups."S"]
worker_metrics_port = 0
"""
QUERIES = ["SELECT sid, COUNT(*) AS n, AVG(bp) AS bp FROM Vitals [ROWS 400] GROUP BY sid",
           "SELECT AVG(pr) AS pr, MAX(bp) AS bp FROM Vitals [ROWS 50]",
           "SELECT SUM(n) AS total FROM Counts [ROWS 5]"]
PASSWORD = "a dashboard run's password"


# ---- a small PromQL evaluator (the dashboard's subset) ---------------------------------------------
Labels = tuple  # sorted (name, value) pairs


class Series:
    """Scraped samples over time: (labels with __name__) -> [(t, value)], in time order."""

    def __init__(self):
        self.data: dict[Labels, list[tuple[float, float]]] = defaultdict(list)

    def add(self, t: float, samples: dict[Labels, float]) -> None:
        for labels, v in samples.items():
            self.data[labels].append((t, v))


_TOKEN = re.compile(r'\s*(?:(?P<num>\d+(?:\.\d+)?)|(?P<str>"(?:[^"\\]|\\.)*")|(?P<dur>\[\d+[smh]\])|'
                    r'(?P<op>=~|!~|!=|[=(){},/])|(?P<id>[A-Za-z_:][A-Za-z0-9_:]*))')


def _tokens(text: str) -> list[tuple[str, str]]:
    out, i = [], 0
    text = text.strip()
    while i < len(text):
        m = _TOKEN.match(text, i)
        if not m or m.end() == i:
            raise ValueError(f"cannot read {text[i:]!r}")
        kind = m.lastgroup
        out.append((kind, m.group(kind)))
        i = m.end()
    return out


def _seconds(dur: str) -> float:
    n, unit = int(dur[1:-2]), dur[-2]
    return n * {"s": 1, "m": 60, "h": 3600}[unit]


class Query:
    """One PromQL expression of the subset, parsed once, evaluated at any time over :class:`Series`."""

    def __init__(self, text: str, variables: dict[str, str] | None = None):
        for name, value in (variables or {}).items():
            text = text.replace("$" + name, value)
        self.text = text
        self._t = _tokens(text)
        self._i = 0
        self.tree = self._expr()
        if self._i != len(self._t):
            raise ValueError(f"unexpected {self._t[self._i][1]!r} in {text!r}")

    # parsing
    def _peek(self):
        return self._t[self._i] if self._i < len(self._t) else (None, None)

    def _take(self, value=None):
        tok = self._peek()
        if value is not None and tok[1] != value:
            raise ValueError(f"expected {value!r}, found {tok[1]!r} in {self.text!r}")
        self._i += 1
        return tok

    def _expr(self):
        left = self._term()
        while self._peek()[1] == "/":
            self._take("/")
            left = ("div", left, self._term())
        return left

    def _term(self):
        kind, value = self._peek()
        if kind == "num":
            self._take()
            return ("num", float(value))
        if kind == "op" and value == "(":
            self._take("(")
            e = self._expr()
            self._take(")")
            return e
        if kind != "id":
            raise ValueError(f"unexpected {value!r} in {self.text!r}")
        self._take()
        if value in ("sum", "max", "min", "avg") and self._peek()[1] in ("by", "("):
            by = None
            if self._peek()[1] == "by":
                self._take()
                self._take("(")
                by = []
                while self._peek()[1] != ")":
                    by.append(self._take()[1])
                    if self._peek()[1] == ",":
                        self._take(",")
                self._take(")")
            self._take("(")
            e = self._expr()
            self._take(")")
            return ("agg", value, tuple(by) if by is not None else None, e)
        if value in ("rate", "increase"):
            self._take("(")
            sel = self._selector(self._take()[1])
            kind, dur = self._take()
            if kind != "dur":
                raise ValueError(f"{value} needs a range in {self.text!r}")
            self._take(")")
            return (value, sel, _seconds(dur))
        if value == "histogram_quantile":
            self._take("(")
            q = self._expr()
            self._take(",")
            e = self._expr()
            self._take(")")
            return ("hq", q, e)
        return self._selector(value)

    def _selector(self, name):
        matchers = [("__name__", "=", name)]
        if self._peek()[1] == "{":
            self._take("{")
            while self._peek()[1] != "}":
                label = self._take()[1]
                op = self._take()[1]
                value = json.loads(self._take()[1])
                matchers.append((label, op, value))
                if self._peek()[1] == ",":
                    self._take(",")
            self._take("}")
        return ("sel", tuple(matchers))

    # evaluation: an instant vector is {labels (without __name__ after a function): value}
    def at(self, series: Series, t: float, lookback: float = 300.0) -> dict[Labels, float]:
        return self._eval(self.tree, series, t, lookback)

    @staticmethod
    def _match(labels: Labels, matchers) -> bool:
        d = dict(labels)
        for name, op, value in matchers:
            have = d.get(name, "")
            ok = {"=": have == value, "!=": have != value,
                  "=~": re.fullmatch(value, have) is not None, "!~": re.fullmatch(value, have) is None}[op]
            if not ok:
                return False
        return True

    def _eval(self, node, series, t, lookback):
        kind = node[0]
        if kind == "num":
            return {(): node[1]}
        if kind == "sel":
            out = {}
            for labels, points in series.data.items():
                if self._match(labels, node[1]):
                    last = [v for (ts, v) in points if t - lookback < ts <= t]
                    if last:
                        out[labels] = last[-1]
            return out
        if kind in ("rate", "increase"):
            _, sel, window = node
            out = {}
            for labels, points in series.data.items():
                if not self._match(labels, sel[1]):
                    continue
                pts = [(ts, v) for (ts, v) in points if t - window < ts <= t]
                if len(pts) < 2:
                    continue
                grew = sum(max(b[1] - a[1], 0.0) if b[1] >= a[1] else b[1] for a, b in zip(pts, pts[1:]))
                span = pts[-1][0] - pts[0][0]
                if span <= 0:
                    continue
                out[_drop_name(labels)] = grew / span if kind == "rate" else grew
            return out
        if kind == "agg":
            _, how, by, e = node
            groups: dict[Labels, list[float]] = defaultdict(list)
            for labels, v in self._eval(e, series, t, lookback).items():
                key = tuple((k, x) for k, x in _drop_name(labels) if by is not None and k in by)
                groups[key].append(v)
            f = {"sum": sum, "max": max, "min": min, "avg": lambda xs: sum(xs) / len(xs)}[how]
            return {k: f(vs) for k, vs in groups.items()}
        if kind == "div":
            left = self._eval(node[1], series, t, lookback)
            right = self._eval(node[2], series, t, lookback)
            if set(right) == {()}:
                return {k: _div(v, right[()]) for k, v in left.items()}
            right = {_drop_name(k): v for k, v in right.items()}
            return {_drop_name(k): _div(v, right[_drop_name(k)]) for k, v in left.items() if _drop_name(k) in right}
        if kind == "hq":
            q = self._eval(node[1], series, t, lookback)[()]
            groups: dict[Labels, list[tuple[float, float]]] = defaultdict(list)
            for labels, v in self._eval(node[2], series, t, lookback).items():
                d = dict(_drop_name(labels))
                le = d.pop("le", None)
                if le is not None:
                    groups[tuple(sorted(d.items()))].append((float(le), v))
            return {k: histogram_quantile(q, b) for k, b in groups.items()}
        raise ValueError(f"cannot evaluate {kind}")


def _drop_name(labels: Labels) -> Labels:
    return tuple((k, v) for k, v in labels if k != "__name__")


def _div(a: float, b: float) -> float:
    return a / b if b else math.nan


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """Prometheus's: the ``q`` quantile of cumulative ``buckets`` ((upper bound, count)), linearly
    interpolated within its bucket; the highest finite bound if it falls in +Inf; NaN without counts."""
    buckets = sorted(buckets)
    if not buckets or buckets[-1][0] != math.inf:
        return math.nan
    total = buckets[-1][1]
    if total <= 0:
        return math.nan
    rank = q * total
    prev_bound, prev_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if bound == math.inf:
                return prev_bound
            if count == prev_count:
                return bound
            return prev_bound + (bound - prev_bound) * (rank - prev_count) / (count - prev_count)
        prev_bound, prev_count = bound, count
    return prev_bound


def legend(fmt: str, labels: Labels) -> str:
    d = dict(labels)
    text = re.sub(r"\{\{\s*([A-Za-z_]+)\s*\}\}", lambda m: d.get(m.group(1), ""), fmt or "")
    return text.strip() or ", ".join(f"{k}={v}" for k, v in labels) or "value"


# ---- scraping ------------------------------------------------------------------------------------------
def _parse(text: str, job: str, instance: str) -> dict[Labels, float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = {**s.labels, "__name__": s.name, "job": job, "instance": instance}
            out[tuple(sorted(labels.items()))] = float(s.value)
    return out


def _scrape_exporter(address: str, tls: Path, user: str, password: str) -> str:
    ctx = ssl.create_default_context(cafile=str(tls / "ca.pem"))
    ctx.check_hostname = False  # the exporter serves with the level's client certificate (docs/operations.md)
    ctx.load_cert_chain(*cert_paths(tls, "client", "S"))
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPSConnection(host, int(port), context=ctx, timeout=30)
    auth = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
    try:
        conn.request("GET", "/metrics", headers={"Authorization": auth})
        r = conn.getresponse()
        body = r.read().decode()
        if r.status != 200:
            raise RuntimeError(f"exporter answered {r.status}: {body.strip()}")
        return body
    finally:
        conn.close()


# ---- the run --------------------------------------------------------------------------------------------
def _vitals(t: int, n: int, seed: int):
    import numpy as np
    import pyarrow as pa

    rng = np.random.default_rng(seed * 100003 + t)
    levels = np.array(["U", "C", "S", "TS"])[rng.choice(4, size=n, p=[0.3, 0.3, 0.3, 0.1])]
    return pa.table({"ts": pa.array(np.full(n, t), pa.int64()), "level": pa.array(levels.tolist(), pa.string()),
                     "sid": pa.array([f"s{i}" for i in rng.integers(0, 40, n)], pa.string()),
                     "bp": rng.normal(120, 15, n), "pr": rng.normal(80, 10, n), "weight": rng.normal(75, 8, n)})


def _rate(t: int, seconds: int) -> int:
    """Rows per instant: rising to a peak at two thirds of the run, then falling back."""
    peak = 2 * seconds / 3
    x = t / peak if t <= peak else max(0.0, (seconds - t) / (seconds - peak))
    return int(300 + 5700 * x)


def run(seconds: int, interval: float, workers: int, keep: Path | None) -> dict:
    """Start the cluster, run the workload, scrape; returns the scraped series and the run's facts."""
    import pyarrow as pa

    work = Path(tempfile.mkdtemp(prefix="strata-dashboard-")) if keep is None else keep
    work.mkdir(parents=True, exist_ok=True)
    config = work / "strata.toml"
    config.write_text(CONFIG)
    cfg = load_config(config)
    UserStore(cfg.users_path, cfg.lattice).add("op", "S", PASSWORD, replace=True,
                                               roles=("operator", "producer", "analyst"))
    state = work / "state"
    print(f"[dashboard] starting an S cluster with {workers} workers in {state}", file=sys.stderr, flush=True)
    started = start_cluster(str(config), ["S"], workers, state)
    series = Series()
    facts = {"rows": 0, "bad_batches": 0, "workers": workers, "seconds": seconds}
    stop = threading.Event()
    try:
        tls = Path(started["tls_dir"])
        issue_scraper(tls, "S")
        workers_at = [json.loads(metrics_file(f).read_text())["address"] for f in started["worker_ready_files"]]
        exporter = MetricsServer(started["masters"]["S"], "S", tls).start()
        client = Client(started["masters"]["S"], tls_dir=tls, level="S")
        client.login("op", PASSWORD, "S")
        t0 = time.time()
        errors: list[str] = []

        def scraper():
            while not stop.is_set():
                at = time.time() - t0
                try:
                    series.add(at, _parse(_scrape_exporter(exporter.address, tls, "op", PASSWORD), "strata-S",
                                          exporter.address))
                    for w in workers_at:
                        code, body = scrape(w, tls, "S")
                        if code == 200:
                            series.add(at, _parse(body, "strata-S-workers", w))
                except Exception as e:  # noqa: BLE001 - a missed scrape is a gap, as in Prometheus
                    errors.append(str(e))
                stop.wait(max(0.0, interval - ((time.time() - t0) - at)))

        th = threading.Thread(target=scraper, name="scraper", daemon=True)
        th.start()
        client.register(QUERIES)
        for t in range(1, seconds + 1):
            due = t0 + t
            n = _rate(t, seconds)
            batches = [("Vitals", _vitals(t, n, 1))]
            if t == seconds // 2:  # a 64-bit SUM that overflows: the third query fails
                batches.append(("Counts", pa.table({"ts": pa.array([t] * 3, pa.int64()), "level": ["S"] * 3,
                                                    "sid": ["a"] * 3, "n": pa.array([4 * 10**18] * 3, pa.int64())})))
            elif t % 7 == 0:
                batches.append(("Counts", pa.table({"ts": pa.array([t], pa.int64()), "level": ["C"], "sid": ["a"],
                                                    "n": pa.array([t], pa.int64())})))
            batches[-1] = (*batches[-1], t)  # the last batch closes the instant
            client.ingest(batches, labelled=True)
            facts["rows"] += n
            if t % 15 == 0:  # a batch the master refuses (a missing column): counted in its status
                try:
                    client.ingest([("Vitals", _vitals(t, 5, 2).drop_columns(["bp"]))], labelled=True)
                except Exception:  # noqa: BLE001 - refused, as meant
                    pass
                facts["bad_batches"] += 1
            time.sleep(max(0.0, due - time.time()))  # pacing: one instant per wall second
        client.advance(finish=True)
        deadline = time.time() + 60
        while time.time() < deadline and client.status().backlog_chunks:
            time.sleep(0.5)
        time.sleep(3 * interval)  # the last scrapes see the drained cluster
        stop.set()
        th.join(30)
        facts["scrape_errors"] = len(errors)
        facts["scrapes"] = len({t for pts in series.data.values() for t, _ in pts})
        st = client.status()
        facts["accepted"] = int(st.counters.get("accepted", 0))
        facts["refused"] = dict(st.rejected)
        client.close()
        exporter.stop()
    finally:
        stop.set()
        stop_cluster(state)
        if keep is None:
            shutil.rmtree(work, ignore_errors=True)
    return {"series": series, "facts": facts}


# ---- drawing ------------------------------------------------------------------------------------------
UNITS = {"short": "", "s": "seconds", "ms": "milliseconds", "percent": "%"}


def draw(board: dict, series: Series, facts: dict, out: Path, title_note: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = board["panels"]
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
    times = sorted({t for pts in series.data.values() for t, _ in pts})
    variables = {v["name"]: ".+" for v in board.get("templating", {}).get("list", []) if v["name"] != "datasource"}
    head = 2.8  # figure rows for the title
    unit_in = 0.42
    fig = plt.figure(figsize=(18, (rows + head) * unit_in))
    total = rows + head
    fig.suptitle(f"{board['title']} — rendered from the dashboard JSON (docs/grafana/strata.json) by {SCRIPT} "
                 f"from a real run, not by Grafana", fontsize=13, fontweight="bold", y=1 - 0.35 / total)
    fig.text(0.5, 1 - 1.6 / total, textwrap.fill(title_note, 190), ha="center", va="center", fontsize=9.5,
             color="#444")
    for p in panels:
        g = p["gridPos"]
        pad_y = 0.9
        left = g["x"] / 24 + 0.045
        width = g["w"] / 24 - 0.06
        bottom = 1 - (head + g["y"] + g["h"]) / total + 0.45 / total
        height = (g["h"] - pad_y - 0.45) / total
        ax = fig.add_axes([left, bottom, width, height])
        ax.set_title(p["title"], fontsize=10, loc="left")
        unit = p.get("fieldConfig", {}).get("defaults", {}).get("unit", "short")
        ax.set_ylabel(UNITS.get(unit, unit), fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(True, alpha=0.3)
        drawn = 0
        for target in p.get("targets", []):
            q = Query(target["expr"], variables)
            lines: dict[Labels, list[tuple[float, float]]] = defaultdict(list)
            for t in times:
                for labels, v in q.at(series, t).items():
                    if not math.isnan(v):
                        lines[labels].append((t, v * (100 if unit == "percentunit" else 1)))
            for labels, pts in sorted(lines.items()):
                xs, ys = zip(*pts)
                ax.plot(xs, ys, lw=1.3, label=legend(target.get("legendFormat", ""), labels))
                drawn += 1
        if drawn:
            ax.legend(fontsize=7, loc="upper left", ncol=2 if drawn > 4 else 1, framealpha=0.7)
            ax.set_ylim(bottom=0)
        else:
            ax.text(0.5, 0.5, "No data", ha="center", va="center", transform=ax.transAxes, color="#888")
        if times:
            ax.set_xlim(0, times[-1])
        if g["y"] + g["h"] == rows:
            ax.set_xlabel("seconds into the run", fontsize=8)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=int, default=120, help="instants of input, one per wall second")
    ap.add_argument("--interval", type=float, default=2.0, help="seconds between scrapes")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--keep", type=Path, help="keep the run's directory (config, state, logs) here")
    ap.add_argument("--series", type=Path, help="also write the scraped samples here (JSON lines)")
    args = ap.parse_args(argv)
    board = json.loads(BOARD.read_text())
    for p in board["panels"]:  # every expression parses before anything starts
        for target in p.get("targets", []):
            Query(target["expr"], {"job": ".+", "worker_job": ".+"})
    got = run(args.seconds, args.interval, args.workers, args.keep)
    f = got["facts"]
    if args.series:
        with open(args.series, "w") as out:
            for labels, pts in got["series"].data.items():
                out.write(json.dumps({"labels": dict(labels), "points": pts}) + "\n")
    note = (f"level S, {f['workers']} workers (local[1] each), mutual TLS; {f['seconds']} instants of battlefield "
            f"Vitals at a rising and falling rate ({f['rows']:,} rows labelled U/C/S/TS, the TS ones dropped by the "
            f"master's shepherd; {f['accepted']:,} accepted), 3 queries (one overflows midway), "
            f"{f['bad_batches']} bad batches (refused: {', '.join(f'{k} {v}' for k, v in sorted(f['refused'].items()))})"
            f"; {f['scrapes']} scrapes every {args.interval:g} s of the exporter (job strata-S: the level's client "
            f"certificate and an operator's password) and of the workers' own endpoints (job strata-S-workers: the "
            f"level's scraper certificate); {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    draw(board, got["series"], f, args.out, note)
    print(json.dumps({"out": str(args.out), **f}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
