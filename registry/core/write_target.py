"""What an in-place write that failed under vmap wrote into: read from the user's line, for the error message.

PyTorch's refusal says that ``self`` is not batched but not which tensor ``self`` is. The user's line usually says it
(``out.index_add_(0, index, msg)``, ``buf[idx] = v``, ``self.total += x``): its written expression is parsed (never
evaluated), a plain name or an attribute chain is looked up in the frame's variables, and the tensor found is
described: its shape, and whether it is a parameter, a buffer of a module, a closure variable, a global, or an
argument of the function.
"""

from __future__ import annotations

import ast
from typing import Any

import torch

from registry.core.frames import UserFrame


def _written_expression(source: str) -> ast.expr | None:
    """The expression a line writes into in place: the receiver of ``x.name_(...)``, the subscripted tensor of
    ``x[i] = v`` / ``x[i] += v``, the target of ``x += v``, the ``out=`` argument of a call; None when the line is
    not one of those."""
    try:
        tree = ast.parse(source.strip().rstrip(":"))
    except SyntaxError:
        return None
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Subscript):
                    return target.value
                if isinstance(node, ast.AugAssign):
                    return target
        if isinstance(node, ast.Call):
            for keyword in node.keywords:
                if keyword.arg == "out":  # torch.mul(a, b, out=buf): the op's result is written into buf
                    return keyword.value
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr.endswith("_")
                and not node.func.attr.endswith("__")):
            return node.func.value
    return None


def _chain(expression: ast.expr) -> list[str] | None:
    """``a.b.c`` as ``["a", "b", "c"]``; None for anything else (a call, a subscript)."""
    names: list[str] = []
    while isinstance(expression, ast.Attribute):
        names.append(expression.attr)
        expression = expression.value
    if not isinstance(expression, ast.Name):
        return None
    names.append(expression.id)
    return names[::-1]


def _origin(names: list[str], value: torch.Tensor, frame: UserFrame, owner: Any) -> str:
    code = frame.frame.f_code
    if isinstance(value, torch.nn.Parameter):
        return "a parameter"
    if isinstance(owner, torch.nn.Module) and any(buffer is value for buffer in owner.buffers(recurse=False)):
        return f"a buffer of {type(owner).__name__}"
    if len(names) > 1:
        return f"an attribute of {type(owner).__name__}"
    name = names[0]
    if name in code.co_freevars:
        return "a closure variable"
    if name in code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]:
        return "an argument of the function"
    if name not in frame.frame.f_locals and name in frame.frame.f_globals:
        return "a global"
    return "a local variable"


def describe(frame: UserFrame) -> str | None:
    """``"`out` (a local variable, shape [5, 4], float32)"``, or None when the line does not say what it writes."""
    expression = _written_expression(frame.source)
    if expression is None:
        return None
    names = _chain(expression)
    if names is None:
        return f"`{ast.unparse(expression)}`"
    variables = {**frame.frame.f_globals, **frame.frame.f_locals}
    owner: Any = None
    value: Any = variables.get(names[0])
    for attribute in names[1:]:
        owner = value
        value = getattr(value, attribute, None)
    if not isinstance(value, torch.Tensor):
        return f"`{'.'.join(names)}`"
    dtype = str(value.dtype).removeprefix("torch.")
    return f"`{'.'.join(names)}` ({_origin(names, value, frame, owner)}, shape {list(value.shape)}, {dtype})"
