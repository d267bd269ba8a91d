"""How an error is quoted in a detail: its first line, cut short, with its type."""

from __future__ import annotations

from registry.core.messages import described, first_line


def test_first_line_keeps_one_line_and_cuts_it() -> None:
    error = RuntimeError("  the first line\nthe second  ")
    assert first_line(error) == "the first line"
    assert first_line(RuntimeError("x" * 400)) == "x" * 300
    assert first_line(RuntimeError("abcdef"), limit=3) == "abc"
    assert first_line(RuntimeError()) == ""


def test_described_names_the_type() -> None:
    assert described(ValueError("bad value\ntraceback")) == "ValueError: bad value"
    assert described(KeyboardInterrupt()) == "KeyboardInterrupt"
