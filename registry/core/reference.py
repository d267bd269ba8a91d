"""Reference profiles shipped with the package: the selector's order where nothing was measured here.

A new user has an empty store, and a profile refused as disturbed leaves none: the rules alone would rank the valid
composites by their kind. ``reference_profiles.json`` (next to this module, written by ``python -m bench.reference
measure``) holds, per op, the stack its forward sees and dtype, the median time of every valid composite measured
side by side in interleaved rounds on one machine (named in the file). The selector ranks by those times where no
local profile speaks for the context; a local profile, measured on the user's own machine, always overrides them.

Only relative times matter (another machine is faster or slower as a whole, and the order is what is used): a
composite whose reference time is within ``MIN_GAP`` of the fastest one's is not told from it, and the rules' choice
stays.
"""

from __future__ import annotations

import functools
import json
import threading
from dataclasses import dataclass
from pathlib import Path

PATH = Path(__file__).with_name("reference_profiles.json")
MIN_GAP = 0.10  # a reference ratio closer to 1 than this does not reorder the rules' choice
_lock = threading.Lock()


class ReferenceError(ValueError):
    """The shipped reference profiles cannot be read: a packaging error, said with the file's path."""


@dataclass(frozen=True)
class ReferenceTimes:
    """One context's reference: composite -> median microseconds per call, and where it was measured."""

    times_us: dict[str, float]
    machine: str
    workload: str
    numel: int
    batch: int
    # The op's tensor arguments the workload batched (None: a file that does not say; it then speaks for every
    # context of its stack): a context that batches another is not what was measured. index_add with a shared index
    # and with each sample's own are different calls (composites/index.py: NOTE [index_add's batched index]).
    batched: frozenset[str] | None = None


@functools.cache
def _load(path: Path) -> tuple[str, dict[tuple[str, tuple[str, ...], str], ReferenceTimes]]:
    if not path.exists():
        return "", {}
    try:
        document = json.loads(path.read_text())
        machine = str(document["machine"])
        table = {}
        for context in document["contexts"]:
            key = (str(context["op"]), tuple(context["stack"]), str(context["dtype"]))
            table[key] = ReferenceTimes(times_us={str(k): float(v) for k, v in context["times_us"].items()},
                                        machine=machine, workload=str(context["workload"]),
                                        numel=int(context["numel"]), batch=int(context["batch"]),
                                        batched=(frozenset(str(name) for name in context["batched"])
                                                 if "batched" in context else None))
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ReferenceError(f"{path}: unreadable reference profiles ({type(error).__name__}: {error}); regenerate "
                             "them with `python -m bench.reference measure`") from None
    return machine, table


def reference_times(op: str, stack: tuple[str, ...], dtype: str | None,
                    batched: tuple[str, ...] | None = None) -> ReferenceTimes | None:
    """The reference of ``op`` under ``stack`` (as the op's forward sees it) at ``dtype`` (float32 when unknown),
    where the workload batched every argument ``batched`` names (None: whatever it batched). A context that batches
    fewer is one the workload's rules also serve; one that batches another argument (index_add's index) is a call
    the workload never made."""
    with _lock:
        _, table = _load(PATH)
    found = table.get((op, stack, dtype or "float32"))
    if found is None or batched is None or found.batched is None or found.batched >= frozenset(batched):
        return found
    return None


def machine() -> str:
    with _lock:
        return _load(PATH)[0]
