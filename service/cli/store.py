"""What the commands share about the store: opening it (one line when it cannot be), and its fresh evidence."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeVar

from service.cli_output import UsageError

if TYPE_CHECKING:
    from registry.store.database import Database
    from registry.store.evidence_store import EvidenceStore
    from registry.store.records import MatrixEntry, ProfileEntry

StoreT = TypeVar("StoreT", bound="Database")


def open_store(kind: type[StoreT] | None = None) -> StoreT:
    """The default store, checked, as ``kind`` (the evidence store unless told: ``JobStore`` for the jobs); UsageError
    (one line) when it cannot be opened."""
    from registry.store.connection import StoreUnavailableError
    from registry.store.evidence_store import EvidenceStore

    _check_variable_names()
    try:
        store = (kind or EvidenceStore)()
        store.check()
    except StoreUnavailableError as error:
        raise UsageError(str(error)) from None
    except Exception as error:  # a driver error opening it: the same answer, in one line
        first = (str(error).strip().splitlines() or [""])[0]
        raise UsageError(f"the store cannot be opened: {type(error).__name__}: {first}; check MULTICOMPOSITE_DB"
                         ) from None
    return store  # type: ignore[return-value]


def _check_variable_names() -> None:
    """A misspelt MULTICOMPOSITE_* variable refused in one line, as ``serve`` refuses it (where the service extra,
    which declares the settings, is installed; without it the library's commands run on)."""
    try:
        from service.settings import SettingsError, check_variable_names
    except ModuleNotFoundError:
        return
    try:
        check_variable_names()
    except SettingsError as error:
        raise UsageError(str(error)) from None


def fresh(store: EvidenceStore, *, entries: bool = True,
          profiles: bool = True) -> tuple[list[MatrixEntry], list[ProfileEntry]]:
    """The matrix entries and profiles still valid for this torch and these composites' sources
    (``registry.store.fresh``); a table not asked for is not read (an empty list)."""
    from registry.store.fresh import fresh_entries, fresh_profiles

    return (fresh_entries(store) if entries else [], fresh_profiles(store) if profiles else [])


def entry_json(entry: Any) -> dict[str, Any]:
    """A stored matrix entry or profile as JSON: its stack spelled vmap(grad), its time in ISO 8601 (UTC)."""
    from registry.core.stacks import format_stack
    from service.timestamps import iso_utc

    row = {**vars(entry), "stack": format_stack(entry.stack)}
    if "measured_at" in row:
        row["measured_at"] = iso_utc(row["measured_at"])
    return row
