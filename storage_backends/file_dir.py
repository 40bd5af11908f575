"""A directory of files, one per value: the export format of ``tiered-kv copy`` and a tier for
shared network filesystems, where LMDB's locking does not hold.

``file:///abs/dir`` (``file://./rel``, ``file:rel``). Layout (``storage_backends.file_layout``)::

    DIR/.tiered-kv-file-store      marker (format version); a directory without it is refused
    DIR/<ff>/<key as hex>          one value (for tiered-kv: a stored block, header and body)

``<ff>`` is the last byte of the key in hex (block keys end in hash bytes: an even spread).
A value is written to a temporary name in the same directory and renamed over the final one,
so readers on any host see the old value or the new one, never a torn one. Reads and writes
go through aiofiles on one event loop thread per backend; the sync interface submits to it.

Options: ``capacity`` (bytes; default none: the filesystem decides) evicts least recently
used files when a put would go over it. The LRU order comes from one scan of access times
(which reads set), kept up to date in memory and rescanned every RESCAN_S to adopt other
processes' files: approximate when several processes share the directory;
``sync`` fsyncs each file before the rename; ``touch=false`` leaves access times alone (tools:
no ``utime``, and files are opened with O_NOATIME where the filesystem allows it);
``create=false`` refuses to make a store where there is none.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Iterator, Sequence
from pathlib import Path
from urllib.parse import quote

import aiofiles
import aiofiles.os

from storage_backends.base import Backend, BackendStats
from storage_backends.file_layout import (
    MARKER,
    as_key,
    check_dir,
    file_of,
    open_store,
    stored_files,
    temp_of,
)
from storage_backends.options import directory_of, split_options
from tiered_kv.errors import BackendClosed, BackendUnavailable, ConfigError
from tiered_kv.units import as_bool, parse_size

log = logging.getLogger(__name__)

CONCURRENCY = 16  # files read or written at once per call
RESCAN_S = 60.0  # with a capacity: how old the in-memory LRU order may get before a rescan
OPTIONS = ("capacity", "sync", "touch", "create")
IGNORED = ("timeout", "retries")  # remote-tier settings with no meaning for a local path


class FileBackend(Backend):
    name = "file"
    store_signature = "file-store marker"

    def __init__(self, path: str | os.PathLike, *, capacity: int | str | None = None,
                 sync: bool | str = False, touch: bool | str = True, create: bool | str = True,
                 url: str | None = None) -> None:
        self.path = Path(path)
        super().__init__(url or f"file://{self.path.resolve()}")
        self.capacity = None if capacity in (None, "") else parse_size(capacity, name="file capacity")
        if self.capacity is not None and self.capacity <= 0:
            raise ConfigError(f"file capacity must be positive, got {capacity!r}")
        self.sync = as_bool(sync, "file sync")
        self.touch = as_bool(touch, "file touch")
        open_store(self.path, as_bool(create, "file create"))
        self._lock = threading.Lock()
        self._pins: Counter = Counter()
        self._lru: OrderedDict[bytes, int] | None = None  # key -> size, LRU first (capacity only)
        self._lru_bytes = 0  # sum of the sizes in _lru
        self._scanned = 0.0  # when _lru was built from the directory
        self._made: set[str] = set()
        self._names = itertools.count()
        self._closed = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tiered-kv-file", daemon=True)
        self._thread.start()

    @classmethod
    def from_url(cls, url: str, **options) -> FileBackend:
        _, query = split_options(url)
        query.update({k: v for k, v in options.items() if v is not None})
        for name in IGNORED:
            query.pop(name, None)
        unknown = sorted(set(query) - set(OPTIONS))
        if unknown:
            raise ConfigError(f"unknown file option {unknown[0]!r} (known: {', '.join(OPTIONS)})")
        return cls(directory_of(url, "file"), url=url, **query)

    @classmethod
    def store_url_at(cls, path: Path) -> str | None:
        return f"file://{quote(str(path.resolve()))}" if (path / MARKER).is_file() else None

    @classmethod
    def open_read_only(cls, url: str, *, timeout: float = 5.0) -> FileBackend:
        """The existing store at ``url``; reads leave access times alone (``touch=False``)."""
        return cls.from_url(url, touch=False, create=False)

    # -- names and the event loop ------------------------------------------------------------
    def _file(self, key: bytes) -> Path:
        return file_of(self.path, key)

    def _run(self, coro):
        if self._closed:
            coro.close()
            raise BackendClosed(f"file backend at {self.path} is closed")
        try:
            return asyncio.run_coroutine_threadsafe(coro, self._loop).result()
        except OSError as exc:
            self._count(errors=1)
            raise BackendUnavailable(f"file store at {self.path}: {exc}") from exc

    @staticmethod
    async def _each(items, fn) -> list:
        gate = asyncio.Semaphore(CONCURRENCY)

        async def one(item):
            async with gate:
                return await fn(item)

        return list(await asyncio.gather(*(one(item) for item in items)))

    # -- reads -------------------------------------------------------------------------------
    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        keys = [as_key(k) for k in keys]
        values = self._run(self._each(keys, self._read))
        hits = [v for v in values if v is not None]
        self._count(gets=len(keys), hits=len(hits), bytes_out=sum(map(len, hits)))
        return values

    async def _read(self, key: bytes) -> bytes | None:
        path = self._file(key)
        try:
            async with aiofiles.open(path, "rb", opener=None if self.touch else _open_untouched) as fh:
                data = await fh.read()
        except FileNotFoundError:
            return None
        if self.touch:
            await _touch(path)
        if self._lru is not None:
            with self._lock:
                if key in self._lru:
                    self._lru.move_to_end(key)
        return data

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        keys = [as_key(k) for k in keys]
        return self._run(self._each(keys, lambda k: aiofiles.os.path.isfile(self._file(k))))

    def scan(self, prefix: bytes = b"") -> Iterator[bytes]:
        prefix = bytes(prefix)
        return iter([k for k, _ in self._listing() if k.startswith(prefix)])

    def _listing(self) -> list[tuple[bytes, os.stat_result]]:
        """(key, stat) of every stored value; temporary and foreign files are skipped."""
        if self._closed:
            raise BackendClosed(f"file backend at {self.path} is closed")
        try:
            return stored_files(self.path)
        except OSError as exc:
            self._count(errors=1)
            raise BackendUnavailable(f"file store at {self.path}: {exc}") from exc

    # -- writes ------------------------------------------------------------------------------
    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> list[bool]:
        items = [(as_key(k), v) for k, v in items]
        sizes = [memoryview(v).nbytes for _, v in items]
        fits = [self.capacity is None or n <= self.capacity for n in sizes]
        if self.capacity is not None and any(fits):
            self._make_room(sum(n for n, f in zip(sizes, fits) if f))
        todo = [(k, v) for (k, v), f in zip(items, fits) if f]
        stored = iter(self._run(self._each(todo, self._write)))
        ok = [next(stored) if f else False for f in fits]
        if self._lru is not None:
            with self._lock:  # in batch order: the files were written concurrently
                for (key, _), size, done in zip(items, sizes, ok):
                    if done:
                        self._lru_bytes += size - self._lru.get(key, 0)
                        self._lru[key] = size
                        self._lru.move_to_end(key)
        self._count(puts=sum(ok), put_rejected=len(ok) - sum(ok),
                    bytes_in=sum(n for n, s in zip(sizes, ok) if s))
        return ok

    async def _write(self, item: tuple[bytes, bytes]) -> bool:
        key, value = item
        path = self._file(key)
        if path.parent.name not in self._made:
            await aiofiles.os.makedirs(path.parent, exist_ok=True)
            self._made.add(path.parent.name)
        tmp = temp_of(path, next(self._names))
        try:
            async with aiofiles.open(tmp, "wb") as fh:
                await fh.write(value)
                if self.sync:
                    await fh.flush()
                    await _fsync(fh.fileno())
            await aiofiles.os.replace(tmp, path)
        except BaseException:
            await _unlink(tmp)
            raise
        return True

    def delete_many(self, keys: Sequence[bytes]) -> int:
        keys = [as_key(k) for k in keys]
        sizes = self._run(self._each([self._file(k) for k in keys], _unlink))
        if self._lru is not None:
            with self._lock:
                for key in keys:
                    self._lru_bytes -= self._lru.pop(key, 0)
        n = sum(1 for s in sizes if s is not None)
        self._count(deletes=n)
        return n

    def _make_room(self, incoming: int) -> None:
        """Evict least recently used, unpinned files until ``incoming`` more bytes fit."""
        if self._lru is None or time.monotonic() - self._scanned > RESCAN_S:
            listing = sorted(self._listing(), key=lambda e: e[1].st_atime_ns)
            with self._lock:
                self._lru = OrderedDict((k, st.st_size) for k, st in listing)
                self._lru_bytes = sum(self._lru.values())
                self._scanned = time.monotonic()
        with self._lock:
            used = self._lru_bytes
            victims = []
            for key, size in self._lru.items():
                if used + incoming <= self.capacity:
                    break
                if key not in self._pins:
                    victims.append(key)
                    used -= size
            for key in victims:
                self._lru_bytes -= self._lru.pop(key)
        if victims:
            self._run(self._each([self._file(k) for k in victims], _unlink))
            self._count(evictions=len(victims))

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

    def stats(self) -> BackendStats:
        listing = self._listing()
        return self._snapshot(entries=len(listing), used_bytes=sum(st.st_size for _, st in listing),
                              capacity_bytes=self.capacity,
                              extra={"sync": self.sync, "pinned": len(self._pins)})

    def entry_meta(self, key: bytes) -> dict | None:
        """Size, last access (atime) and creation (the rename: mtime) of ``key``; no hit count."""
        try:
            st = os.stat(self._file(as_key(key)))
        except FileNotFoundError:
            return None
        return {"size": st.st_size, "last_access_ns": st.st_atime_ns, "hits": None,
                "created_ns": st.st_mtime_ns}

    def check(self, fix: bool = False) -> list[str]:
        """Leftover temporary files (older than ``file_layout.STALE_TEMP_S``) and foreign files;
        removed with ``fix``."""
        return check_dir(self.path, fix)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()


def _set_atime(path: Path) -> None:
    try:
        st = os.stat(path)
        os.utime(path, ns=(time.time_ns(), st.st_mtime_ns))
    except FileNotFoundError:  # replaced or deleted meanwhile
        pass


def _open_untouched(path: str, flags: int) -> int:
    """Open without the kernel's own access time update (``relatime`` records a first read),
    where the file is ours (O_NOATIME needs that)."""
    try:
        return os.open(path, flags | getattr(os, "O_NOATIME", 0))
    except PermissionError:
        return os.open(path, flags)


def _unlink_sized(path: Path) -> int | None:
    """Remove ``path``; its size, or None when it was not there."""
    try:
        size = os.stat(path).st_size
        os.unlink(path)
        return size
    except FileNotFoundError:
        return None


_touch = aiofiles.os.wrap(_set_atime)
_unlink = aiofiles.os.wrap(_unlink_sized)
_fsync = aiofiles.os.wrap(os.fsync)
