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
