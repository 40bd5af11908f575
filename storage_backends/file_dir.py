"""A directory of files, one per value: the export format of ``tiered-kv copy`` and a tier for
shared network filesystems, where LMDB's locking does not hold.

``file:///abs/dir`` (``file://./rel``, ``file:rel``). Layout (``storage_backends.file_layout``)::

    DIR/.tiered-kv-file-store          marker (format version); a directory without it is refused
    DIR/<ff>/<key as hex>              a value of no tenant (for tiered-kv: a stored block), or a
                                       link to the next one
    DIR/<ff>/<key as hex>.<tenant hex> a value of that tenant

``<ff>`` is the last byte of the key in hex (block keys end in hash bytes: an even spread).
A value is written to a temporary name in the same directory and renamed over the final one,
so readers on any host see the old value or the new one, never a torn one. Reads and writes
go through aiofiles on one event loop thread per backend; the sync interface submits to it.

Options (read in :mod:`storage_backends.file_options`): ``capacity`` (bytes; default none: the
filesystem decides) evicts least recently used files when a put would go over it;
``tenant_quota`` / ``tenant_quotas`` bound each tenant's bytes (a tenant over its quota evicts
its own files first: :mod:`storage_backends.eviction`). Both work on an approximate view of the
directory (:mod:`storage_backends.file_room`). ``sync`` fsyncs each file before the rename and
its directories after it; ``touch=false`` leaves access times alone (tools: no ``utime``, files
opened with O_NOATIME where allowed); ``create=false`` refuses to make a store where there is
none. Usage per tenant comes from a listing, so it counts every process's files.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import os
import threading
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from urllib.parse import quote

import aiofiles
import aiofiles.os

from storage_backends import file_entries
from storage_backends.base import Backend, BackendStats, TenantTotal
from storage_backends.eviction import Eviction
from storage_backends.eviction_lru import LRU
from storage_backends.file_entries import Stored, check_dir, stored_files, target_of
from storage_backends.file_layout import FORMAT, MARKER, as_key, file_of, open_store, temp_of, upgrade_marker
from storage_backends.file_options import file_settings, url_options
from storage_backends.file_room import FileRoom
from storage_backends.options import directory_of, warn_if_relative
from storage_backends.quotas import as_tenant
from tiered_kv.errors import BackendClosed, BackendUnavailable

log = logging.getLogger(__name__)

CONCURRENCY = 16  # files read or written at once per call
CLOSE_WAIT_S = 30.0  # how long a close waits for running calls before it cancels them


class FileBackend(Backend):
    name = "file"
    store_signature = "file-store marker"

    def __init__(self, path: str | os.PathLike, *, url: str | None = None, **options) -> None:
        """``options``: those of :func:`~storage_backends.file_options.file_settings`, read there."""
        self.path = Path(path)
        super().__init__(url or f"file://{self.path.resolve()}")
        settings = file_settings(**options)
        self.capacity, self.quotas, self.sync, self.touch = settings.capacity, settings.quotas, settings.sync, settings.touch
        self.tenant_quota = self.quotas.default
        self._format = open_store(self.path, settings.create)
        self._lock = threading.Lock()
        self._pins: Counter = Counter()
        bounded = self.capacity is not None or self.quotas
        self._room = FileRoom(Eviction(LRU, self.capacity, self.quotas), self._listing, self._is_pinned) \
            if bounded else None
        self._counters.extra["quota_evictions"] = 0
        self._made: set[str] = set()
        self._names = itertools.count()
        self._closed = False
        self._calls = threading.Condition()  # the calls running on the event loop (a close waits)
        self._running: set[concurrent.futures.Future] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tiered-kv-file", daemon=True)
        self._thread.start()

    @classmethod
    def from_url(cls, url: str, **options) -> FileBackend:
        path = directory_of(url, "file")
        warn_if_relative(url, "file", path)
        return cls(path, url=url, **url_options(url, options))

    @classmethod
    def store_url_at(cls, path: Path) -> str | None:
        return f"file://{quote(str(path.resolve()))}" if (path / MARKER).is_file() else None

    @classmethod
    def open_read_only(cls, url: str, *, options: dict | None = None, timeout: float = 5.0) -> FileBackend:
        """The existing store at ``url`` with ``options`` (the engine's: its quotas, capacity and
        sync bound and sync a tool's writes too); reads leave access times alone (``touch=False``)."""
        return cls.from_url(url, **{**(options or {}), "touch": False, "create": False})

    # -- names and the event loop ------------------------------------------------------------
    def _file(self, key: bytes) -> Path:
        return file_of(self.path, key)

    def _run(self, coro):
        with self._calls:
            if self._closed:
                coro.close()
                raise BackendClosed(f"file backend at {self.path} is closed")
            future = asyncio.run_coroutine_threadsafe(coro, self._loop)
            self._running.add(future)
        try:
            return future.result()
        except concurrent.futures.CancelledError:  # (a close that could wait no longer)
            raise BackendClosed(f"file backend at {self.path} closed during the call") from None
        except OSError as exc:
            self._count(errors=1)
            raise BackendUnavailable(f"file store at {self.path}: {exc}") from exc
        finally:
            with self._calls:
                self._running.discard(future)
                self._calls.notify_all()

    @staticmethod
    async def _each(items, fn) -> list:
        gate = asyncio.Semaphore(CONCURRENCY)

        async def one(item):
            async with gate:
                return await fn(item)

        # every call ends before this returns, a failed one too: a caller may reuse the buffers
        # it handed in as soon as the batch is over (the store encodes into reused memory)
        results = await asyncio.gather(*(one(item) for item in items), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return list(results)

    # -- reads -------------------------------------------------------------------------------
    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        keys = [as_key(k) for k in keys]
        values = self._run(self._each(keys, self._read))
        hits = [v for v in values if v is not None]
        self._count(gets=len(keys), hits=len(hits), bytes_out=sum(map(len, hits)))
        return values

    async def _read(self, key: bytes) -> bytes | None:
        data = await _read_value(self._file(key), self.touch)
        if data is None:
            return None
        if self._room is not None:
            self._room.touched(key)
        return data

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        keys = [as_key(k) for k in keys]
        return self._run(self._each(keys, lambda k: _holds_value(self._file(k))))

    def scan(self, prefix: bytes = b"") -> Iterator[bytes]:
        prefix = bytes(prefix)
        return iter([s.key for s in self._listing() if s.key.startswith(prefix)])

    def _listing(self, leftovers: list[Path] | None = None) -> list[Stored]:
        """Every stored value with its tenant and stat; temporary and foreign files are skipped
        (those left behind by a killed writer go into ``leftovers``: the room removes them)."""
        if self._closed:
            raise BackendClosed(f"file backend at {self.path} is closed")
        try:
            return stored_files(self.path, leftovers)
        except OSError as exc:
            self._count(errors=1)
            raise BackendUnavailable(f"file store at {self.path}: {exc}") from exc

    # -- writes ------------------------------------------------------------------------------
    def put_many(self, items: Sequence[tuple[bytes, bytes]], tenant: bytes = b"") -> list[bool]:
        tenant = as_tenant(tenant)
        items = [(as_key(k), v) for k, v in items]
        sizes = [memoryview(v).nbytes for _, v in items]
        if self._room is None:
            ok = [True] * len(items)
            self._put_admitted(items, ok, tenant)
        else:  # (the keys admitted are in flight until written: no other put may evict them)
            admission = self._room.admit([k for k, _ in items], sizes, tenant)
            ok = admission.accepted
            try:
                gone = admission.victims + admission.dropped
                if gone:
                    self._run(self._each([self._file(k) for k in gone], _remove))
                    self._count(evictions=len(admission.victims), quota_evictions=admission.quota_victims)
                    self._tell("removed", gone)
                self._put_admitted(items, ok, tenant)
            except BaseException:
                self._room.forget()
                raise
            finally:
                self._room.written([k for (k, _), f in zip(items, ok) if f])
        self._count(puts=sum(ok), put_rejected=len(ok) - sum(ok),
                    bytes_in=sum(n for n, s in zip(sizes, ok) if s))
        self._tell("stored", [k for (k, _), s in zip(items, ok) if s])
        return ok

    def _put_admitted(self, items: list[tuple[bytes, bytes]], ok: list[bool], tenant: bytes) -> None:
        if tenant and self._format < FORMAT and any(ok):
            self._upgrade()
        self._run(self._each([(k, v, tenant) for (k, v), f in zip(items, ok) if f], self._write))

    def _upgrade(self) -> None:
        """The marker says FORMAT before the first tenant file is written."""
        try:
            upgrade_marker(self.path)
        except OSError as exc:
            self._count(errors=1)
            raise BackendUnavailable(f"file store at {self.path}: {exc}") from exc
        self._format = FORMAT

    async def _write(self, item: tuple[bytes, bytes, bytes]) -> None:
        key, value, tenant = item
        path = self._file(key)
        if path.parent.name not in self._made:
            await aiofiles.os.makedirs(path.parent, exist_ok=True)
            if self.sync:  # (the bucket's name in the store's directory)
                await _sync_dir(self.path)
            self._made.add(path.parent.name)
        tmp = temp_of(target_of(path, tenant), next(self._names))
        fh = await aiofiles.open(tmp, "xb")  # (never another writer's file, never removed)
        try:
            try:
                await fh.write(value)
                if self.sync:
                    await fh.flush()
                    await _fsync(fh.fileno())
            finally:
                await fh.close()
            await _publish(tmp, path, tenant)
            if self.sync:  # (the rename is durable too: the directory naming the value)
                await _sync_dir(path.parent)
        except BaseException:
            await _remove(tmp)
            raise

    def delete_many(self, keys: Sequence[bytes]) -> int:
        keys = [as_key(k) for k in keys]
        sizes = self._run(self._each([self._file(k) for k in keys], _remove))
        if self._room is not None:
            self._room.removed(keys)
        n = sum(1 for s in sizes if s is not None)
        self._count(deletes=n)
        self._tell("removed", [k for k, s in zip(keys, sizes) if s is not None])
        return n

    # -- pins, figures, maintenance ----------------------------------------------------------
    def pin_many(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            self._pins.update(map(as_key, keys))

    def unpin_many(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            for key in map(as_key, keys):
                self._pins[key] -= 1
                if self._pins[key] <= 0:
                    del self._pins[key]

    def _is_pinned(self, key: bytes) -> bool:
        with self._lock:
            return key in self._pins

    def tenant_totals(self) -> dict[bytes, TenantTotal]:
        """Per tenant: bytes and files, from a listing (every process's files)."""
        totals: dict[bytes, tuple[int, int]] = {}
        for stored in self._listing():
            used, n = totals.get(stored.tenant, (0, 0))
            totals[stored.tenant] = (used + stored.stat.st_size, n + 1)
        return {tenant: TenantTotal(*t) for tenant, t in totals.items()}

    def stats(self) -> BackendStats:
        listing = self._listing()
        return self._snapshot(entries=len(listing), used_bytes=sum(s.stat.st_size for s in listing),
                              capacity_bytes=self.capacity,
                              extra={"sync": self.sync, "pinned": len(self._pins)})

    def entry_meta(self, key: bytes) -> dict | None:
        """Size, last access (atime), creation (the rename: mtime) and tenant of ``key``; no
        hit count."""
        path = self._file(as_key(key))
        st = file_entries.value_stat(path)
        if st is None:
            return None
        return {"size": st.st_size, "last_access_ns": st.st_atime_ns, "hits": None,
                "created_ns": st.st_mtime_ns, "tenant": file_entries.tenant_at(path)}

    def check(self, fix: bool = False) -> list[str]:
        """Leftover temporary files, tenant files no key links to (both older than
        ``file_entries.STALE_S``), links to nothing and foreign files; removed with ``fix`` (but
        directories, and foreign files beside the buckets: reported only). Files renamed or
        removed by another process during the walk are skipped."""
        try:
            return check_dir(self.path, fix)
        except OSError as exc:
            self._count(errors=1)
            raise BackendUnavailable(f"file store at {self.path}: {exc}") from exc

    def close(self) -> None:
        """Refuse new calls, wait for running ones (at most CLOSE_WAIT_S: then they are
        cancelled, BackendClosed to their callers), stop the event loop. A call left waiting on
        a stopped loop used to wait for good."""
        with self._calls:
            if self._closed:
                return
            self._closed = True
            cancelled = list(self._running) if not self._calls.wait_for(lambda: not self._running,
                                                                         CLOSE_WAIT_S) else []
            for future in cancelled:
                future.cancel()
        if cancelled:  # their coroutines clean up (temporary files) before the loop stops
            log.warning("file store at %s: closed while %d calls still ran", self.path, len(cancelled))
            asyncio.run_coroutine_threadsafe(_others_ended(CLOSE_WAIT_S), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()


async def _others_ended(timeout: float) -> None:
    """Wait (at most ``timeout``) for the event loop's other tasks to end."""
    others = asyncio.all_tasks() - {asyncio.current_task()}
    if others:
        await asyncio.wait(others, timeout=timeout)


_read_value = aiofiles.os.wrap(file_entries.read_value)
_holds_value = aiofiles.os.wrap(lambda path: file_entries.value_stat(path) is not None)
_remove = aiofiles.os.wrap(file_entries.remove)
_publish = aiofiles.os.wrap(file_entries.publish)
_fsync = aiofiles.os.wrap(os.fsync)
_sync_dir = aiofiles.os.wrap(file_entries.sync_dir)
