"""Opening and transactions of the LMDB tier: the environment and its tables, the remap gate
around every transaction, map growth and adoption, room made on a full map, and read accesses
buffered until the next write transaction."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import lmdb

from storage_backends.lmdb_entries import apply_accesses, evict_lru
from storage_backends.lmdb_gate import RemapGate
from storage_backends.lmdb_tables import FORMAT, U64, Write, read_totals
from storage_backends.log_throttle import LogThrottle
from tiered_kv.errors import BackendClosed, BackendUnavailable, ConfigError
from tiered_kv.units import format_size

log = logging.getLogger(__name__)

MAX_TOUCHES = 4096  # pending read accesses before they are applied eagerly
REMAP_WAIT_S = 10.0  # how long a remap waits for this process's transactions to end


class NoSpace(Exception):
    """The map (or the disk) stayed full after growing and evicting (never leaves the tier)."""


class LmdbTransactions:
    """Transactions of :class:`storage_backends.lmdb_disk.LmdbBackend` (a mixin: the backend
    sets the attributes below and provides ``_count`` and ``_pinned``)."""

    path: Path
    env: lmdb.Environment
    blocks: object
    meta: object
    lru: object
    info: object
    capacity: int
    batch_bytes: int
    max_map: int
    record_access: bool
    _gate: RemapGate
    _failures: LogThrottle  # failed calls repeat while a disk is full: one warning a minute
    _lock: threading.Lock
    _touches: dict[bytes, tuple[int, int]]
    _closed: bool

    # -- opening -----------------------------------------------------------------------------
    def _open_env(self, options: dict) -> lmdb.Environment:
        for _ in range(5):
            try:
                return lmdb.open(str(self.path), **options)
            except lmdb.MapResizedError:  # another process grew it while we opened: again
                continue
            except lmdb.Error as exc:
                raise ConfigError(f"cannot open LMDB store at {self.path}: {exc}") from None
        raise ConfigError(f"cannot open LMDB store at {self.path}: its map keeps being resized")

    def _open_tables(self) -> list:
        for _ in range(3):
            try:
                self.env.reader_check()  # readers left by crashed processes would pin old pages
                return [self.env.open_db(name) for name in (b"blocks", b"meta", b"lru", b"info")]
            except lmdb.MapResizedError:  # another process grew the map beyond ours: adopt it
                self.env.set_mapsize(0)
            except lmdb.Error as exc:
                self.env.close()
                raise ConfigError(f"cannot open LMDB store at {self.path}: {exc}") from None
        self.env.close()
        raise ConfigError(f"cannot open LMDB store at {self.path}: its map keeps being resized")

    def _check_format(self) -> None:
        with self._txn(write=True) as txn:
            stored = txn.get(b"format", db=self.info)
            found = FORMAT if stored is None else U64.unpack(stored)[0]
            if stored is None:
                txn.put(b"format", U64.pack(FORMAT), db=self.info)
        if found != FORMAT:
            self.env.close()
            raise ConfigError(f"lmdb store at {self.path} has format {found}, this version reads {FORMAT}")

    @property
    def map_size(self) -> int:
        return self.env.info()["map_size"]

    # -- transactions ------------------------------------------------------------------------
    @contextmanager
    def _txn(self, write: bool = False):
        """A transaction (zero-copy buffers) under the shared gate; adopts a map another
        process grew (``MapResizedError``) and retries."""
        for _ in range(3):
            with self._gate.shared():
                if self._closed:
                    raise BackendClosed(f"lmdb backend at {self.path} is closed")
                try:
                    txn = self.env.begin(write=write, buffers=True)
                except lmdb.MapResizedError:
                    txn = None
                if txn is not None and not write:
                    with txn:
                        yield txn
                    return
                if txn is not None:
                    try:
                        yield txn
                    except BaseException:
                        with self._gate.paused():  # else readers can starve the abort
                            txn.abort()
                        raise
                    txn.commit()
                    return
            if not self._remap(0):
                break
        raise BackendUnavailable(f"lmdb store at {self.path}: cannot adopt the resized map")

    @contextmanager
    def _guard(self, what: str):
        """lmdb errors (I/O, reader table full, ...) become BackendUnavailable, counted."""
        try:
            yield
        except lmdb.Error as exc:
            self._count(errors=1)
            self._failures.warning("lmdb tier at %s: %s failed: %s", self.path, what, exc)
            raise BackendUnavailable(f"lmdb store at {self.path}: {what} failed: {exc}") from exc

    def _write(self, body: Callable[[Write], object], nbytes: int = 0):
        """``body`` in one write transaction, after the buffered accesses. On a full map
        (or disk) the transaction is rolled back, room is made and it runs again."""
        for _ in range(6):
            touches = self._take_touches()
            try:
                with self._txn(write=True) as txn:
                    w = Write(txn, *read_totals(self, txn))
                    before = (w.used, w.entries)
                    apply_accesses(self, txn, touches)
                    result = body(w)
                    if (w.used, w.entries) != before:
                        txn.put(b"used", U64.pack(max(0, w.used)), db=self.info)
                        txn.put(b"entries", U64.pack(max(0, w.entries)), db=self.info)
            except (lmdb.MapFullError, lmdb.DiskError) as exc:
                self._restore_touches(touches)
                if not self._make_room(nbytes, grow=isinstance(exc, lmdb.MapFullError)):
                    raise NoSpace(str(exc)) from exc
                continue
            except BaseException:
                self._restore_touches(touches)
                raise
            if w.counts:
                self._count(**w.counts)
            return result
        raise NoSpace("the map stayed full")

    def _make_room(self, nbytes: int, grow: bool) -> bool:
        """After MapFull/ENOSPC: drop stale readers, grow the map, else evict beyond capacity."""
        self.env.reader_check()
        current = self.map_size
        if grow and current < self.max_map:
            new = min(self.max_map, max(2 * current, current + 4 * nbytes))
            if self._remap(new):
                return True
        extra = max(2 * nbytes, self.batch_bytes)
        evicted = self._write(lambda w: evict_lru(self, w, extra, self.capacity, self._pinned)) \
            if nbytes else 0
        log.warning("lmdb tier at %s: map %s full; evicted %d entries beyond capacity", self.path,
                    format_size(current), evicted)
        return evicted > 0

    def _remap(self, size: int) -> bool:
        """Grow the map to ``size`` (0: adopt the size another process set), exclusively."""
        with self._gate.exclusive(REMAP_WAIT_S) as won:
            if not won or self._closed:
                return False
            old = self.map_size
            self.env.set_mapsize(size)
            new = self.map_size
        log.info("lmdb tier at %s: map %s -> %s", self.path, format_size(old), format_size(new))
        return True

    # -- buffered read accesses ------------------------------------------------------------
    def _touch(self, keys: list[bytes], now: int) -> None:
        if not self.record_access:
            return
        with self._lock:
            for key in keys:
                hits = self._touches.get(key, (0, 0))[1]
                self._touches[key] = (now, hits + 1)
            eager = len(self._touches) >= MAX_TOUCHES
        if eager:
            try:
                self._apply_pending()
            except BackendUnavailable:
                pass  # logged; the read itself went fine and the accesses stay buffered

    def _take_touches(self) -> dict[bytes, tuple[int, int]]:
        with self._lock:
            touches, self._touches = self._touches, {}
        return touches

    def _restore_touches(self, touches: dict[bytes, tuple[int, int]]) -> None:
        with self._lock:
            for key, (atime, hits) in touches.items():
                now, more = self._touches.get(key, (0, 0))
                self._touches[key] = (max(atime, now), hits + more)

    def _apply_pending(self) -> None:
        with self._lock:
            if not self._touches:
                return
        try:
            with self._guard("recording accesses"):
                self._write(lambda w: None)
        except NoSpace:
            log.warning("lmdb tier at %s: map full, access times not recorded", self.path)
