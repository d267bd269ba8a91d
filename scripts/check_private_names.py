"""No private name crosses a module: ``from registry.x import _name`` or ``survey._helper`` from another module fails.

A leading underscore says "this module's own": another module that reaches for it couples itself to a detail the
owner may change without notice. `make lint` runs this over the packages; it prints one line per crossing
(file:line: what, and what to do) and exits 1 if there is any.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PROJECT = ("registry", "composites", "service", "bench")
# Crossings older than this check, left to their modules' owners to make public. Listed exactly, so that a new
# crossing still fails; remove a line once it is fixed.
KNOWN: frozenset[tuple[str, str]] = frozenset()


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _ours(module: str) -> bool:
    return module.split(".")[0] in PROJECT


def crossings(path: Path) -> list[str]:
    """Each private name ``path`` takes from another module of the project, as ``file:line: ...``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    modules: set[str] = set()  # local names bound to a module of the project
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and _ours(node.module):
            for alias in node.names:
                if _is_private(alias.name):
                    found.append(f"{path}:{node.lineno}: imports {alias.name} from {node.module}")
                else:
                    modules.add(alias.asname or alias.name)  # may be a module (from registry.harness import survey)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if _ours(alias.name):
                    modules.add(alias.asname or alias.name.split(".")[0])
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and _is_private(node.attr) and isinstance(node.value, ast.Name)
                and node.value.id in modules and (path.as_posix(), f"{node.value.id}.{node.attr}") not in KNOWN):
            found.append(f"{path}:{node.lineno}: uses {node.value.id}.{node.attr} of another module")
    return sorted(found, key=lambda line: int(line.split(":")[1]))


def main(roots: list[str]) -> int:
    found = [line for root in roots for path in sorted(Path(root).rglob("*.py")) for line in crossings(path)]
    for line in found:
        print(f"{line}: make it public (no underscore) where it is defined, or keep its use inside that module")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or ["registry", "composites"]))
