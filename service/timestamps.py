"""One spelling of a point in time in every output (API and ``--json``): ISO 8601 in UTC with its zone,
``2026-12-01T10:44:00.250Z``. The store keeps seconds since the epoch; this is where they become text."""

from __future__ import annotations

from datetime import datetime, timezone

ISO_EXAMPLE = "2026-12-01T10:44:00.250Z"


def iso_utc(seconds: float | None) -> str | None:
    """Seconds since the epoch as ISO 8601 UTC with milliseconds and ``Z``; None stays None (not recorded)."""
    if seconds is None:
        return None
    moment = datetime.fromtimestamp(seconds, tz=timezone.utc)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")
