"""Issue 30 item 2: deep queries are refused with one line, never a traceback or UNKNOWN.

The bounds of ``strata/mlscql/limits.py`` (text length, SELECT nesting, operators and arithmetic
operators nested in one expression) are checked on lark's parse tree with an explicit stack,
before anything recursive runs.  At each limit a query of every shape is accepted by every stage
(and with half of Python's default stack); one past it is refused with one ``limit error`` line:
by ``compile_query``, by ``strata explain`` (exit 2), by a master (INVALID_ARGUMENT, exit 2, while
its other sessions go on) and by ``strata replay`` before its cluster starts.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest

from strata.config import parse_config
from strata.mlscql import LimitError, QueryError, compile_query, parse
from strata.mlscql.limits import MAX_ARITH_DEPTH, MAX_EXPR_DEPTH, MAX_NESTING, MAX_QUERY_CHARS

from .conftest import BATTLEFIELD_TOML
from .helpers import login

NEST, DEPTH, ARITH = MAX_NESTING, MAX_EXPR_DEPTH, MAX_ARITH_DEPTH
NEST_MSG = "query nests SELECTs {n} deep (subqueries in FROM, set operations and parenthesized queries; at most " \
    + str(NEST) + ")"


# ---- shapes: each builds a query whose depth is exactly n ---------------------------------------------
def nested_from(n: int, leaf: str = "SELECT bp FROM Vitals", col: str = "bp") -> str:
    """Subqueries in FROM, n SELECTs deep."""
    q = leaf
    for i in range(n - 1):
        q = f"SELECT {col} FROM ({q}) s{i}"
    return q


def union_chain(n: int, op: str = "UNION ALL", leaf: str = "SELECT bp FROM Vitals") -> str:
    """n SELECTs of a set-operation chain: left-nested, n deep."""
    return f" {op} ".join([leaf] * n)


def parenthesized(n: int) -> str:
    """A SELECT in n - 1 pairs of parentheses."""
    return "(" * (n - 1) + "SELECT bp FROM Vitals" + ")" * (n - 1)


def paren_compounds(n: int) -> str:
    """``a UNION ALL (b UNION ALL (…))`` inside subqueries: each UNION with its parentheses is 2 levels, a
    subquery (or, for an even n, one more pair of parentheses) 1."""
    q, depth = "SELECT bp FROM Vitals", 1
    while depth + 2 <= n:
        q, depth = f"SELECT bp FROM Vitals UNION ALL ({q})", depth + 2
    return f"SELECT bp FROM ({q}) x" if depth < n else q


def chain(op: str, n: int, term: str = "bp > 0") -> str:
    """``term op term op …`` with n terms (left-nested)."""
    return f" {op} ".join([term] * n)


def right_nested(n: int) -> str:
    """``bp > 0 AND (bp > 0 AND (…))``: n - 1 ANDs and a comparison, n operators deep."""
    return "bp > 0 AND (" * (n - 1) + "bp > 0" + ")" * (n - 1)


def plus(n: int, leaf: str = "bp") -> str:
    """n additions: n arithmetic operators deep."""
    return leaf + " + 1" * n


#: (name, build(n) -> query, the limit, the message one past it: a format of n)
def where(cond) -> callable:
    return lambda n: f"SELECT bp FROM Vitals WHERE {cond(n)}"


EXPR_MSG = "{clause}: expression nested {n} operators deep (at most " + str(DEPTH) + ")"
ARITH_MSG = "{clause}: arithmetic nested {n} operators deep (+ - * / % and unary minus; at most " + str(ARITH) + ")"

SHAPES = [
    # SELECT nesting
    ("subqueries in FROM", nested_from, NEST, NEST_MSG),
    ("UNION ALL chain", union_chain, NEST, NEST_MSG),
    ("EXCEPT chain", lambda n: union_chain(n, "EXCEPT"), NEST, NEST_MSG),
    ("INTERSECT chain", lambda n: union_chain(n, "INTERSECT"), NEST, NEST_MSG),
    ("parenthesized query", parenthesized, NEST, NEST_MSG),
    ("parenthesized compounds in subqueries", paren_compounds, NEST, NEST_MSG),
    # operators nested in one expression
    ("AND chain", where(lambda n: chain("AND", n)), DEPTH, EXPR_MSG.replace("{clause}", "WHERE")),
    ("OR chain", where(lambda n: chain("OR", n)), DEPTH, EXPR_MSG.replace("{clause}", "WHERE")),
    ("NOT chain", where(lambda n: "NOT " * (n - 1) + "bp > 0"), DEPTH, EXPR_MSG.replace("{clause}", "WHERE")),
    ("parenthesized AND", where(right_nested), DEPTH, EXPR_MSG.replace("{clause}", "WHERE")),
    ("NOT in SELECT", lambda n: "SELECT " + "NOT " * (n - 1) + "bp > 0 AS x FROM Vitals", DEPTH,
     EXPR_MSG.replace("{clause}", "SELECT")),
    ("OR in GROUP BY", lambda n: f"SELECT COUNT(*) AS c FROM Vitals GROUP BY {chain('OR', n)}", DEPTH,
     EXPR_MSG.replace("{clause}", "GROUP BY")),
    ("AND in HAVING", lambda n: f"SELECT sid FROM Vitals GROUP BY sid HAVING {chain('AND', n - 1, 'MAX(bp) > 0')}",
     DEPTH, EXPR_MSG.replace("{clause}", "HAVING")),
    ("AND in a window condition", lambda n: f"SELECT bp FROM Vitals [ROWS 10 WHERE {chain('AND', n)}]", DEPTH,
     EXPR_MSG.replace("{clause}", "window of Vitals")),
    ("IN lists", where(lambda n: "TRUE IN (" * (n - 1) + "bp IN (1, 2)" + ", FALSE)" * (n - 1)), DEPTH,
     EXPR_MSG.replace("{clause}", "WHERE")),
    # arithmetic nested in one expression
    ("+ chain in SELECT", lambda n: f"SELECT {plus(n)} AS x FROM Vitals", ARITH,
     ARITH_MSG.replace("{clause}", "SELECT")),
    ("+ chain in WHERE", where(lambda n: f"{plus(n)} > 0"), ARITH, ARITH_MSG.replace("{clause}", "WHERE")),
    ("* and / chain", lambda n: "SELECT bp" + " * 2 / 3" * (n // 2) + " * 2" * (n % 2) + " AS x FROM Vitals", ARITH,
     ARITH_MSG.replace("{clause}", "SELECT")),
    ("unary minus chain", lambda n: "SELECT " + "- " * n + "bp AS x FROM Vitals", ARITH,
     ARITH_MSG.replace("{clause}", "SELECT")),
    ("parenthesized +", lambda n: "SELECT " + "bp + (" * (n - 1) + "bp + 1" + ")" * (n - 1) + " AS x FROM Vitals",
     ARITH, ARITH_MSG.replace("{clause}", "SELECT")),
    ("+ chain in GROUP BY", lambda n: f"SELECT COUNT(*) AS c FROM Vitals GROUP BY {plus(n)}", ARITH,
     ARITH_MSG.replace("{clause}", "GROUP BY")),
    ("+ chain in HAVING", lambda n: f"SELECT sid FROM Vitals GROUP BY sid HAVING MAX({plus(n)}) > 0", ARITH,
     ARITH_MSG.replace("{clause}", "HAVING")),
    ("+ chain in a window condition", lambda n: f"SELECT bp FROM Vitals [ROWS 10 WHERE {plus(n)} > 0]", ARITH,
     ARITH_MSG.replace("{clause}", "window of Vitals")),
    # both at once: the deepest path of a WHERE of DEPTH operators holds ARITH arithmetic ones
    ("deep path", where(lambda n: chain("AND", n - ARITH, "bp > 0").replace("bp > 0", f"{plus(ARITH)} > 0", 1)),
     DEPTH, EXPR_MSG.replace("{clause}", "WHERE")),
    ("deep path in the deepest subquery", lambda n: nested_from(n, "SELECT bp FROM Vitals WHERE " + chain(
        "AND", DEPTH - ARITH, "bp > 0").replace("bp > 0", f"{plus(ARITH)} > 0", 1)), NEST, NEST_MSG),
]
IDS = [s[0] for s in SHAPES]


@pytest.fixture(scope="module")
def cfg():
    return parse_config(BATTLEFIELD_TOML)


@pytest.fixture
def cfg_file(tmp_path):
    p = tmp_path / "battle.toml"
    p.write_text(BATTLEFIELD_TOML)
    return p


def refused(text: str, cfg) -> str:
    with pytest.raises(LimitError) as e:
        compile_query(text, cfg, "S")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("limit error: "), msg
    return msg


def in_thread(fn, frames: int | None = None):
    """``fn()`` on a fresh thread (as the master's and the worker's pools run it), optionally with only
    ``frames`` of the recursion limit's frames left to it (the rest used by a descent of calls, so that
    the limit itself, which every thread shares, is not changed); its value, or its exception."""
    out: dict = {}

    def depth() -> int:
        f, n = sys._getframe(), 0
        while f is not None:
            f, n = f.f_back, n + 1
        return n

    def descend(k: int):
        return descend(k - 1) if k > 0 else fn()

    def run():
        try:
            out["value"] = fn() if frames is None else descend(sys.getrecursionlimit() - frames - depth() - 1)
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            out["error"] = e

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


# ---- 1. unit: at each limit accepted, one past refused with one line -------------------------------------
@pytest.mark.parametrize("name, build, limit, message", SHAPES, ids=IDS)
def test_at_the_limit_every_stage_accepts(cfg, cfg_file, capsys, monkeypatch, name, build, limit, message):
    text = build(limit)
    parse(text)
    cq = compile_query(text, cfg, "S")
    json.dumps(cq.to_json())
    from .test_cli_frontend import run

    code, out, err = run(["explain", "--config", str(cfg_file), "--level", "S", "--json", text], capsys, monkeypatch)
    assert code == 0 and err == "", err
    assert json.loads(out)["rewritten"] == cq.rewritten


@pytest.mark.parametrize("name, build, limit, message", SHAPES, ids=IDS)
def test_one_past_the_limit_is_one_limit_error(cfg, name, build, limit, message):
    msg = refused(build(limit + 1), cfg)
    assert msg == "limit error: " + message.format(n=limit + 1), msg
    with pytest.raises(LimitError):
        parse(build(limit + 1))


@pytest.mark.parametrize("name, build, limit, message", SHAPES, ids=IDS)
def test_at_the_limit_every_stage_runs_with_half_the_default_stack(cfg, name, build, limit, message):
    """Compiling, the explain JSON, sharing's explanation and the master's pipeline of a query at a
    limit need fewer than 500 frames (measured: at most ~250 for the deepest shape), on a thread
    like the master's call pool and the worker's."""
    from strata.master.pipeline import QueryPipeline
    from strata.sharing.explain import explain_sharing

    text = build(limit)

    def every_stage():
        cq = compile_query(text, cfg, "S")
        json.dumps(cq.to_json())
        explain_sharing([cq, cq], cfg)
        QueryPipeline(cfg, "S").add_query(text)

    in_thread(every_stage, frames=500)


def test_the_first_clause_too_deep_is_named(cfg):
    text = f"SELECT {plus(ARITH + 3)} AS x FROM Vitals WHERE {chain('AND', DEPTH + 5)}"
    assert refused(text, cfg) == "limit error: " + ARITH_MSG.format(clause="SELECT", n=ARITH + 3)
    # nesting is said before any expression
    assert refused(nested_from(NEST + 2, f"SELECT bp FROM Vitals WHERE {plus(ARITH + 1)} > 0"), cfg) == \
        "limit error: " + NEST_MSG.format(n=NEST + 2)
    # a clause deep in operators and in arithmetic: the operators
    assert refused(where(lambda n: chain("AND", DEPTH).replace("bp > 0", f"{plus(ARITH + 1)} > 0", 1))(0), cfg) == \
        "limit error: " + EXPR_MSG.format(clause="WHERE", n=DEPTH + ARITH + 1)


def test_parentheses_alone_add_no_depth(cfg):
    compile_query("SELECT bp FROM Vitals WHERE " + "(" * 2000 + "bp > 0" + ")" * 2000, cfg, "S")
    compile_query(f"SELECT {'(' * 2000}bp + 1{')' * 2000} AS x FROM Vitals", cfg, "S")


@pytest.mark.parametrize("text, fragment", [
    # the issue's own examples: a traceback of 3 005 lines, UNKNOWN through a master
    (nested_from(170), NEST_MSG.format(n=170)),
    ("SELECT bp FROM Vitals WHERE " + plus(999) + " > 0", EXPR_MSG.format(clause="WHERE", n=1000)),
    ("SELECT " + plus(500) + " FROM Vitals", EXPR_MSG.format(clause="SELECT", n=500)),
    # far beyond: still one line, found without recursion
    ("SELECT bp FROM Vitals WHERE " + chain("OR", 9_000), EXPR_MSG.format(clause="WHERE", n=9_000)),
    ("SELECT " + "- " * 30_000 + "bp FROM Vitals", EXPR_MSG.format(clause="SELECT", n=30_000)),
    ("SELECT bp FROM Vitals WHERE " + plus(DEPTH - 1) + " > 0", ARITH_MSG.format(clause="WHERE", n=DEPTH - 1)),
    (union_chain(3_000), NEST_MSG.format(n=3_000)),
    (parenthesized(20_000), NEST_MSG.format(n=20_000)),
])
def test_far_past_the_limits_no_recursion_at_all(cfg, text, fragment):
    """The check is iterative and runs before lark's transformer: a tree thousands of levels deep is
    refused with 150 frames of stack (lark's LALR parse is iterative too)."""
    with pytest.raises(LimitError) as e:
        in_thread(lambda: compile_query(text, cfg, "S"), frames=150)
    assert str(e.value) == "limit error: " + fragment


def test_text_length(cfg, monkeypatch):
    """MAX_QUERY_CHARS characters are parsed (in about a second for the worst shape); one more is
    refused before lark runs."""
    base = "SELECT bp FROM Vitals "
    compile_query(base + " " * (MAX_QUERY_CHARS - len(base)), cfg, "S")
    head = "SELECT bp FROM Vitals WHERE bp"
    terms = (MAX_QUERY_CHARS - len(head) - 4) // 4
    worst = head + " + 1" * terms + " > 0"
    worst += " " * (MAX_QUERY_CHARS - len(worst))
    assert len(worst) == MAX_QUERY_CHARS
    t0 = time.monotonic()
    with pytest.raises(LimitError, match="WHERE: expression nested 24992 operators deep"):
        parse(worst)
    assert time.monotonic() - t0 < 30
    import importlib

    P = importlib.import_module("strata.mlscql.parser")

    def no_lark():
        raise AssertionError("lark ran on a text beyond MAX_QUERY_CHARS")

    monkeypatch.setattr(P, "_parser", no_lark)
    msg = refused(base + " " * (MAX_QUERY_CHARS + 1 - len(base)), cfg)
    assert msg == f"limit error: query of {MAX_QUERY_CHARS + 1} characters (at most {MAX_QUERY_CHARS})"


def test_running_out_of_stack_anyway_is_one_limit_error(cfg, monkeypatch):
    """Belt and braces: a RecursionError anywhere in the front end is a LimitError of one line."""
    # in lark's transformer (a thread whose stack is nearly used up)
    with pytest.raises(LimitError) as e:
        in_thread(lambda: parse(where(lambda n: chain("AND", n))(DEPTH)), frames=60)
    assert str(e.value).startswith("limit error: query too deeply nested") and "\n" not in str(e.value)
    # in the analyzer
    import importlib

    An = importlib.import_module("strata.mlscql.analyze")  # the module (the package exports a function of its name)

    def deep(*a, **k):
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(An, "analyze", deep)
    msg = refused("SELECT bp FROM Vitals", cfg)
    assert msg.startswith("limit error: query too deeply nested to compile")


def test_limit_errors_are_query_errors(cfg):
    """What the master and the CLI catch: a LimitError is a QueryError."""
    with pytest.raises(QueryError):
        compile_query(nested_from(NEST + 1), cfg, "S")


# ---- 2. the CLI as a user runs it ----------------------------------------------------------------------
def cli(*args):
    return subprocess.run([sys.executable, "-m", "strata", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("text", [nested_from(NEST), where(lambda n: chain("AND", n))(DEPTH),
                                  f"SELECT {plus(ARITH)} AS x FROM Vitals"], ids=["nesting", "operators", "arithmetic"])
def test_explain_at_the_limit_exits_0(cfg_file, text):
    r = cli("explain", "--config", str(cfg_file), "--level", "S", text)
    assert r.returncode == 0 and r.stderr == "", r.stderr


@pytest.mark.parametrize("text, fragment", [
    (nested_from(NEST + 1), NEST_MSG.format(n=NEST + 1)),
    (where(lambda n: chain("AND", n))(DEPTH + 1), EXPR_MSG.format(clause="WHERE", n=DEPTH + 1)),
    (f"SELECT {plus(ARITH + 1)} AS x FROM Vitals", ARITH_MSG.format(clause="SELECT", n=ARITH + 1)),
    (nested_from(170), NEST_MSG.format(n=170)),
    ("SELECT bp FROM Vitals WHERE " + plus(999) + " > 0", EXPR_MSG.format(clause="WHERE", n=1000)),
    ("SELECT bp FROM Vitals " + " " * MAX_QUERY_CHARS, f"query of {MAX_QUERY_CHARS + 22} characters"),
], ids=["nesting", "operators", "arithmetic", "issue-170-subqueries", "issue-1000-terms", "text"])
def test_explain_one_past_the_limit_exits_2_with_one_line(cfg_file, text, fragment):
    r = cli("explain", "--config", str(cfg_file), "--level", "S", text)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.startswith("strata: limit error: " + fragment) and r.stderr.count("\n") == 1, r.stderr[:2000]
    assert "Traceback" not in r.stderr


# ---- a master in process: a client's query never gets UNKNOWN ---------------------------------------------------
def test_a_master_answers_a_query_past_a_limit_or_a_failing_compile_with_one_line(tmp_path, cfg, monkeypatch, caplog):
    """Through the master's gRPC front (``grpc.aio``): a query past a limit is INVALID_ARGUMENT with
    the limit error's one line; running out of stack while registering is INVALID_ARGUMENT too; any
    other unexpected exception of a unary call is INTERNAL with one line, logged once on the master,
    never UNKNOWN with ``Unexpected <class …>``; the master answers the next call."""
    import logging

    import grpc

    from strata.client import Client, ClientError, QueryRejected
    from strata.master.core import MasterCore
    from strata.master.aio_server import MasterServer
    from strata.master.server import MasterServicer
    from strata.master.sessions import Sessions
    from strata.users import UserStore

    store = UserStore(tmp_path / "users.json", cfg.lattice)
    store.add("ann", "S", "pw-depth", roles=["analyst", "operator"])
    core = MasterCore(cfg, "S", chunk_instants=1)
    server = MasterServer(MasterServicer(core, Sessions(store, "S")), "127.0.0.1:0").start()
    try:
        c = Client(server.address, timeout=20)
        c.login("ann", "pw-depth", "S")
        for text, fragment in [(nested_from(170), NEST_MSG.format(n=170)),
                               ("SELECT bp FROM Vitals WHERE " + plus(999) + " > 0",
                                EXPR_MSG.format(clause="WHERE", n=1000)),
                               ("SELECT " + plus(500) + " FROM Vitals", EXPR_MSG.format(clause="SELECT", n=500)),
                               (union_chain(NEST + 1), NEST_MSG.format(n=NEST + 1))]:
            with pytest.raises(QueryRejected) as e:
                c.register(["SELECT bp FROM Vitals", text])  # all or nothing
            assert e.value.code == "INVALID_ARGUMENT" and e.value.details == "limit error: " + fragment
        assert c.status().queries == [] and core.input_rejected["query"] == 4
        [ok] = c.register([nested_from(NEST)])

        def too_deep(*a, **k):
            raise RecursionError("maximum recursion depth exceeded while calling a Python object")

        monkeypatch.setattr(core, "register", too_deep)
        with pytest.raises(QueryRejected) as e:
            c.register(["SELECT bp FROM Vitals"])
        assert e.value.code == "INVALID_ARGUMENT" and e.value.details.startswith("limit error: ")

        def broken(*a, **k):
            raise RuntimeError("boom\nsecond line")

        monkeypatch.setattr(core, "register", broken)
        caplog.clear()
        with caplog.at_level(logging.ERROR, logger="strata.master"):
            with pytest.raises(ClientError) as e:
                c.register(["SELECT bp FROM Vitals"])
        assert e.value.code == grpc.StatusCode.INTERNAL.name, e.value
        assert e.value.details == "master error while registering: RuntimeError: boom second line", e.value.details
        assert len([r for r in caplog.records if r.levelno >= logging.ERROR]) == 1  # logged once
        monkeypatch.setattr(server.servicer, "Status", lambda request, context: broken())
        caplog.clear()
        with caplog.at_level(logging.ERROR, logger="strata.master"):
            with pytest.raises(ClientError) as e:
                c.status()
        assert e.value.code == "INTERNAL" and e.value.details == "master error in Status: RuntimeError: boom second line"
        assert len([r for r in caplog.records if r.levelno >= logging.ERROR]) == 1
        monkeypatch.undo()
        assert [q.query_id for q in c.status().queries] == [ok.query_id]  # the master goes on
        c.close()
    finally:
        server.stop(0)


# ---- 3. Spark: at the limits the worker's evaluation equals the reference ------------------------------------
LEDGER = """
[lattice]
levels = ["U", "C", "S"]

[streams.Counts]
sid = "string"
n = "long"
d = "double"
"""
#: queries at the limits over Counts (64-bit arithmetic is checked for overflow: the costly case)
AT_LIMIT = [
    "SELECT sid, n FROM Counts WHERE " + chain("AND", DEPTH - ARITH, "n > 0").replace(
        "n > 0", f"{plus(ARITH, 'n')} > 0", 1),
    f"SELECT sid, {plus(ARITH, 'n')} AS x FROM Counts [ROWS 3]",
    f"SELECT sid, SUM(n) AS s FROM Counts [ROWS 4] GROUP BY sid HAVING SUM({plus(ARITH, 'n')}) > 0",
    nested_from(NEST, "SELECT n FROM Counts WHERE " + chain("OR", DEPTH, "n > 1"), col="n"),
    union_chain(NEST, "UNION ALL", "SELECT sid, n FROM Counts [ROWS 2]"),
    "SELECT sid, d FROM Counts [ROWS 3 WHERE " + chain("AND", DEPTH - ARITH, "d > 0").replace(
        "d > 0", f"{plus(ARITH, 'd')} > 0", 1) + "]",
]


def counts_rows(ts: list[int], level: str = "S") -> list[dict]:
    return [{"ts": t, "level": level if i % 3 else "U", "sid": f"s{i % 2}", "n": 3 * i - 4, "d": 0.5 * i - 1.0}
            for i, t in enumerate(ts)]


@pytest.mark.spark
def test_at_the_limits_the_worker_equals_the_reference(spark):
    from strata.worker.engine import Engine
    from strata.worker.shared import SharedExecutor

    from .distributed import assert_reference, run_distributed
    from .tables import inputs_of

    cfg = parse_config(LEDGER)
    streams = {"Counts": counts_rows(list(range(1, 8)))}
    engine = Engine(spark, cfg)
    for text in AT_LIMIT:
        compile_query(text, cfg, "S")  # within the limits
    out = in_thread(lambda: run_distributed(cfg, "S", AT_LIMIT, inputs_of(cfg, streams),
                                            [SharedExecutor(engine, cfg, enabled=True)], chunk_instants=3))
    assert_reference(cfg, "S", AT_LIMIT, streams, out)
    assert all(o.error is None and o.rows for o in out.values()), {q: (o.error, len(o.rows)) for q, o in out.items()}


# ---- 4. through a master: refused with one line, exit 2, the master goes on ---------------------------------
CLUSTER_CONFIG = BATTLEFIELD_TOML + '\n[streams.Counts]\nsid = "string"\nn = "long"\nd = "double"\n'


@pytest.fixture(scope="module")
def cl(tmp_path_factory):
    import itertools

    from strata.deploy.local import start_cluster, stop_cluster

    from .helpers import write_config

    d = tmp_path_factory.mktemp("depth")
    cfg = write_config(d, CLUSTER_CONFIG, {"ana": ("S", "analyst"), "carl": ("S", "analyst"),
                                           "pete": ("S", "producer")})
    state = d / "state"
    started = start_cluster(str(cfg), ["S"], 1, state)
    yield {"config": cfg, "dir": d, "master": started["masters"]["S"], "tls": started["tls_dir"],
           "clock": itertools.count(1, 20)}
    stop_cluster(state)


def fresh(cl, n: int) -> list[int]:
    """``n`` instants nobody has used (the master's timeline is shared by the module's tests)."""
    start = next(cl["clock"])
    assert n <= 20
    return list(range(start, start + n))


def one_error_line(r, fragment: str) -> str:
    assert "Traceback" not in r.stderr and "UNKNOWN" not in r.stderr, r.stderr[-3000:]
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("strata:")]
    assert len(errors) == 1 and fragment in errors[0], r.stderr[-3000:]
    return errors[0]


def counts_table(rows):
    import pyarrow as pa

    return pa.Table.from_pylist(rows, schema=pa.schema([("ts", pa.int64()), ("level", pa.string()),
                                                         ("sid", pa.string()), ("n", pa.int64()),
                                                         ("d", pa.float64())]))


def follow(client, qids):
    from .tables import collect_in_background

    return collect_in_background(client, qids)


def reached(got: dict, qids, last: int) -> bool:
    return all(got[q] and max(r[0] for r in got[q]) >= last for q in qids)


PAST = [nested_from(NEST + 1, "SELECT n FROM Counts", col="n"),
        union_chain(NEST + 1, "UNION", "SELECT n FROM Counts"),
        "SELECT n FROM Counts WHERE " + chain("AND", DEPTH + 1, "n > 0"),
        f"SELECT {plus(ARITH + 1, 'n')} AS x FROM Counts",
        # the examples
        nested_from(170, "SELECT n FROM Counts", col="n"),
        "SELECT n FROM Counts WHERE " + plus(999, "n") + " > 0",
        "SELECT " + plus(500, "n") + " FROM Counts"]


@pytest.mark.slow
def test_past_a_limit_through_a_master_is_one_line_and_the_master_goes_on(cl):
    import grpc

    from strata.client import QueryRejected

    from .reference.evaluator import compare_results, evaluate
    from .polling import wait_for
    from .helpers import strata

    cfg = parse_config(CLUSTER_CONFIG)
    ts = fresh(cl, 6)
    rows = counts_rows(ts)
    ordinary = "SELECT sid, n FROM Counts [ROWS 3] WHERE n > -100"
    with login(cl, "ana") as ana, login(cl, "pete") as pete:
        [reg] = ana.register([ordinary])
        got, ended = follow(ana, [reg.query_id])
        pete.ingest([("Counts", counts_table(rows[:3]))], labelled=True)
        pete.advance(upto_ts=ts[2])
        wait_for(lambda: reached(got, [reg.query_id], ts[2]), 120, "the first results")
        # another session, through the CLI: exit 2, one line, never UNKNOWN
        for text, fragment in [(PAST[0], NEST_MSG.format(n=NEST + 1)),
                               (PAST[2], EXPR_MSG.format(clause="WHERE", n=DEPTH + 1)),
                               (PAST[5], EXPR_MSG.format(clause="WHERE", n=1000))]:
            r = strata("query", "--config", str(cl["config"]), "--master", cl["master"], "--user", "carl",
                       "--tls-dir", cl["tls"], "--level", "S", "--query", text, timeout=120)
            assert r.returncode == 2, r.stderr[-3000:]
            assert one_error_line(r, "limit error: " + fragment).startswith("strata: limit error: ")
        # and through the client API: INVALID_ARGUMENT with the one line
        with login(cl, "carl") as carl:
            for text in PAST:
                with pytest.raises(QueryRejected) as e:
                    carl.register([text])
                assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT.name
                assert e.value.details.startswith("limit error: ") and "\n" not in e.value.details, e.value.details
            assert not carl.status().queries  # nothing registered
        # the master answers, the query registered before goes on producing
        [q] = [q for q in ana.status().queries if q.query_id == reg.query_id]
        assert q.state == "running"
        pete.ingest([("Counts", counts_table(rows[3:]))], labelled=True)
        pete.advance(upto_ts=ts[-1])
        wait_for(lambda: reached(got, [reg.query_id], ts[-1]), 120, "the results after the refusals")
        ana.cancel([reg.query_id])
        assert ended.wait(60)  # the cancelled query's stream ends
    compare_results([r for r in got[reg.query_id] if r[0] in ts], evaluate(ordinary, cfg, "S", {"Counts": rows}))


@pytest.mark.slow
def test_at_the_limits_through_a_master_equals_the_reference(cl):
    from .reference.evaluator import compare_results, evaluate
    from .polling import wait_for

    cfg = parse_config(CLUSTER_CONFIG)
    ts = fresh(cl, 5)
    rows = counts_rows(ts)
    with login(cl, "ana") as ana, login(cl, "pete") as pete:
        regs = ana.register(AT_LIMIT)
        qids = [r.query_id for r in regs]
        got, ended = follow(ana, qids)
        pete.ingest([("Counts", counts_table(rows))], labelled=True)
        pete.advance(upto_ts=ts[-1])
        wait_for(lambda: reached(got, qids, ts[-1]), 300, "the results of the queries at the limits")
        states = {q.query_id: (q.state, q.error) for q in ana.status().queries if q.query_id in qids}
        assert all(s == "running" for s, _ in states.values()), states
        ana.cancel(qids)
        assert ended.wait(60)
    for r, text in zip(regs, AT_LIMIT):
        compare_results([row for row in got[r.query_id] if row[0] in ts], evaluate(text, cfg, "S", {"Counts": rows}))


@pytest.mark.slow
def test_replay_refuses_a_query_past_a_limit_before_its_cluster_starts(tmp_path, cl):
    from .helpers import strata, write_config, write_csv

    cfg_path = write_config(tmp_path, CLUSTER_CONFIG, {"ann": "S"})
    f = tmp_path / "c.csv"
    write_csv(f, ["ts", "level", "sid", "n", "d"], [(1, "U", "a", 1, 1.0)])
    base = ["replay", "--config", str(cfg_path), "--user", "ann", "--input", f"Counts={f}", "--output",
            str(tmp_path / "o.csv"), "--workers", "1"]
    for text, fragment in [(PAST[0], NEST_MSG.format(n=NEST + 1)),
                           (PAST[3], ARITH_MSG.format(clause="SELECT", n=ARITH + 1))]:
        t0 = time.monotonic()
        r = strata(*base, "--query", "SELECT n FROM Counts", "--query", text, timeout=120)
        assert r.returncode == 2, r.stderr[-3000:]
        assert one_error_line(r, "strata: query 2: limit error: " + fragment)
        assert "starting an embedded cluster" not in r.stderr  # refused before a cluster starts
        assert time.monotonic() - t0 < 60
    # into a running master: the text is checked offline too (parsed: its bounds need no schema)
    r = strata("replay", "--config", str(cl["config"]), "--master", cl["master"], "--tls-dir", cl["tls"],
               "--level", "S", "--user", "ana", "--input", f"Counts={f}", "--output", str(tmp_path / "p.csv"),
               "--query", PAST[2], timeout=120)
    assert r.returncode == 2
    one_error_line(r, "strata: limit error: " + EXPR_MSG.format(clause="WHERE", n=DEPTH + 1))


def test_a_logged_query_a_newer_limit_refuses_comes_back_failed_on_restore(tmp_path, cfg):
    """A master's event log from before a limit was tightened: the restart goes on, the query is failed
    with its one line, and the other queries and the input are restored."""
    from strata.master.core import MasterCore
    from strata.master.store import MasterStore, config_fingerprint

    store = MasterStore(tmp_path / "m.sqlite", "S", config_fingerprint(cfg))
    core = MasterCore(cfg, "S", store=store)
    [ok] = core.register("ann", ["SELECT COUNT(*) FROM Vitals"])
    store.append("register", {"query_id": "q9", "owner": "ann", "text": nested_from(NEST + 1)})
    store.close()
    again = MasterCore(cfg, "S", store=MasterStore(tmp_path / "m.sqlite", "S", config_fingerprint(cfg)))
    restored = again.restore()
    assert restored["queries"] == 2
    bad = again.queries["q9"]
    assert bad.state == "failed" and bad.error.startswith("no longer accepted by this version of Strata: limit error")
    assert "\n" not in bad.error and again.queries[ok.query_id].state == "running"
    assert [q["query_id"] for q in again.status("ann")["queries"]] == [ok.query_id, "q9"]
    [nxt] = again.register("ann", ["SELECT COUNT(*) FROM Vitals"])
    assert nxt.query_id == "q10"
    again.store.close()
