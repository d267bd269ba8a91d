"""Defect 12: stacks were spelled vmap,grad in one place and vmap(grad) in another, each rejecting the other."""

from __future__ import annotations

import pytest

import registry
from registry.core.stacks import canonical_workload, format_stack, parse_bounded_stack, parse_stack, split_stack


@pytest.mark.parametrize("text", ["vmap(grad)", "vmap,grad", "vmap(grad())", " vmap ( grad ) ", "vmap, grad"])
def test_both_spellings_parse_to_one_stack(text: str) -> None:
    assert parse_stack(text) == ("vmap", "grad")
    assert format_stack(parse_stack(text)) == "vmap(grad)"


def test_format_and_aliases() -> None:
    assert format_stack(()) == ""
    assert format_stack(("vmap",)) == "vmap"
    assert format_stack(("functionalize", "vmap", "jvp")) == "functionalize(vmap(jvp))"
    assert parse_stack("vmap(jacrev)") == ("vmap", "grad")
    assert parse_stack("hessian") == ("vmap", "jvp", "grad")
    assert canonical_workload("vmap,grad") == "vmap(grad)"
    assert canonical_workload("jacrev") == "jacrev"
    assert split_stack("") == []


@pytest.mark.parametrize(("text", "message"), [
    ("vmap(grad", "unbalanced or mixed stack 'vmap(grad': write it nested, vmap(grad), or as a list, vmap,grad"),
    ("vmap(grad),jvp", "unbalanced or mixed stack 'vmap(grad),jvp': write it nested"),
    ("vmap((grad))", "empty transform name in stack 'vmap((grad))'"),
    ("vmap(gard)", "unknown transform 'gard' in stack 'vmap(gard)'; valid: vmap, grad, jvp"),
    ("vmap,gard", "unknown transform 'gard' in stack 'vmap(gard)'; valid: vmap, grad, jvp"),
])
def test_bad_stacks_say_how_to_write_them(text: str, message: str) -> None:
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        parse_stack(text)


def test_bounded_stacks_for_untrusted_input() -> None:
    assert parse_bounded_stack("hessian") == ("vmap", "jvp", "grad")
    with pytest.raises(ValueError, match=r"^stack 'vmap\(vmap\(grad\(jvp\)\)\)' is 4 transforms deep; the verified "
                                         "matrix covers at most 3$"):
        parse_bounded_stack("vmap(vmap(grad(jvp)))")
    with pytest.raises(ValueError, match="is 500 characters, over the limit of 120"):
        parse_bounded_stack("v" * 500)


def test_select_takes_both_spellings() -> None:
    # Equal, not the same object: a generation change between the two calls (evidence written by another test's
    # process, the C++ ops landing) empties the decision cache, and the second is decided afresh.
    assert registry.select("index_fill", stack="vmap(grad)") == registry.select("index_fill", stack="vmap,grad")
    assert registry.select("index_fill", stack="vmap(grad)").context.stack == ("vmap", "grad")
