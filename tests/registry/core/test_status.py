"""The one status vocabulary: its listed order, its severity, and what fails."""

from __future__ import annotations

import pytest

from registry.core.status import FAILING, RANK, STATUSES, worst


def test_listed_ranked_and_failing() -> None:
    assert STATUSES == ("ok", "slow", "error", "mismatch", "unsupported")
    assert RANK == ("unsupported", "ok", "slow", "mismatch", "error")
    assert FAILING == ("slow", "mismatch", "error")


def test_the_worst_status_wins_and_unsupported_is_the_mildest() -> None:
    assert worst(["ok", "unsupported"]) == "ok"
    assert worst(["mismatch", "slow", "error", "ok"]) == "error"
    assert worst(["unsupported"]) == "unsupported"
    with pytest.raises(KeyError):
        worst(["broken"])
