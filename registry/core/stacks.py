"""One spelling of a transform stack: ``vmap(grad)`` in every output; ``vmap(grad)`` and ``vmap,grad`` on input.

The one parser of stacks: either spelling (or a sequence of names) to validated transform names, aliases such as
``jacrev`` expanded; and names back into the one spelling every output uses.
"""

from __future__ import annotations

from collections.abc import Iterable

from registry.core.context import STACK_ALIASES, TRANSFORMS

# The deepest stack the verified matrix covers (hessian = vmap, jvp, grad): deeper stacks have no evidence, and a
# bound here keeps a query from growing a cache key without limit.
MAX_STACK_DEPTH = 3
MAX_STACK_TEXT = 120  # characters: longer text cannot be a stack of MAX_STACK_DEPTH transforms


def format_stack(stack: Iterable[str]) -> str:
    """``("vmap", "grad")`` -> ``"vmap(grad)"``; ``()`` (no transform) -> ``""``."""
    names = tuple(stack)
    if not names:
        return ""
    return "(".join(names) + ")" * (len(names) - 1)


def split_stack(text: str) -> list[str]:
    """The transform names of ``text``, outermost first, without validating them.

    ``"vmap(grad)"``, ``"vmap(grad())"`` and ``"vmap,grad"`` all give ``["vmap", "grad"]``; ``""`` gives ``[]``.
    """
    text = "".join(text.split())
    if "(" not in text and ")" not in text:
        return [part for part in text.split(",") if part]
    body = text.rstrip(")")
    if ")" in body or "," in body or len(text) - len(body) != text.count("("):
        raise ValueError(f"unbalanced or mixed stack {shorten(text)!r}: write it nested, vmap(grad), or as a list, "
                         "vmap,grad")
    names = body.split("(")
    if not names[-1]:  # "vmap(grad())": the innermost call's empty parentheses
        names.pop()
    if any(not name for name in names):
        raise ValueError(f"empty transform name in stack {shorten(text)!r}: write it as vmap(grad) or vmap,grad")
    return names


def parse_stack(text: str | Iterable[str]) -> tuple[str, ...]:
    """Either spelling (or a sequence of names) to a validated stack tuple; aliases such as ``jacrev`` expand."""
    names = split_stack(text) if isinstance(text, str) else [name.strip() for name in text if name.strip()]
    stack: list[str] = []
    for name in names:
        if name not in TRANSFORMS and name not in STACK_ALIASES:
            valid = ", ".join((*TRANSFORMS, *STACK_ALIASES))
            raise ValueError(f"unknown transform {shorten(name)!r} in stack {shorten(format_stack(names))!r}; "
                             f"valid: {valid}")
        stack.extend(STACK_ALIASES.get(name, (name,)))
    return tuple(stack)


def parse_bounded_stack(text: str) -> tuple[str, ...]:
    """``parse_stack`` for untrusted input: at most MAX_STACK_TEXT characters and MAX_STACK_DEPTH transforms."""
    if len(text) > MAX_STACK_TEXT:
        raise ValueError(f"stack {shorten(text)!r} is {len(text)} characters, over the limit of {MAX_STACK_TEXT}")
    stack = parse_stack(text)
    if len(stack) > MAX_STACK_DEPTH:
        raise ValueError(f"stack {format_stack(stack)!r} is {len(stack)} transforms deep; the verified matrix covers "
                         f"at most {MAX_STACK_DEPTH}")
    return stack


def canonical_workload(text: str) -> str:
    """A profiling workload in the one spelling: ``"vmap,grad"`` -> ``"vmap(grad)"``; aliases stay as written."""
    return format_stack(split_stack(text))


def shorten(value: object, limit: int = 40) -> str:
    """``value`` as text, cut to ``limit`` characters (with an ellipsis): error messages never echo more."""
    text = str(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"
