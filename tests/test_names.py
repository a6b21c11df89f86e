"""One rule for the names users give (issue 30 item 3, strata/names.py): streams, relations and their
attributes, in the configuration and through ``strata streams add``.  Identifiers of at most
MAX_NAME_CHARS characters, not a reserved word, not an implicit column, not starting with ``_``; each
clash refused with its own one line.  The reserved words are checked against the grammar itself."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from strata.config import ConfigError, parse_config
from strata.master.core import MasterCore, Refused
from strata.mlscql import QueryError, compile_query
from strata.names import IMPLICIT_COLUMNS, MAX_NAME_CHARS, RESERVED_WORDS, name_problem

BASE = '[lattice]\nlevels = ["U", "S"]\n'
RELATION = '[relations.Units]\nunit = "string"\n'


def config(stream: str = "T", attribute: str = "x", extra: str = "") -> str:
    return BASE + f'[streams.{stream}]\n{attribute} = "double"\n' + extra


def queryable(stream: str, attribute: str) -> bool:
    """Whether queries can name ``stream`` and ``attribute`` (in FROM, SELECT, an aggregate, WHERE, a
    qualified column)."""
    cfg = parse_config(config(stream, attribute))
    for text in (f"SELECT {attribute} FROM {stream} [ROWS 1]",
                 f"SELECT AVG({attribute}) FROM {stream} [RANGE 2 SECONDS] WHERE {attribute} > 1",
                 f"SELECT V.{attribute} FROM {stream} [NOW] AS V"):
        try:
            compile_query(text, cfg, "S")
        except QueryError:
            return False
    return True


@pytest.mark.parametrize("word", sorted(RESERVED_WORDS))
def test_every_reserved_word_is_one_the_grammar_cannot_read_as_a_name(word):
    """The list is the grammar's: a stream, alias or attribute spelled as a reserved word (in any case)
    could not be named somewhere a query names it."""
    for spelling in (word, word.lower()):
        assert not _usable_without_rule(spelling)


def _usable_without_rule(word: str) -> bool:
    """Whether ``word`` works in every place a query names a stream, an alias or an attribute (the
    configuration is built around the rule, which would refuse it)."""
    from dataclasses import replace

    from strata.config import StreamSchema

    cfg = parse_config(config())
    cfg = replace(cfg, streams={word: StreamSchema(word, (("x", "double"),)),
                                "T": StreamSchema("T", ((word, "double"),))})
    for text in (f"SELECT x FROM {word} [ROWS 1]", f"SELECT {word}.x FROM {word} [ROWS 1]",
                 f"SELECT V.x FROM {word} [NOW] AS V", f"SELECT {word}.x FROM T [NOW] AS {word}",
                 f"SELECT {word} FROM T [ROWS 1]", f"SELECT T.{word} FROM T [ROWS 1]",
                 f"SELECT AVG({word}) FROM T [RANGE 2 SECONDS] WHERE {word} > 1"):
        try:
            compile_query(text, cfg, "S")
        except QueryError:
            return False
    return True


identifiers = st.from_regex(r"[A-Za-z][A-Za-z0-9_]{0,20}", fullmatch=True)


@settings(max_examples=150, deadline=None)
@given(stream=identifiers, attribute=identifiers)
def test_every_name_the_rule_accepts_can_be_queried(stream, attribute):
    if name_problem(stream) or name_problem(attribute) or stream.lower() == attribute.lower():
        return
    assert queryable(stream, attribute)


@pytest.mark.parametrize("toml, fragment", [
    (config("V" * 5000), f"stream name has 5000 characters (at most {MAX_NAME_CHARS})"),
    (config("T", "a" * 65), f"attribute name has 65 characters (at most {MAX_NAME_CHARS})"),
    (config("ts"), "stream name 'ts' is an implicit column"),
    (config("Level"), "stream name 'Level' is an implicit column"),
    (config("op"), "stream name 'op' is an implicit column"),
    (config("T", "op"), "'op' is the input column saying insert or delete"),
    (config("T", "ts"), "'ts' is a system attribute every stream has"),
    (config("select"), "stream name 'select' is an MLS-CQL reserved word"),
    (config("T", "Rows"), "attribute name 'Rows' is an MLS-CQL reserved word"),
    (config("_seq"), "stream name '_seq' starts with '_'"),
    (config("T", "_del"), "attribute name '_del' starts with '_'"),
    (BASE + RELATION + '[streams.units]\nx = "double"\n', "[relations.Units]: relation 'Units' is declared twice: 'units' already names a stream"),
    (BASE + '[relations.ts]\nunit = "string"\n', "relation name 'ts' is an implicit column"),
])
def test_the_configuration_refuses_each_clash_in_one_line(toml, fragment):
    with pytest.raises(ConfigError) as e:
        parse_config(toml)
    text = str(e.value)
    assert fragment in text and "\n" not in text and len(text) < 400


def test_names_at_the_limit_are_accepted():
    cfg = parse_config(config("V" * MAX_NAME_CHARS, "a" * MAX_NAME_CHARS))
    assert queryable("V" * MAX_NAME_CHARS, "a" * MAX_NAME_CHARS) and list(cfg.streams) == ["V" * MAX_NAME_CHARS]


@pytest.mark.parametrize("name, columns, fragment", [
    ("Units", [("unit", "string")], "Units is a stored relation ([relations.Units]); a stream cannot take its name"),
    ("UNITS", [("x", "double")], "Units is a stored relation"),
    ("S" * 5000, [("x", "double")], f"stream (name): stream name has 5000 characters (at most {MAX_NAME_CHARS})"),
    ("ts", [("x", "double")], "stream ts: stream name 'ts' is an implicit column"),
    ("From", [("x", "double")], "stream From: stream name 'From' is an MLS-CQL reserved word"),
    ("X", [("level", "string")], "'level' is a system attribute every stream has"),
    ("X", [("op", "string")], "'op' is the input column saying insert or delete"),
    ("X", [("a" * 5000, "string")], "attribute name has 5000 characters"),
])
def test_streams_add_follows_the_same_rule(tmp_path, name, columns, fragment):
    """``strata streams add`` (MasterCore.add_stream): the configuration's rule, and a relation's name is
    never taken by a stream (it used to answer "already declared so")."""
    core = MasterCore(parse_config(BASE + RELATION + config()[len(BASE):]), "S", max_in_flight=4)
    with pytest.raises(Refused) as e:
        core.add_stream(name, columns)
    text = str(e.value)
    assert fragment in text and "\n" not in text and len(text) < 400 and e.value.reason == "bad_stream"
    assert [s["name"] for s in core.streams()] == ["T", "Units"]


def test_implicit_columns_are_the_ones_the_engine_adds():
    from strata.config import OP_COLUMN, SYSTEM_COLUMNS

    assert set(IMPLICIT_COLUMNS) == set(SYSTEM_COLUMNS) | {OP_COLUMN}
