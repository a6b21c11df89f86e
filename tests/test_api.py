"""The Python API (strata/api.py, issue 35): ``strata.connect`` against a running cluster.

A session registers queries, ingests a pandas DataFrame, a pyarrow Table and a file exactly once, reads
``(instant, table)`` results equal to the reference evaluator's, sees typed errors, and an analyst's
status carries no cluster part.  Offline: the per-instant split and the producer id."""

from __future__ import annotations

import pandas as pd
import pyarrow as pa
import pytest

import strata
from strata.config import load_config
from strata.api import (BATCH_ROWS, LoginFailed, PermissionDenied, QueryFailed, QueryRejected, Session,
                        _derived_producer_id, by_instant)

from .helpers import PASSWORD, write_csv
from .reference.evaluator import compare_results, evaluate
from .tables import vital


def test_by_instant_splits_a_result_batch_per_instant():
    t = pa.table({"ts": [1, 1, 2, 5, 5, 5], "level": ["U"] * 6, "x": [1, 2, 3, 4, 5, 6]})
    parts = list(by_instant(t))
    assert [(ts, p.column("x").to_pylist()) for ts, p in parts] == [(1, [1, 2]), (2, [3]), (5, [4, 5, 6])]
    assert list(by_instant(t.slice(0, 0))) == []


def test_the_same_data_sent_the_same_way_has_the_same_producer_id():
    t = pa.table({"ts": [1, 2], "sid": ["a", "b"], "bp": [1.0, 2.0]})
    a = _derived_producer_id("Vitals", t, False, True, BATCH_ROWS, "S")
    assert a == _derived_producer_id("vitals", t, False, True, BATCH_ROWS, "S")
    assert a != _derived_producer_id("Vitals", t.slice(0, 1), False, True, BATCH_ROWS, "S")
    assert a != _derived_producer_id("Vitals", t, True, True, BATCH_ROWS, "S")


def test_connect_needs_a_password(monkeypatch):
    monkeypatch.delenv("STRATA_PASSWORD", raising=False)
    with pytest.raises(LoginFailed, match="no password"):
        strata.connect("127.0.0.1:1", "jane", "S")


@pytest.mark.slow
def test_a_session_registers_ingests_and_reads_results_equal_to_the_reference(warm_s, tmp_path):
    cl = warm_s.renew({"ann": "TS", "al": ("S", "analyst")})
    rows = [vital(t, lv, s, bp) for t, lv, s, bp in
            [(1, "U", "a", 100.0), (1, "S", "b", 120.0), (2, "C", "a", 130.0), (3, "TS", "a", 999.0),
             (3, "U", "b", 90.0), (4, "S", "a", 150.0), (5, "U", "b", 80.0), (6, "C", "a", 70.0)]]
    text = "SELECT sid, AVG(bp) AS a FROM Vitals [ROWS 2] GROUP BY sid"
    with strata.connect(cl["master"], "ann", "S", tls_dir=cl["tls"], password=PASSWORD) as s:
        assert isinstance(s, Session) and s.level == "S"
        q = s.register(text)
        assert "level in" in q.text  # the rewritten text
        cols = ["ts", "level", "sid", "bp", "pr", "weight"]
        frame = pd.DataFrame([{c: r.get(c) for c in cols} for r in rows[:3]])
        table = pa.Table.from_pylist([{c: r.get(c) for c in cols} for r in rows[3:6]])
        path = tmp_path / "rest.csv"
        write_csv(path, cols, [tuple(r.get(c) for c in cols) for r in rows[6:]])
        first = s.ingest("Vitals", frame, labelled=True)
        assert first.accepted == 3 and first.batches == 1
        again = s.ingest("Vitals", frame, labelled=True)  # the same data the same way: applied once
        assert again.duplicates == 1  # acknowledged as already applied (the results below hold it once)
        second = s.ingest("Vitals", table, labelled=True)
        assert second.accepted == 2 and second.dropped_by_shepherd == 1  # the TS row: above the master
        s.ingest("Vitals", str(path), labelled=True, finish=True)
        got = [(ts, part) for ts, part in q.results()]
        assert [ts for ts, _ in got] == sorted({ts for ts, _ in got})
        flat = [r for _, part in got for r in zip(*[part.column(c).to_pylist() for c in part.column_names])]
        compare_results(flat, evaluate(text, load_config(cl["config"]), "S", {"Vitals": rows}))
        st = s.status()
        assert st.level == "S" and st.user.startswith("ann") and [x.query_id for x in st.queries] == [q.query_id]
        assert st.queries[0].state == "ended" and st.cluster is not None  # ann is an operator too
        assert len(q.to_pandas()) == len(flat)  # an ended query's results again, from the master's retention
        with pytest.raises(QueryRejected, match="unknown stream"):
            s.ingest("Nope", str(path))
        with pytest.raises(QueryRejected):
            s.register("SELECT nope FROM Vitals")
    with strata.connect(cl["master"], "al", "S", tls_dir=cl["tls"], password=PASSWORD) as a:
        assert a.status().cluster is None  # an analyst: no cluster part
        with pytest.raises(PermissionDenied):
            a.ingest("Vitals", table, labelled=True)
    with pytest.raises(LoginFailed):
        strata.connect(cl["master"], "ann", "S", tls_dir=cl["tls"], password="wrong")


@pytest.mark.slow
def test_a_failing_query_raises_after_its_rows(warm_s):
    cl = warm_s.renew({"fay": "S"})
    with strata.connect(cl["master"], "fay", "S", tls_dir=cl["tls"], password=PASSWORD) as s:
        q = s.register("SELECT ts * 4611686018427387904 AS big FROM Vitals [NOW]")
        s.ingest("Vitals", pa.table({"ts": [1, 2, 3], "sid": ["a", "b", "c"], "bp": [1.0, 2.0, 3.0],
                                     "pr": [0.0] * 3, "weight": [0.0] * 3}), finish=True)
        seen = []
        with pytest.raises(QueryFailed, match="integer overflow") as e:
            for ts, part in q.results():
                seen.append((ts, part.column("big").to_pylist()))
        assert seen == [(1, [4611686018427387904])] and e.value.query_id == q.query_id
