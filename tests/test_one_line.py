"""strata.errors.one_line: the one way an error text becomes the line a user reads.

The CLI, the master and the worker all format errors with it, so the same error reaches a user
the same way whichever side formatted it (the master's modules and the worker's service take it
from strata.errors too).
"""

from __future__ import annotations

from strata.errors import ONE_LINE_LIMIT, one_line
from strata.master import pipeline
from strata.worker import service


def test_whitespace_and_newlines_collapse_to_single_spaces():
    assert one_line("  stage failed:\n\tcolumn   x\r\n  is missing \n") == "stage failed: column x is missing"


def test_a_long_text_is_cut_with_an_ellipsis_at_the_limit():
    text = "word " * 200
    out = one_line(text)
    assert len(out) == ONE_LINE_LIMIT == 300 and out.endswith("...")
    assert out[:-3] == " ".join(text.split())[: ONE_LINE_LIMIT - 3]
    assert one_line("x" * 300) == "x" * 300  # at the limit: kept whole
    assert one_line("abcdefghij", limit=8) == "abcde..."


def test_none_is_empty_and_an_exception_without_a_message_is_named_by_its_type():
    assert one_line(None) == ""
    assert one_line("") == ""
    assert one_line(KeyError()) == "KeyError"
    assert one_line(ValueError("bad\nvalue")) == "bad value"


def test_master_and_worker_use_the_same_function():
    assert pipeline.one_line is one_line
    assert service.one_line is one_line
