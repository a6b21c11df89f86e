"""Input files (`strata ingest` / `strata replay`): which strings mean NULL is explicit.

CSV: only an empty field of a double, long, timestamp or boolean column is NULL; string and
level columns have no NULL; NA/NULL/null/N/A/nan/inf are never silently NULL: a numeric word
is refused with one line naming the file, the line and the column, and a double must be
finite.  JSON lines: ``null`` is NULL, NaN/Infinity are refused."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from strata.errors import EXIT_REJECTED, CliError
from strata.commands import read_input
from strata.config import parse_config

from .conftest import BATTLEFIELD_TOML

TYPES_TOML = BATTLEFIELD_TOML + """
[streams.Kinds]
name = "string"
x = "double"
n = "long"
t = "timestamp"
b = "boolean"
"""
HEADER = "ts,level,name,x,n,t,b\n"


@pytest.fixture(scope="module")
def cfg():
    return parse_config(TYPES_TOML)


def read(cfg, tmp_path, text, name="in.csv", stream="Kinds"):
    p = tmp_path / name
    p.write_text(text)
    return read_input(cfg, stream, str(p))[1]


def refused(cfg, tmp_path, text, name="in.csv"):
    with pytest.raises(CliError) as e:
        read(cfg, tmp_path, text, name)
    msg = str(e.value)
    assert e.value.code == EXIT_REJECTED and "\n" not in msg and msg.startswith(str(tmp_path / name))
    return msg[len(str(tmp_path / name)) + 2:]


def test_only_an_empty_field_is_null(cfg, tmp_path):
    t = read(cfg, tmp_path, HEADER + "1,U,a,1.5,2,3,true\n2,U,,,,,\n3,U,\"\",-0.0,-7,0,False\n")
    assert t.column("x").to_pylist() == [1.5, None, -0.0]
    assert t.column("n").to_pylist() == [2, None, -7]
    assert t.column("t").to_pylist() == [3, None, 0]
    assert t.column("b").to_pylist() == [True, None, False]
    assert t.column("name").to_pylist() == ["a", "", ""]  # a string column has no NULL


@pytest.mark.parametrize("word", ["NA", "NULL", "null", "N/A", "n/a", "#N/A", "None", "-", "?"])
@pytest.mark.parametrize("column, kind", [("x", "double"), ("n", "long"), ("t", "timestamp"), ("b", "boolean")])
def test_null_words_are_refused_naming_line_and_column(cfg, tmp_path, word, column, kind):
    row = {"name": "a", "x": "1.0", "n": "1", "t": "1", "b": "true", column: word}
    line = ",".join(row[c] for c in ("name", "x", "n", "t", "b"))
    good = "1,U,a,1.0,1,1,true\n"
    msg = refused(cfg, tmp_path, HEADER + good * 3 + f"2,U,{line}\n" + good)
    assert msg == f"line 5, column {column}: {word!r} is not a {kind} value (only an empty field is NULL)"


def test_null_words_in_a_string_column_are_strings(cfg, tmp_path):
    t = read(cfg, tmp_path, HEADER + "1,U,NA,1,1,1,true\n1,U,NULL,1,1,1,true\n1,U,nan,1,1,1,true\n")
    assert t.column("name").to_pylist() == ["NA", "NULL", "nan"]


@pytest.mark.parametrize("word", ["nan", "NaN", "-nan", "inf", "-inf", "Infinity", "1e999"])
def test_a_double_must_be_finite(cfg, tmp_path, word):
    msg = refused(cfg, tmp_path, HEADER + "1,U,a,1,1,1,true\n" * 2 + f"2,U,a,{word},1,1,true\n")
    assert msg.startswith("line 4, column x: ") and "is not a finite number" in msg


def test_json_lines(cfg, tmp_path):
    rows = ['{"ts":1,"level":"U","name":"a","x":1.5,"n":1,"t":2,"b":true}',
            '{"ts":2,"level":"U","name":"b","x":null,"n":null,"t":null,"b":null}']
    t = read(cfg, tmp_path, "\n".join(rows) + "\n", "in.jsonl")
    assert t.column("x").to_pylist() == [1.5, None] and t.column("b").to_pylist() == [True, None]
    for bad in ("NaN", "-Infinity"):
        text = "\n".join(rows + [rows[0].replace('"x":1.5', f'"x":{bad}')]) + "\n"
        msg = refused(cfg, tmp_path, text, "in.jsonl")
        assert msg.startswith("line 3, column x: ") and "finite" in msg


def test_a_large_file_with_one_bad_value_names_its_line(cfg, tmp_path):
    good = "1,U,a,1.25,1,1,true\n"
    n = 200_000
    p = tmp_path / "big.csv"
    with open(p, "w") as f:
        f.write(HEADER)
        f.write(good * n)
        f.write("2,U,a,NULL,1,1,true\n")
        f.write(good * 1000)
    with pytest.raises(CliError, match=rf"big.csv: line {n + 2}, column x: 'NULL' is not a double value"):
        read_input(cfg, "Kinds", str(p))


def test_cli_refuses_in_one_line(tmp_path):
    """`strata ingest` reads its input before it connects: no master is needed to see the refusal."""
    (tmp_path / "strata.toml").write_text(BATTLEFIELD_TOML)
    bad = tmp_path / "vitals.csv"
    bad.write_text("ts,level,sid,bp,pr,weight\n1,U,a,120.5,60,70\n2,U,a,NA,61,71\n")
    r = subprocess.run([sys.executable, "-m", "strata", "ingest", "--config", str(tmp_path / "strata.toml"),
                        "--master", "127.0.0.1:9", "--user", "x", "--level", "S", "--input", f"Vitals={bad}"],
                       capture_output=True, text=True, timeout=120, env={**os.environ, "STRATA_PASSWORD": "x"})
    assert r.returncode == EXIT_REJECTED, r.stderr
    assert r.stderr.strip() == f"strata: {bad}: line 3, column bp: 'NA' is not a double value (only an empty field is NULL)"
