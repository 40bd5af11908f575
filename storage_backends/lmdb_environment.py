"""The LMDB environment of the disk tier: its tables, every transaction behind the remap gate, map
growth (and adoption of a map another process grew), room made on a full map, read accesses buffered
until the next write. A read-only open (tools) writes nothing: it opens the tables that exist (missing
ones read as empty: :mod:`storage_backends.lmdb_missing`), an older format left until the first write."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import NoReturn

import lmdb

from storage_backends.lmdb_access_recorder import AccessRecorder
from storage_backends.lmdb_accesses import AccessBuffer
from storage_backends.lmdb_diskfull import commit
from storage_backends.lmdb_entries import apply_accesses
from storage_backends.lmdb_format import READABLE, foreign, format_refusal, settle_format, stored_format
from storage_backends.lmdb_gate import RemapGate
from storage_backends.lmdb_missing import MissingTable, WithMissing, open_existing, raw_txn
from storage_backends.lmdb_tables import FORMAT, Tables, Write
from storage_backends.log_throttle import LogThrottle
from tiered_kv.errors import BackendClosed, BackendError, BackendUnavailable, ConfigError
from tiered_kv.units import format_size

log = logging.getLogger(__name__)

MAX_TOUCHES = 4096  # pending read accesses before they are applied eagerly
REMAP_WAIT_S = 10.0  # how long a remap waits for this process's transactions to end

Evict = Callable[[Write, int], int]  # (write, bytes wanted) -> entries evicted beyond capacity


class NoSpace(Exception):
    """The map (or the disk) stayed full after growing and evicting (never leaves the tier)."""


class LmdbEnvironment:
    """One environment and its tables. ``count`` takes the backend's counters (``errors=1``, a write's
    ``puts``, ...); ``evict`` makes room beyond the capacity on a full map that cannot grow; ``read_only``
    opens without writing (no table made, the format left until a write); ``record_access=False`` keeps no
    accesses (tools). ``max_map`` None (a tool's, ``map_size=0``): twice the map's size and 1 GiB more."""

    def __init__(self, path: Path, options: dict, *, max_map: int | None, batch_bytes: int,
                 count: Callable[..., None], evict: Evict, record_access: bool = True,
                 read_only: bool = False) -> None:
        self.path = path
        self.max_map, self.batch_bytes = max_map, batch_bytes
        self._count, self._evict = count, evict
        self.on_changes: Callable[[list[tuple[str, bytes]]], None] | None = None  # committed changes
        self.on_drained: Callable[[list[int]], None] | None = None  # segments a commit dropped
        self.on_draining: Callable[[list[int], bool], None] | None = None  # dropped pre-commit (False: none)
        self._in_order = threading.Lock()  # taken inside a write txn, released once its changes are told
        self.gate = RemapGate()
        self.accesses = AccessBuffer(record_access)
        self.recorder = AccessRecorder(self.accesses, self.apply_pending, path)  # applies them past MAX_TOUCHES
        self._failures = LogThrottle(log)  # failed calls repeat while a disk is full: one a minute
        self.closed = False
        self.unsynced = False  # this process committed since its last sync (a close syncs then)
        self.opener = os.getpid()  # an environment is not to be used after a fork (LMDB's rule)
        self._settling = threading.Lock()  # the first write after a read-only open
        self.env = self._open_env(options)
        if max_map is None:  # as an engine's map may grow: to twice its first size (and 1 GiB more)
            self.max_map = 2 * self.map_size + (1 << 30)
        self.tables = self._open_tables(create=not read_only)
        self._missing = any(isinstance(t, MissingTable) for t in vars(self.tables).values())
        self._deferred = read_only and (self._read_format() != FORMAT or self._missing)
        if not read_only:
            self._check_format()

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

    def _open_tables(self, create: bool = True) -> Tables:
        for _ in range(3):
            try:
                self.env.reader_check()  # readers left by crashed processes would pin old pages
                if foreign(self.env):
                    self.env.close()
                    raise ConfigError(f"{self.path} holds an LMDB environment that is not a tiered-kv "
                                      "store (other entries in its main table): not opened")
                if not create:
                    return Tables(*open_existing(self.env, Tables.NAMES))
                return Tables(*[self.env.open_db(name) for name in Tables.NAMES])
            except lmdb.MapResizedError:  # another process grew the map beyond ours: adopt it
                self.env.set_mapsize(0)
            except lmdb.Error as exc:
                self.env.close()
                raise ConfigError(f"cannot open LMDB store at {self.path}: {exc}") from None
        self.env.close()
        raise ConfigError(f"cannot open LMDB store at {self.path}: its map keeps being resized")

    def _check_format(self) -> None:
        """Write the format of a new environment, upgrade an old one; refuse any other."""
        try:
            found = self.write(lambda w: settle_format(self.tables, w))
        except (NoSpace, lmdb.Error) as exc:
            self.env.close()
            raise ConfigError(f"cannot open LMDB store at {self.path}: {exc}") from None
        if found != FORMAT:
            self._refuse_format(found)

    def _read_format(self) -> int | None:
        """A read-only open: the stored format (None: none yet), refused when this version
        cannot read it; an older one is upgraded by the first write (:meth:`_settle_deferred`)."""
        try:
            with self.txn() as txn:
                found = stored_format(self.tables, txn)
        except (BackendError, lmdb.Error) as exc:
            self.env.close()
            raise ConfigError(f"cannot open LMDB store at {self.path}: {exc}") from None
        if found not in READABLE:
            self._refuse_format(found)
        return found

    def _refuse_format(self, found: int | None) -> NoReturn:
        """An open that found a format this version cannot read: closed, refused."""
        self.env.close()
        raise ConfigError(format_refusal(self.path, found))

    def _settle_deferred(self) -> None:
        """The first write after a read-only open: create the missing tables and settle the
        format, as a writer's open does (in one write transaction)."""
        with self._settling:
            if not self._deferred:
                return
            tables, found = self._write(self._create_tables)
            if found != FORMAT:
                raise BackendUnavailable(format_refusal(self.path, found, doing="writes"))
            self.tables, self._deferred, self._missing = tables, False, False  # (no more wrapping)

    def _create_tables(self, w: Write) -> tuple[Tables, int]:
        txn = raw_txn(w.txn)
        tables = Tables(*[self.env.open_db(t.name, txn=txn) if isinstance(t, MissingTable) else t
                          for t in vars(self.tables).values()])
        return tables, settle_format(tables, Write(txn, tables))

    map_size = property(lambda self: self.env.info()["map_size"])

    def file_bytes(self) -> tuple[int, int]:
        """(apparent size, allocated bytes) of data.mdb (the map is sparse)."""
        try:
            st = os.stat(self.path / "data.mdb")
        except OSError:
            return 0, 0
        return st.st_size, st.st_blocks * 512

    # -- transactions ------------------------------------------------------------------------
    def check_open(self) -> None:
        if self.closed:
            raise BackendClosed(f"lmdb backend at {self.path} is closed")
        if os.getpid() != self.opener:  # (a child using it appended into its parent's segments)
            raise BackendClosed(f"lmdb backend at {self.path} was opened by process {self.opener}, "
                                "not this one (a fork's child): open it again here")

    @contextmanager
    def shared(self):
        """Hold the gate shared (no remap meanwhile) on an open environment, outside a
        transaction (figures from ``env.info``, a sync)."""
        with self.gate.shared():
            self.check_open()
            yield

    @contextmanager
    def txn(self, write: bool = False):
        """A transaction (zero-copy buffers) under the shared gate; adopts a map another
        process grew (``MapResizedError``) and retries."""
        for _ in range(3):
            with self.gate.shared():
                self.check_open()
                try:
                    txn = self.env.begin(write=write, buffers=True)
                except lmdb.MapResizedError:
                    txn = None
                if txn is not None and not write:
                    with txn:
                        yield WithMissing(txn) if self._missing else txn
                    return
                if txn is not None:
                    try:
                        yield WithMissing(txn) if self._missing else txn
                    except BaseException:
                        with self.gate.paused():  # else readers can starve the abort
                            txn.abort()
                        raise
                    commit(txn, self.path)  # (a full disk's EIO read as ENOSPC)
                    return
            if not self.remap(0):
                break
        raise BackendUnavailable(f"lmdb store at {self.path}: cannot adopt the resized map")

    @contextmanager
    def guard(self, what: str):
        """lmdb errors (I/O, reader table full, ...) become BackendUnavailable, counted."""
        try:
            yield
        except lmdb.Error as exc:
            self._count(errors=1)
            self._failures.warning("lmdb tier at %s: %s failed: %s", self.path, what, exc)
            raise BackendUnavailable(f"lmdb store at {self.path}: {what} failed: {exc}") from exc

    def write(self, body: Callable[[Write], object], nbytes: int = 0):
        """``body`` in one write transaction, after the buffered accesses. On a full map
        (or disk) the transaction is rolled back, room is made and it runs again. Accesses go
        back to the buffer only when they were not what failed: a full map, or ``body`` raised
        (an error while applying them drops them, logged: else it would fail every write)."""
        if self._deferred:
            self._settle_deferred()
        return self._write(body, nbytes)

    def _write(self, body: Callable[[Write], object], nbytes: int = 0):
        for _ in range(6):
            telling = applied = False
            touches, held = {}, []  # (touches taken holding LMDB's writer: no write misses them meanwhile)
            try:
                with self.txn(write=True) as txn:
                    touches = self.accesses.take()
                    w = Write(txn, self.tables)
                    apply_accesses(self.tables, w, touches)
                    applied = True
                    result = body(w)
                    w.save()
                    if w.drained and self.on_draining is not None:  # (no check takes them for orphans)
                        held = list(w.drained)
                        self.on_draining(held, True)
                    # the writers' changes are told in their commit order (LMDB has one writer)
                    telling = bool(w.changes) and self.on_changes is not None and self._in_order.acquire()
            except (lmdb.MapFullError, lmdb.DiskError) as exc:
                if telling:
                    self._in_order.release()
                if held:
                    self.on_draining(held, False)
                self.accesses.restore(touches)
                if not self._make_room(nbytes, grow=isinstance(exc, lmdb.MapFullError)):
                    raise NoSpace(str(exc)) from exc
                continue
            except BaseException as exc:
                if telling:
                    self._in_order.release()
                if held:
                    self.on_draining(held, False)
                if applied:
                    self.accesses.restore(touches)
                elif touches:
                    self._failures.warning("lmdb tier at %s: %d read accesses not recorded: %r", self.path,
                                           len(touches), exc)
                raise
            self.unsynced = True
            if telling:
                try:
                    self.on_changes(w.changes)  # type: ignore[misc]
                finally:
                    self._in_order.release()
            if w.drained and self.on_drained is not None:
                self.on_drained(list(w.drained))
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
            if self.remap(new):
                return True
        extra = max(2 * nbytes, self.batch_bytes)
        evicted = self.write(lambda w: self._evict(w, extra)) if nbytes else 0
        (log.warning if evicted else log.debug)(  # (a full disk with nothing to evict: every put came here)
            "lmdb tier at %s: map %s or disk full; evicted %d entries beyond capacity", self.path, format_size(current), evicted)
        return evicted > 0

    def remap(self, size: int) -> bool:
        """Grow the map to ``size`` (0: adopt the size another process set), exclusively."""
        with self.gate.exclusive(REMAP_WAIT_S) as won:
            if not won or self.closed:
                return False
            old = self.map_size
            self.env.set_mapsize(size)
            new = self.map_size
        log.info("lmdb tier at %s: map %s -> %s", self.path, format_size(old), format_size(new))
        return True

    # -- buffered read accesses ------------------------------------------------------------
    def touch(self, keys: list[bytes], now: int) -> None:
        """Buffer a read of ``keys``; once many are pending, the recorder's thread applies them."""
        if self.accesses.add(keys, now) >= MAX_TOUCHES:
            self.recorder.wake()

    def apply_pending(self) -> None:  # (also waits for the accesses the recorder's run is recording)
        if not self.recorder.pending():
            return
        try:
            with self.guard("recording accesses"):
                self.write(lambda w: None)
        except NoSpace:
            self._failures.warning("lmdb tier at %s: map full, access times not recorded", self.path)

    # -- durability and the end ------------------------------------------------------------
    def sync(self) -> None:
        """Apply buffered accesses and make every committed write durable (fsync)."""
        self.apply_pending()
        with self.guard("sync"), self.shared():
            self.unsynced = False  # (first: a commit during the sync sets it again)
            try:
                self.env.sync(True)
            except BaseException:  # (not durable after all: a clean close syncs again)
                self.unsynced = True
                raise

    def close(self, before: Callable[[], None] = lambda: None, after: Callable[[], None] = lambda: None) -> bool:
        """Once calls end: ``before`` (never raising), accesses, a sync of our commits, ``after``; False: closed."""
        if self.closed:
            return False
        if self.gate.held():
            raise BackendError("lmdb backend closed from inside one of its own visitors")
        if os.getpid() == self.opener:  # (a fork's child has no recorder thread, and maybe a held lock)
            self.recorder.close()  # its run in progress holds the gate shared: ended first
        with self.gate.exclusive(None):
            if self.closed:
                return False
            try:
                if os.getpid() == self.opener:  # (a fork's child touches nothing of its parent's)
                    before()
                    try:
                        self.apply_pending()
                    finally:  # (what was committed is synced all the same)
                        if self.unsynced:
                            self.env.sync(True)
            except (BackendError, lmdb.Error) as exc:
                log.warning("lmdb tier at %s: closing without the last accesses or a sync: %s", self.path, exc)
            finally:
                self.closed = True
                self.env.close()
                after()
        return True
