"""strata.visibility: the one place that decides whether a holder of level L may see a label.

Checked on its own here (every lattice kind, labels as written and canonical, columns with
nulls and unknown texts) and against the lattice's own order, so that the producer's drop,
the master's shepherd and the worker's refusal, which all call it, agree with ``Lattice.leq``.
"""

from __future__ import annotations

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from strata.lattice import Categories, ChineseWall, TotalOrder
from strata.visibility import HIDDEN, UNKNOWN, VISIBLE, Labels, Visibility

BF = TotalOrder(["U", "C", "S", "TS"])
CATS = Categories(["U", "S"], ["NATO", "NUC"])
WALL = ChineseWall([["1", "2"], ["A", "B", "C"]])


def test_a_level_sees_what_it_dominates_and_nothing_else():
    v = Visibility(BF, "S")
    assert [v.classify(x) for x in ("U", "C", "S", "TS", "X")] == [VISIBLE, VISIBLE, VISIBLE, HIDDEN, UNKNOWN]
    assert v.may_see("C") and not v.may_see("TS") and not v.may_see("X")


def test_labels_are_read_as_level_literals_unless_canonical():
    loose, strict = Visibility(BF, "S"), Visibility(BF, "S", canonical=True)
    assert loose.classify(" C ") == VISIBLE  # Lattice.parse strips
    assert strict.classify(" C ") == UNKNOWN  # between master and worker only the canonical text is a label
    assert strict.classify("C") == VISIBLE and strict.classify("TS") == HIDDEN


@pytest.mark.parametrize("lattice", [BF, CATS, WALL], ids=["total", "categories", "wall"])
def test_classify_agrees_with_the_lattice_order(lattice):
    for level in lattice.levels:
        v = Visibility(lattice, level, canonical=True)
        for label in lattice.levels:
            assert v.may_see(label) == lattice.leq(label, level), (level, label)


def test_labels_of_a_column_split_its_distinct_texts_in_first_seen_order():
    col = pa.chunked_array([["TS", "U", None, "S"], ["U", "bogus", "TS", "C"]])
    assert Visibility(BF, "S").labels(col) == Labels(("U", "S", "C"), ("TS",), ("bogus",), True)
    assert Visibility(BF, "TS").labels(["U", "U", "TS"]) == Labels(("U", "TS"), (), (), False)


def test_visible_rows_is_false_for_hidden_unknown_and_missing_labels():
    col = pa.array(["U", "TS", None, "bogus", "S"])
    assert Visibility(BF, "S").visible_rows(col).to_pylist() == [True, False, False, False, True]


def test_without_hidden_keeps_unknown_and_missing_labels_for_the_caller():
    t = pa.table({"level": ["U", "TS", None, "bogus", "S", "TS"], "x": [1, 2, 3, 4, 5, 6]})
    kept, dropped = Visibility(BF, "S").without_hidden(t)
    assert kept.column("x").to_pylist() == [1, 3, 4, 5] and dropped == 2


def test_without_hidden_passes_a_visible_table_as_it_is_and_empties_a_hidden_one():
    t = pa.table({"level": ["U", "C"], "x": [1, 2]})
    v = Visibility(BF, "C")
    assert v.without_hidden(t) == (t, 0)
    hidden = pa.table({"level": ["TS", "S"], "x": [1, 2]})
    kept, dropped = v.without_hidden(hidden)
    assert kept.num_rows == 0 and dropped == 2 and kept.schema == hidden.schema


def test_a_large_string_column_works_too():
    t = pa.table({"level": pa.array(["U", "TS", "C"], pa.large_string())})
    kept, dropped = Visibility(BF, "C").without_hidden(t)
    assert kept.column("level").to_pylist() == ["U", "C"] and dropped == 1


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(["U", "C", "S", "TS", "bogus", None]), max_size=40),
       st.sampled_from(["U", "C", "S", "TS"]))
def test_without_hidden_drops_exactly_the_rows_the_level_does_not_dominate(labels, level):
    t = pa.table({"level": pa.array(labels, pa.string()), "i": list(range(len(labels)))})
    kept, dropped = Visibility(BF, level).without_hidden(t)
    want = [i for i, x in enumerate(labels) if x is None or x == "bogus" or BF.leq(x, level)]
    assert kept.column("i").to_pylist() == want and dropped == len(labels) - len(want)
    rows = Visibility(BF, level).visible_rows(t.column("level")).to_pylist()
    assert rows == [x not in (None, "bogus") and BF.leq(x, level) for x in labels]
