"""bench/turns.py (Table 9.8) without a cluster: its input, its summary and its page."""

from __future__ import annotations

from bench import turns


def _run(policy: str, seconds: float) -> dict:
    lv = {x: 1.0 for x in turns.LEVELS}
    return {"policy": policy, "seconds": seconds, "cpu_seconds": 10.0, "chunk_latency_ms": dict(lv),
            "level_last": dict(lv)}


def test_input_is_unclassified_and_the_queries_are_the_dissertations():
    t = turns.u_only(9_000)
    assert t.num_rows == 9_000 and set(t.column("level").to_pylist()) == {"U"}
    assert t.column("ts").to_pylist()[-1] == 2  # 4,000 tuples an instant
    assert turns.QUERIES["C"].endswith("[ROWS 100 level in {C, U}]") and set(turns.QUERIES) == set(turns.LEVELS)


def test_summary_gives_the_overheads_and_the_page_renders_beside_the_paper():
    s = turns.summarize({"shared": [_run("shared", 10.0)], "round_robin": [_run("round_robin", 10.0), _run("round_robin", 12.0)],
                         "fixed_slot": [_run("fixed_slot", 11.5)]})
    assert s["round_robin"]["seconds"] == 11.0 and s["fixed_slot"]["overhead_vs_round_robin_pct"] == 4.55
    assert s["fixed_slot"]["overhead_vs_shared_pct"] == 15.0
    text = turns.render({"summary": s, "started": "a", "finished": "b", "cpus": 2, "load_start": [1], "load_end": [1],
                         "command": "python -m bench.turns", "tuples_per_level": 100, "rate": 40_000, "checks": ["ok"]})
    assert "| `fixed_slot` | 11.50 | +4.55 % | +15.00 % |" in text and "| 1M | 26,928 | 27,424 | 1.807 % |" in text
