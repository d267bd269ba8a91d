"""The app-scoped store and what hangs off its generation: evidence, listings, and cached responses.

One ``Store`` (engine and pool) per app, opened in the lifespan. A watcher thread reads the store's generation (one
indexed row) every ``evidence_poll_s``: when any process has written evidence since, the selector's evidence is
reloaded lazily and every cached response dropped, so the server answers from fresh results within a second without
reloading anything per request. When the store cannot be read, store-backed routes answer 503 until it can.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from registry.store import evidence
from registry.store.connection import StoreUnavailableError
from registry.store.database import safe_url
from registry.store.db import Store


@dataclass(frozen=True)
class CachedResponse:
    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes
    etag: bytes | None
    route: str


class ResponseCache:
    """An LRU of complete responses keyed by (generation, path, query string), bounded in entries and in bytes (a
    page of /matrix can be a thousand entries)."""

    def __init__(self, size: int, max_bytes: int = 64 << 20) -> None:
        self._size = size
        self._max_bytes = max_bytes
        self._bytes = 0
        self._entries: OrderedDict[tuple[int, str, bytes], CachedResponse] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple[int, str, bytes]) -> CachedResponse | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
            return entry

    def put(self, key: tuple[int, str, bytes], entry: CachedResponse) -> None:
        if len(entry.body) > self._max_bytes // 16:
            return  # one answer may not push out most of the others
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= len(old.body)
            self._entries[key] = entry
            self._bytes += len(entry.body)
            while len(self._entries) > self._size or self._bytes > self._max_bytes:
                _, evicted = self._entries.popitem(last=False)
                self._bytes -= len(evicted.body)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    @property
    def bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)


class Listings:
    """Per-generation values computed from the store once (the fresh matrix, the profiles), bounded by key count."""

    def __init__(self) -> None:
        self._values: dict[tuple[int, str], Any] = {}
        self._lock = threading.Lock()

    def get(self, generation: int, name: str, compute: Callable[[], Any]) -> Any:
        key = (generation, name)
        with self._lock:
            if key in self._values:
                return self._values[key]
        value = compute()
        with self._lock:
            # Only the current generation is kept: older keys go when a newer one arrives.
            for old in [k for k in self._values if k[0] != generation]:
                del self._values[old]
            self._values[key] = value
        return value


class StoreState:
    def __init__(self, url: str | None, poll_s: float, cache_size: int, cache_bytes: int = 64 << 20) -> None:
        self.url = url
        self.poll_s = poll_s
        self.store: Store | None = None
        self.generation = -1
        self.error: str | None = None
        self.responses = ResponseCache(cache_size, cache_bytes)
        self.listings = Listings()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # One check at a time: the watcher's check that began before the file was deleted must not end after a
        # later one and put its older view (a disk I/O error half-way) over the newer ("does not exist").
        self._polling = threading.Lock()

    def open(self) -> None:
        """Open the store, or raise StoreUnavailableError with one line saying why (the server then refuses to
        start)."""
        try:
            store = Store(self.url)
        except StoreUnavailableError:
            raise  # says what is wrong and what to do already
        except Exception as error:
            first = (str(error).strip().splitlines() or [""])[0]
            shown = safe_url(self.url) if self.url else "the default URL"
            raise StoreUnavailableError(f"the store at {shown} cannot be opened: "
                                        f"{type(error).__name__}: {first}") from error
        store.check()
        self.store = store
        self.generation = store.generation()
        evidence.use_store(store)
        self._thread = threading.Thread(target=self._watch, name="multicomposite-store-watch", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        if self.store is not None:
            self.store.close()

    def require(self) -> Store:
        """The store, or StoreUnavailableError while it cannot be read."""
        if self.error is not None or self.store is None:
            raise StoreUnavailableError(self.error or "the store is not open")
        return self.store

    def device_types(self) -> tuple[str, ...]:
        """Device types a query may name: those this host has, and those a stored profile names."""
        from service.validation import host_device_types

        store = self.require()

        def compute() -> tuple[str, ...]:
            return tuple(dict.fromkeys((*host_device_types(), *store.profile_devices())))

        return self.listings.get(self.generation, "devices", compute)

    def poll(self) -> None:
        """One check: the store readable and its generation; invalidate what depends on it when either changed."""
        with self._polling:
            self._poll()

    def _poll(self) -> None:
        store = self.store
        if store is None:
            return
        try:
            store.check()  # through SQLite only; a SQLite file replaced under us is reopened there
            generation = store.generation()
        except Exception as error:  # unreadable: say so on every store-backed route until it reads again
            message = str(error) if isinstance(error, StoreUnavailableError) else \
                f"the store cannot be read: {type(error).__name__}: {(str(error).splitlines() or [''])[0]}"
            if self.error != message:
                self.error = message
                self.responses.clear()
            return
        if self.error is not None or generation != self.generation:
            evidence.use_store(store)  # clears the selector's decisions; the evidence reloads at the next one
            self.generation = generation
            self.error = None
            self.responses.clear()

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.poll()
