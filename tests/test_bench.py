"""The benchmark harness's plain parts (no cluster): the master-path A/B and the report.

The harness itself runs for minutes against real clusters (``python -m bench.run``);
these tests keep its in-process pieces from rotting between runs.
"""

from __future__ import annotations

from bench import master_path
from bench import workloads as W


def test_master_path_compares_the_same_work():
    w = W.battlefield_set("exp4", W.TABLE_9_7["exp4"][0], 4_000, 500)
    assert w.tuples == 4_000 and set(w.data) == {"Vitals", "Positions"}
    out = master_path.compare(w, reps=3, discard=1, chunk_instants=2)
    assert out["tuples"] == 4_000 and out["reps"] == 2
    for k in (*master_path.STEPS, "total"):
        assert out[k]["mls_ns"] > 0 and out[k]["van_ns"] > 0
    # the same tuples reach the wire either way: only the level strings differ ("TS" vs "P")
    m, v = out["bytes"]["mls"], out["bytes"]["van"]
    assert v > 0 and abs(m - v) / v < 0.05


def _run(e, vanilla, seconds, size=1_000_000, rep=1, cpu=3.0):
    return {"workload": e, "vanilla": vanilla, "seconds": seconds, "size": size, "rep": rep, "discarded": rep == 0,
            "cpu_seconds": cpu, "p50": 0.5, "p99": 1.0, "load": 1.0, "workers": 2, "chunk_instants": 4}


def test_report_overhead_section(tmp_path):
    from bench.report import write_report

    runs = [_run("exp1", False, 99.0, rep=0), _run("exp1", True, 10.0, rep=0),  # discarded: not counted
            _run("exp1", False, 10.05), _run("exp1", True, 10.0), _run("exp1", False, 10.05, rep=2),
            _run("exp1", True, 10.0, rep=2)]
    res = {"meta": {"command": "test", "mode": "quick"},
           "overhead": {"runs": runs, "checks": ["exp1: reference agrees"], "rate": 100_000, "per_instant": 50_000,
                        "chunk_instants": 4, "workers": 2, "runs_per_config": 3, "discarded": 1,
                        "experiments": {"exp1": [W.BF_QUERIES["select"]]},
                        "dissertation": {"exp1": {"1M": 0.010}}},
           "mpath": {"parts": [{"workload": "exp1", "tuples": 1_000_000, "reps": 6, "chunk_instants": 4,
                                "ingest": {"mls_ns": 27, "van_ns": 19}, "advance": {"mls_ns": 43, "van_ns": 43},
                                "wire": {"mls_ns": 14, "van_ns": 14}, "total": {"mls_ns": 84, "van_ns": 76},
                                "bytes": {"mls": 100, "van": 99}}]}}
    write_report(res, tmp_path)
    text = (tmp_path / "README.md").read_text()
    assert "| exp1 | 1 | 1,000,000 | 10,000 | 10,050 | +0.50 % | 0.010 % |" in text
    assert "Largest execution-time overhead in this table: +0.50 %" in text
    assert "0.27 % of 3,000 ns" in text  # 8 ns of 3 s CPU per 1 M tuples
    try:
        import matplotlib  # noqa: F401  (the bench extra; plots are optional)
    except ImportError:
        assert "matplotlib is not installed" in text
    else:
        assert (tmp_path / "overhead.png").exists()


def test_memory_analysis_and_the_new_sections_render(tmp_path):
    """bench/memory.py's RSS analysis and the report's load and memory sections (no cluster)."""
    from bench.memory import analyse
    from bench.report import write_report

    mb = 1024
    samples = [{"t": 0.0, "rss_kb": 100 * mb, "accepted": 0}, {"t": 0.5, "rss_kb": 150 * mb, "accepted": 300, "backlog": 3},
               {"t": 1.0, "rss_kb": 200 * mb, "accepted": 500, "backlog": 5}, {"t": 1.5, "rss_kb": 206 * mb, "accepted": 800},
               {"t": 2.0, "rss_kb": 210 * mb, "accepted": 1000}, {"t": 2.5, "rss_kb": 300 * mb, "accepted": 1000}]
    a = analyse(samples, expected=1000, tuples=2000)
    assert [(k, v["rss_mb"], v["fraction"]) for k, v in a["at"].items()] == \
        [("10", 150.0, 0.3), ("50", 200.0, 0.5), ("90", 210.0, 1.0), ("100", 210.0, 1.0)]
    assert a["slope_samples"] == 3 and a["second_half_range_mb"] == [200.0, 210.0]  # samples after 100 % left out
    assert abs(a["slope_mb_per_m"] - 10 / 0.001) < 1e-6  # 10 MB over 1,000 input tuples

    run = {"subscribers": 0, "max_per_session": 0, "status_calls": 60, "status_during_input": 58, "status_p50_ms": 4.0,
           "status_p99_ms": 30.0, "status_max_ms": 40.0, "rss_base_mb": 150.0, "rss_subscribed_mb": 150.0,
           "rss_peak_mb": 170.0, "rss_end_mb": 169.0, "cpu_seconds": 1.0, "cpu_percent": 8.0, "load": 2.0}
    res = {"meta": {"command": "test", "mode": "quick"},
           "load": {"runs": [run, run | {"subscribers": 200, "max_per_session": 8, "rss_peak_mb": 190.0}],
                    "checks": ["N=200: all 200 subscribers got all 61 results"], "query": "Q", "level": "S",
                    "per_instant": 5000, "instants": 60, "instant_rate": 5.0, "workers": 2, "tls": True, "users": 5,
                    "sessions": 25, "status_every": 0.2, "rss_every": 0.25, "load_start": 1.0, "load_end": 2.0,
                    "mode": "quick", "date": "today"},
           "memory": {"tuples": 2000, "accepted": 1000, "per_instant": 100, "query": "Q", "level": "S", "workers": 2,
                      "every": 0.5, "checks": ["DuckDB agrees"], "mode": "quick", "date": "today", **a}}
    write_report(res, tmp_path)
    text = (tmp_path / "README.md").read_text()
    assert "## Many subscribers on one master: Status latency, memory and CPU (quick mode, today)" in text
    assert "| 200 | 8 | 60 (58) | 4.0 | 30.0 | 40.0 | 150.0 | 150.0 | 190.0 | 169.0 | 1.00 | 8.0 | 2.0 |" in text
    assert "(+102 kB per subscriber)" in text and "no limit raised" in text
    assert "| 50 % of the input | 50% | 1.0 | 200.0 | 5 |" in text
    assert "**10,000.00 MB per million input tuples**" in text and "the slope here says little" in text


def test_replay_headline_without_a_whole_run_figure():
    """When the 1 M runs' median is not the longer one (start-up noise) the formula has no figure: the
    headline says so and still gives the figure with each run's start-up excluded."""
    from bench.report import _headlines

    rp = {"throughput": None, "throughput_after_start": 2_107_527, "pair_throughputs": [878_924, None, 777_161]}
    lines = _headlines({"userpath": {"replay": rp, "reps": 5, "mode": "full", "date": "2026-11-26 16:17 UTC"}})
    assert [x for x in lines if "strata replay" in x] == ["* `strata replay` of 1 M battlefield tuples, 2 workers, defaults: no figure (the 1 M runs' "
                     "median was not the longer: start-up noise) as (1 M − 20 k), medians of 5 interleaved pairs "
                     "(per pair 777,161 to 878,924, 1 pair(s) with the 1 M run the shorter); **2,107,527 tuples/s** "
                     "with each run's start-up excluded (target ≥ 1,000,000: met) (full mode, 2026-11-26 16:17 UTC)."]


def test_range_headline_gives_the_user_path_and_the_warm_path():
    """The RANGE headline: the engine path only ever "reached" (an upper bound), the user's path
    and the warm-workers path each with their own verdict against 3x."""
    from bench.report import _range_headline

    rp = {"configs": [{"chunk_instants": 25, "strata": [{"seconds": 2.0}, {"seconds": 1.0}],
                       "sss": [{"seconds": 4.0}, {"seconds": 3.5}]}], "date": "d0", "load": "1-2"}
    rc = {"ratio": 1.5, "strata_extra_seconds": 2.0, "sss_extra_seconds": 3.0, "tuples": 1_000_000, "small": 20_000,
          "sss_jvm": "Spark's defaults", "date": "d1", "load": "1-3"}
    rw = {"ratio": 1.55, "strata_extra_seconds": 1.3, "sss_extra_seconds": 2.01, "date": "d2", "load": "2-3"}
    line = _range_headline(rp, rc, rw)
    assert "**reached**: 3.5x at 25 instant(s)" in line
    assert "**1.5x (not met)**: 2.0 s against Structured Streaming's 3.0 s" in line
    assert ("With `strata replay --cluster` onto a `strata up` cluster's warm workers **1.6x (not met)**: 1.3 s "
            "against 2.01 s (`python -m bench.peers --cli --warm`, d2, load 2-3)") in line
    assert "warm workers" not in _range_headline(rp, rc)  # no record, no clause


def _scaling_run(wl, n, process, master, worker, client=0.5, chunks=None, warmup=False, load=1.0, net=None):
    return {"workload": wl, "tuples": n, "warmup": warmup, "process": process, "throughput": round(n / process),
            "master_cpu": master, "worker_cpu": worker, "client_cpu": client, "chunks": chunks or n // 20_000,
            "units": 2, "merged_p50": 10.0, "engine_p50_ms": 500.0, "transport_p50_ms": 50.0, "load_before": load,
            "load_after": load + 0.5, "net_bytes": net}


def test_scaling_model_marginal_costs_and_projection():
    """bench/scaling.py's model: marginal per-tuple costs from a small and a large run, and
    T(N) = min(1 / c_master, N / c_worker) with its knee where the single master becomes the bound."""
    from bench.scaling import costs_and_projection, marginal, project, summarize

    assert marginal(1.0, 3.0, 20_000, 1_020_000) == 2e-6
    assert marginal(None, 3.0, 1, 2) is None and marginal(1.0, 2.0, 5, 5) is None
    p = project(1e-6, 4e-6, hosts=range(1, 9))
    assert p["knee"] == 4.0 and p["master_bound"] == 1e6
    assert [q["bound"] for q in p["points"]] == ["workers"] * 4 + ["master"] * 4
    assert [round(q["throughput"]) for q in p["points"]][:5] == [250_000, 500_000, 750_000, 1_000_000, 1_000_000]
    # a link too slow for the master: the network bounds before the master does
    p = project(1e-6, 4e-6, hosts=range(1, 9), c_net=2e-6)
    assert p["points"][-1]["bound"] == "network" and p["points"][-1]["throughput"] == 500_000
    import pytest

    with pytest.raises(ValueError):
        project(0.0, 1e-6)

    runs = [_scaling_run("rows", 20_000, 0.1, 2.0, 0.1, warmup=True),  # warm-up: not counted
            _scaling_run("rows", 20_000, 0.2, 2.02, 0.15), _scaling_run("rows", 1_020_000, 1.2, 3.02, 1.15),
            _scaling_run("range", 20_000, 0.2, 2.02, 0.15), _scaling_run("range", 1_020_000, 2.2, 4.02, 4.15)]
    s = summarize(runs, "rows", 20_000, 1_020_000)
    assert s["runs"] == 1 and s["throughput"] == 850_000 and s["throughput_marginal"] == 1_000_000
    assert abs(s["master_cpu_per_tuple"] - 1e-6) < 1e-12 and abs(s["worker_cpu_per_tuple"] - 1e-6) < 1e-12
    assert abs(s["worker_cpu_per_chunk"] - 0.02) < 1e-9 and s["tuples_per_chunk"] == 20_000
    assert s["engine_ms_chunk"] == 50.0 and s["transport_ms_chunk"] == 5.0
    targets = [{"axis": "hosts", "count": c, "label": f"hosts N={c}",
                "summary": {wl: summarize(runs, wl, 20_000, 1_020_000) for wl in ("range", "rows")}} for c in (1, 2)]
    m = costs_and_projection(targets, None)
    assert m["range"]["source"] == "hosts N=1" and round(m["range"]["knee"], 6) == 2.0  # 4 µs worker / 2 µs master
    assert m["range"]["measured"][1]["efficiency"] == targets[0]["summary"]["range"]["throughput"] / 250_000
    # without the hosts axis (no namespaces) the model takes one worker on the shared host
    for t in targets:
        t["axis"] = "workers"
        t["label"] = t["label"].replace("hosts N", "workers W")
    assert costs_and_projection(targets, None)["rows"]["source"] == "workers W=1"
    # the report recomputes stored results with this version's analysis
    from bench.scaling import refresh

    sc = refresh({"sizes": [20_000, 1_020_000], "targets": [{"axis": "hosts", "count": 1, "label": "hosts N=1",
                                                            "runs": runs}]})
    assert sc["targets"][0]["summary"]["rows"]["throughput_marginal"] == 1_000_000
    assert sc["model"]["rows"]["source"] == "hosts N=1"


def test_scaling_section_renders(tmp_path):
    from bench.report import write_report
    from bench.scaling import costs_and_projection, summarize

    runs = [_scaling_run(wl, n, p, m, w, load=3.5 if wl == "range" else 1.0, net=n * 40)
            for wl in ("range", "rows") for n, p, m, w in ((20_000, 0.2, 2.0, 0.1), (1_020_000, 2.2, 4.0, 4.1))]
    targets = [{"axis": axis, "count": c, "label": f"{axis} {c}", "shares": "CPU 1: master, h2",
                "setup": {"tasks_per_executor": {"work0/app-1/0": 12}} if axis == "executors" else {},
                "summary": {wl: summarize(runs, wl, 20_000, 1_020_000) for wl in ("range", "rows")}}
               for axis in ("workers", "executors", "hosts") for c in (1, 2)]
    breakdown = {wl: {"ingest": 20.0, "advance": 30.0, "wire": 10.0, "total": 60.0, "bytes_per_tuple": 30.0}
                 for wl in ("range", "rows")}
    sc = {"sizes": [20_000, 1_020_000], "reps": 1, "cpus": 2, "per_instant": 20_000, "load_start": 1.0,
          "load_end": 2.0, "mode": "quick", "date": "today", "targets": targets, "netns": True,
          "checks": ["hosts 1 rows 20,000 run 1: DuckDB agrees on all 1 instants"], "master_path": breakdown,
          "model": costs_and_projection(targets, breakdown)}
    write_report({"meta": {"command": "test", "mode": "quick"}, "scaling": sc}, tmp_path)
    text = (tmp_path / "README.md").read_text()
    assert "## Scaling: workers, Spark executors, hosts (issue 31) (quick mode, today)" in text
    assert "| hosts | 1 | CPU 1: master, h2 | range | 463,636 | 500,000 | 2.20 | 51 (2) | — | 2.00 | 4.00 |" in text
    assert "**under load**" in text.split("| hosts | 1 | CPU 1: master, h2 | range |")[1].split("\n")[0]
    assert "**under load**" not in text.split("| hosts | 1 | CPU 1: master, h2 | rows |")[1].split("\n")[0]
    assert "| range | 2.00 | 20, 30, 10 | 1,940 | 4.00 |" in text  # 2 µs − 60 ns of the master's steps
    assert "**T(N) = min(1 / c_master, N / c_worker)**" in text and "single master per level" in text
    assert "| range | 250,000 (workers) | 500,000 (workers) | 500,000 (master) |" in text  # knee at 2 hosts
    assert "E=1: work0/app-1/0 12" in text and "Correctness: all 1 outputs" in text
    assert "python -m bench.run --only scaling" in text
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (tmp_path / "scaling.png").exists()


def test_streaming_protocol_pieces():
    """bench/streaming.py at tiny scale, no cluster: the rate search, the CLI's pacing schedule, the latency
    verdict, and the join references (ISTREAM exactly; each pair once) with the check that uses them."""
    import pyarrow as pa

    from bench import streaming as S

    nxt = S.next_rate
    assert nxt({}, 10_000) == 10_000
    assert nxt({10_000: True, 20_000: True}, 10_000) == 40_000
    assert nxt({10_000: True, 20_000: True, 40_000: False}, 10_000) == 30_000
    assert nxt({10_000: True, 20_000: True, 40_000: False, 30_000: True}, 10_000) == 35_000
    assert nxt({10_000: True, 20_000: False, 15_000: True, 17_000: True}, 10_000) == 18_000
    assert nxt({10_000: True, 20_000: False, 19_000: True}, 10_000) is None  # within 10 % of the pass
    assert nxt({10_000: False}, 10_000) == 5_000 and nxt({1_000: False}, 1_000) is None
    assert nxt({S.MAX_RATE: True}, 10_000) is None

    # the CLI's batches: an instant of R <= 65536 tuples closes at its own second; a bigger one with its last batch
    sched = S.schedule(S.make_inputs("range", 2_000, 4), 2_000)
    assert sched == {0: 0.0, 1: 1.0, 2: 2.0, 3: 3.0}
    sched = S.schedule(S.make_inputs("range", 100_000, 3), 100_000)
    assert [round(sched[t], 5) for t in range(3)] == [0.65536, 1.65536, 2.65536]
    sched = S.schedule(S.make_inputs("join", 2_000, 3), 2_000)
    assert sched == {0: 0.5, 1: 1.5, 2: 2.5}  # Vitals then Positions: the advance rides on the second

    close = {t: float(t) for t in range(20)}
    lat = S.latency_stats(close, {t: t + 0.5 for t in range(20)}, {t: 10 for t in range(20)}, 10, 19)
    assert lat["p99"] == 0.5 and lat["last"] == 0.5 and lat["missing"] == 0 and lat["rows"] == 100
    assert S.verdict(lat, 0.0, (1, 2)) == (True, "sustained")
    ok, why = S.verdict(lat, 0.0, (1, 9))
    assert not ok and "backlog" in why
    late = S.latency_stats(close, {t: t + (3.0 if t == 19 else 0.5) for t in range(19)}, {t: 1 for t in range(20)},
                           10, 19)
    assert late["missing"] == 1 and not S.verdict(late, 0.0)[0]

    v = pa.table({"ts": [0, 0, 5, 12], "level": ["U", "S", "C", "TS"], "sid": ["a", "b", "a", "a"],
                  "bp": [161.0, 170.0, 165.0, 162.0], "pr": [0.0] * 4, "weight": [0.0] * 4})
    p = pa.table({"ts": [3, 11, 20], "level": ["C", "U", "U"], "sid": ["a", "a", "a"], "lat": [86.0, 87.0, 88.0],
                  "lon": ["E"] * 3})
    exp = S.duckdb_join(v, p)
    # pairs within 9 instants (v, p): (0,3) at 3, (5,3) at 5, (5,11) at 11, (12,3) and (12,11) at 12, (12,20) at 20
    assert {t: sorted(c) for t, c in exp["pairs"].items()} == {
        3: [("a", 161.0, 86.0)], 5: [("a", 165.0, 86.0)], 11: [("a", 165.0, 87.0)],
        12: [("a", 162.0, 86.0), ("a", 162.0, 87.0)], 20: [("a", 162.0, 88.0)]}
    assert exp["istream"][5] == {("a", 165.0, 86.0, "C"): 1}
    assert exp["istream"][12] == {("a", 162.0, 86.0, "TS"): 1, ("a", 162.0, 87.0, "TS"): 1}
    got = pa.table({"ts": [3, 5, 11, 12, 12, 20], "level": ["C", "C", "C", "TS", "TS", "TS"], "sid": ["a"] * 6,
                    "bp": [161.0, 165.0, 165.0, 162.0, 162.0, 162.0], "lat": [86.0, 86.0, 87.0, 86.0, 87.0, 88.0]})
    assert S.check("join", exp, got, set(range(21)), True, "tiny") == 6
    peer = got.drop_columns(["level"]).rename_columns(["tau", "sid", "bp", "lat"])
    assert S.check("join", exp, peer, set(range(21)), False, "tiny") == 6
    import pytest

    from bench.check import BenchCheckFailed

    with pytest.raises(BenchCheckFailed):
        S.check("join", exp, got.slice(1), set(range(21)), True, "tiny")


def test_streaming_section_renders():
    from bench import streaming as S

    run = {"side": "strata", "query": "range", "rate": 20_000, "p50": 0.3, "p99": 0.9, "last": 0.3, "lag": 0.01,
           "backlog": [1, 1], "timings": {"engine_p50_ms": 200.0, "transport_p50_ms": 15.0, "wait_p50_ms": 100.0},
           "why": "sustained", "load": [[1.0, 1, 1], [1.5, 1, 1]]}
    peer = {**run, "side": "sss_p2", "rate": 5_000, "backlog": None, "timings": None}
    st = {"bounds": {"p99": 2.0, "last": 2.0, "lag": 1.0, "backlog": 2}, "load_start": [1.0, 1, 1], "cpus": 2,
          "range": {"query": S.RANGE_Q, "runs": [run, peer], "best": {"strata": 20_000, "sss_p2": 5_000},
                    "ratio": {"sss_p2": 4.0}}}
    text = "\n".join(S.report_section(st))
    assert "| range | Strata (`strata up`, 2 workers) | 20,000 |" in text and "| 4.0x |" in text
    assert "200 / 15 / 100" in text
    st["range"].update(date="2026-11-27 13:00 UTC", load_start=[2.0, 1, 1], load_end=[3.0, 1, 1],
                       command="python -m bench.streaming --queries range")
    text = "\n".join(S.report_section(st))
    assert "Runs: range: 2026-11-27 13:00 UTC, load 2.0 at its start and 3.0 at its end" in text
    assert S._rates(["strata=60000,65000", "sss_p2=1000"]) == {"strata": [60000, 65000], "sss_p2": [1000]}


def test_access_cluster_pieces(tmp_path):
    """bench/access_cluster.py without a cluster: the reference it checks every run against (a tiny input,
    a wrong output refused), the switch's expected rows, the summary and its table, and access.md keeping
    the master-path part when only the cluster part is written."""
    import pytest

    from bench import access, access_cluster as A
    from bench.check import BenchCheckFailed

    tables = {"Vitals": W.vitals(2_000, 500, 1), "Positions": W.positions(2_000, 500, 2)}
    ref = A.Reference(tables)
    assert ref.instants == [0, 1, 2, 3]
    plain, policy = ref.rows("plain"), ref.rows("policy")
    assert all(plain[t] for t in ref.instants) and sum(map(len, policy.values())) < sum(map(len, plain.values()))
    assert {r[2] for rs in policy.values() for r in rs} <= {f"s{i}" for i in range(W.SIDS // 2)}
    rows = [r for rs in plain.values() for r in rs]
    assert "the reference agrees on all 4 instants" in A.check(ref, "plain", rows, None, "t")
    with pytest.raises(BenchCheckFailed):
        A.check(ref, "plain", rows[1:], None, "t")
    # off over [1, 3): no rows there; instant 3's window lost instant 2 (ROWS 100 within instant 3: the same rows)
    sw = ref.switched(1, 3)
    assert sorted(sw) == [0, 3] and sw[0] == plain[0] and sorted(sw[3]) == sorted(plain[3])
    A.check(ref, "switch", [r for t in (0, 3) for r in plain[t]], (1, 3), "t")
    with pytest.raises(BenchCheckFailed):
        A.check(ref, "switch", rows, (1, 3), "t")
    joined = ref.rows("join/shielded")
    assert {r[2] for rs in joined.values() for r in rs} <= {f"s{i}" for i in range(W.SIDS // 2)}

    def run(v, thr, cpu, lat, sw=None):
        return {"variant": v, "seconds": 1.0, "throughput": thr, "throughput_after_first": thr * 2,
                "first_result": 0.5, "cpu_seconds": cpu, "chunk_latency_ms": lat, "engine_p50_ms": lat / 2,
                "ingest_seconds": 0.8, "out_rows": 10, "load": [[1.0, 1, 1], [2.0, 1, 1]], "switch": sw,
                "switches": [{"blocked": 7}] if sw else []}

    fast = A.summarize({"plain": [run("plain", 100, 2.0, 10), run("plain", 120, 2.2, 12)],
                        "policy": [run("policy", 90, 2.2, 11), run("policy", 110, 2.2, 12)]}, "fast")
    assert fast["variants"]["policy"]["throughput"] == 100 and round(fast["variants"]["policy"]["throughput_vs"], 2) == -9.09
    assert round(fast["variants"]["policy"]["cpu_seconds_paired"], 2) == 5.0  # median of +10 % and 0 %
    paced = A.summarize({"plain": [run("plain", 50, 2.0, 10)], "switch": [run("switch", 50, 1.5, 9, (3, 6))]}, "paced")
    res = {"tuples": 1000, "per_instant": 100, "rate": 100, "reps": 2, "started": "s", "finished": "f",
           "load_start": [1, 1, 1], "load_end": [2, 2, 2], "cpus": 2, "hooks_at": [0.2, 0.55], "checks": ["a"] * 6,
           "modes": {"fast": fast, "paced": paced}}
    text = A.render(res)
    assert text.startswith(A.HEADING) and "| policy | agg | 100 | -9.1 % (-9.2 %) | 0.80 | 0.50 / 1.00 | 2.20 | +4.8 % (+5.0 %) |" in text
    assert "off over instants [3, 6) of 10, tuples blocked [7]" in text and "2.0 s and 5.5 s after" in text and "| switch | 1.00 | 1.5 | -25.0 % (-25.0 %) | 9 | -10.0 % (-10.0 %) |" in text
    out = tmp_path / "access.md"
    access.write_doc(master_text="# master part\n\nfigures\n", out=out)
    access.write_doc(cluster_text=text, out=out)
    access.write_doc(master_text="# master part\n\nnew figures\n", out=out)
    got = out.read_text()
    assert got.startswith("# master part\n\nnew figures\n") and got.count(A.HEADING) == 1 and "| policy | agg |" in got
