"""bench/trusted.py without a cluster (as tests/test_bench.py does for the other benchmarks): the reference it
checks every run against (a tiny input; a wrong output refused), the summary's gains, the page's table and
trusted.md keeping its hand-written part when the measured part is regenerated."""

from __future__ import annotations

import pytest


def _run(mode: str, seconds: float, cpu: float) -> dict:
    return {"mode": mode, "seconds": seconds, "throughput": round(200 / seconds), "cpu_seconds": cpu,
            "client_cpu_seconds": 1.0, "level_seconds": {"S": seconds - 0.1, "TS": seconds},
            "first_result": {"S": 0.5, "TS": 0.6}, "chunk_latency_ms": {"S": 100.0, "TS": 120.0},
            "register_ms": {"S": 10.0, "TS": 12.0}, "load": [[1.0, 1.0, 1.0], [2.0, 1.0, 1.0]], "out_rows": 42,
            "counters": {"S": {}, "TS": {}}}


def test_trusted_bench_pieces(tmp_path):
    from bench import trusted as T
    from bench import workloads as W
    from bench.check import BenchCheckFailed

    tables = {"Vitals": W.vitals(400, 100), "Positions": W.positions(400, 100)}
    ref = T.Reference(tables)
    want = ref.rows("S", T.Q_MAX)
    assert [r[0] for r in want] == ref.instants == [0, 1, 2, 3]
    T.check(ref, "S", T.Q_MAX, list(want), "tiny")
    with pytest.raises(BenchCheckFailed):
        T.check(ref, "S", T.Q_MAX, [(r[0], r[1], r[2] + 1) for r in want], "tiny")
    assert ref.rows("TS", T.Q_JOIN) == ref.rows("S", T.Q_JOIN)  # level in {U}: the same rows at both levels

    runs = {"replicated": [_run("replicated", 4.0, 8.0), _run("replicated", 6.0, 9.0)],
            "trusted": [_run("trusted", 2.0, 6.0), _run("trusted", 3.0, 7.0)],
            "trusted/no-sharing": [_run("trusted/no-sharing", 3.0, 7.0), _run("trusted/no-sharing", 4.0, 8.0)]}
    s = T.summarize(runs)
    assert s["trusted"]["gain_vs_replicated_pct"] == 100.0  # (5 - 2.5) / 2.5, the dissertation's gain
    assert s["trusted"]["gain_paired_pct"] == 100.0
    assert s["trusted"]["gain_vs_no_sharing_pct"] == 40.0
    r = {"summary": s, "tuples_per_stream": 100, "per_instant": 100, "levels": ["S", "TS"], "queries": T.QUERIES,
         "rounds": 2, "runs_per_up": 1, "cpus": 2, "command": "python -m bench.trusted", "started": "a",
         "finished": "b", "load_start": [1.0, 1.0, 1.0], "load_end": [2.0, 1.0, 1.0], "checks": ["x"] * 6,
         "ups": {m: [{"seconds": 10.0, "tree": {"head": "abc", "diff_sha1": "0", "dirty": []}}] for m in runs},
         "plan_generation": {e: {"vanilla_ms": 1.0, "trusted_ms": 1.1, "overhead_pct": 10.0} for e in T.PLAN_EXPS}}
    text = T.render(r)
    assert "| trusted | 1 master, 2 workers | 2.50 (2.00, 3.00) |" in text
    assert "+100.0 % (+100.0 %)" in text and "HEAD abc (no uncommitted changes)." in text
    out = tmp_path / "trusted.md"
    out.write_text("# hand-written\n\nreading\n\n" + T.MARK + "\n\nold figures\n")
    T.write_doc(text, out)
    got = out.read_text()
    assert got.startswith("# hand-written\n\nreading\n") and "old figures" not in got and "| replicated |" in got
