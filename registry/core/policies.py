"""The selector's policies, apart from the selector so that the command line's ``--help`` lists them without
importing torch (``registry.core.selector`` says what each does)."""

from __future__ import annotations

POLICIES: tuple[str, ...] = ("auto", "fastest", "rules", "native")
