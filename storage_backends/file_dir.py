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
go through aiofiles on one event loop thread per backend (:mod:`storage_backends.file_calls`).
A value with no room (the capacity, a quota, a full file system) or with something that is no
regular file under its key's name (a directory) is refused alone, never the batch's error; a
full file system evicts as the capacity does (a spent quota: this user's values only), then the
value is written once more (:mod:`storage_backends.file_outcomes`). A value this process may
not read is absent.

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

import itertools
import os
import threading
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from urllib.parse import quote

import aiofiles
import aiofiles.os

from storage_backends import file_entries
from storage_backends import file_outcomes as outcomes
from storage_backends.base import Backend, BackendStats, TenantTotal
from storage_backends.eviction import Eviction
from storage_backends.eviction_lru import LRU
from storage_backends.file_calls import LoopCalls
from storage_backends.file_check import check_dir
from storage_backends.file_durable import make_bucket, sync_dir
from storage_backends.file_entries import Stored, stored_files, target_of
from storage_backends.file_layout import FORMAT, MARKER, as_key, file_of, open_store, temp_of, upgrade_marker
from storage_backends.file_options import file_settings, url_options
from storage_backends.file_outcomes import FULL, NOT_A_FILE, OVER_QUOTA, STORED, refusal_of
from storage_backends.file_room import FileRoom
from storage_backends.options import directory_of, warn_if_relative
from storage_backends.quotas import as_tenant
from tiered_kv.errors import BackendClosed, BackendUnavailable

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
        self._format = open_store(self.path, settings.create, repair=settings.touch)  # (a tool's read-only open: no)
        self._lock = threading.Lock()
        self._pins: Counter = Counter()
        bounded = self.capacity is not None or self.quotas
        self._room = FileRoom(Eviction(LRU, self.capacity, self.quotas), self._listing, self._is_pinned) \
            if bounded else None
        # (among put_rejected: values refused for a full file system, for a directory under the key's name)
        self._counters.extra.update(quota_evictions=0, put_disk_full=0, put_not_a_file=0, put_over_quota=0)
        self._made: set[str] = set()
        self._names = itertools.count()
        self._calls = LoopCalls(self.path)
        self._thread = self._calls.thread

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

    @property
    def _closed(self) -> bool:
        return self._calls.closed

    def _run(self, coro):
        try:
            return self._calls.run(coro)
        except OSError as exc:
            self._count(errors=1)
            raise BackendUnavailable(f"file store at {self.path}: {exc}") from exc

    # -- reads -------------------------------------------------------------------------------
    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        keys = [as_key(k) for k in keys]
        values = self._run(LoopCalls.each(keys, self._read))
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
        return self._run(LoopCalls.each(keys, lambda k: _holds_value(self._file(k))))

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
        """Values refused (no room, a full file system, no regular file under a key's name) are
        False: counted ``put_rejected``, never the batch's error."""
        tenant = as_tenant(tenant)
        items = [(as_key(k), v) for k, v in items]
        sizes = [memoryview(v).nbytes for _, v in items]
        if self._room is None:
            ok = self._put_admitted(items, sizes, [True] * len(items), tenant)
        else:  # (the keys admitted are in flight until written: no other put may evict them)
            admission = self._room.admit([k for k, _ in items], sizes, tenant)
            admitted = admission.accepted
            try:
                self._evict(admission.victims + admission.dropped, len(admission.victims), admission.quota_victims)
                ok = self._put_admitted(items, sizes, admitted, tenant)
                self._room.failed([k for (k, _), f, s in zip(items, admitted, ok) if f and not s],
                                  lambda k: file_entries.held_value(self._file(k)))
            except BaseException:
                self._room.forget()
                raise
            finally:
                self._room.written([k for (k, _), f in zip(items, admitted) if f])
        self._count(puts=sum(ok), put_rejected=len(ok) - sum(ok),
                    bytes_in=sum(n for n, s in zip(sizes, ok) if s))
        self._tell("stored", [k for (k, _), s in zip(items, ok) if s])
        return ok

    def _put_admitted(self, items: list[tuple[bytes, bytes]], sizes: list[int], admitted: list[bool],
                      tenant: bytes) -> list[bool]:
        """Write the values ``admitted``; which were stored. Those a full file system or a spent
        quota refused are written once more after the first values to go made room for them (a
        bounded store's: an unbounded one evicts nothing), as a full capacity would have; the
        room is their bytes (and files where inodes ran out: ``outcomes.room_for``). For a quota
        only this user's values go (another user's would free none of it)."""
        stored = [False] * len(items)
        refused = self._write_all(items, [i for i, f in enumerate(admitted) if f], tenant, stored)
        for why, todo in refused.items():
            room = outcomes.room_for(self.path, [sizes[i] for i in todo]) if self._room is not None else None
            mine = (lambda k: file_entries.owner_of(self._file(k)) == os.geteuid()) if why == OVER_QUOTA else None
            victims = self._room.make_room(room.nbytes, room.files, mine) if room and room.nbytes else []
            if victims:  # (a value larger than the whole disk is not written again)
                self._evict(victims, len(victims))
                again = self._write_all(items, [i for i, f in zip(todo, room.fits) if f], tenant, stored)
                todo = [i for i, f in zip(todo, room.fits) if not f] + again.get(FULL, []) + again.get(OVER_QUOTA, [])
            if todo:
                self._count(**{"put_disk_full" if why == FULL else "put_over_quota": len(todo)})
                outcomes.say_full(self.path, len(todo), len(victims), self._room is not None, why)
        return stored

    def _write_all(self, items: list[tuple[bytes, bytes]], todo: list[int], tenant: bytes,
                   stored: list[bool]) -> dict[str, list[int]]:
        """Write the values of ``items`` at ``todo``, those stored marked in ``stored``; those
        refused for room, by why (FULL, OVER_QUOTA)."""
        refused = self._upgrade() if todo and tenant and self._format < FORMAT else None
        if not todo or refused is not None:
            return {refused: todo} if todo else {}
        results = self._run(LoopCalls.each([(*items[i], tenant) for i in todo], self._write))
        for i, outcome in zip(todo, results):
            stored[i] = outcome == STORED
        self._count(put_not_a_file=results.count(NOT_A_FILE))
        return {why: [i for i, o in zip(todo, results) if o == why] for why in (FULL, OVER_QUOTA) if why in results}

    def _evict(self, gone: list[bytes], evicted: int, quota_evicted: int = 0) -> None:
        """Remove ``gone``, of which ``evicted`` are evictions (``quota_evicted`` for quotas)."""
        if gone:
            self._run(LoopCalls.each([self._file(k) for k in gone], _remove))
            self._count(evictions=evicted, quota_evictions=quota_evicted)
            self._tell("removed", gone)

    def _upgrade(self) -> str | None:
        """The marker says FORMAT before the first tenant file is written; FULL or OVER_QUOTA when
        the file system refused it (the tenant's values are refused: EDQUOT failed their batch)."""
        try:
            upgrade_marker(self.path)
        except OSError as exc:
            refusal = refusal_of(exc, self.path / MARKER)
            if refusal in (FULL, OVER_QUOTA):
                return refusal
            self._count(errors=1)
            raise BackendUnavailable(f"file store at {self.path}: {exc}") from exc
        self._format = FORMAT
        return None

    async def _write(self, item: tuple[bytes, bytes, bytes]) -> str:
        """Write one value: STORED, or why it was refused (:mod:`storage_backends.file_outcomes`)."""
        key, value, tenant = item
        path = self._file(key)
        try:
            await self._write_value(path, value, tenant)
        except OSError as exc:
            self._made.discard(path.parent.name)  # (its bucket may be gone, or a file: made again next time)
            outcome = refusal_of(exc, path)
            if outcome is None:
                raise
            return outcome
        return STORED

    async def _write_value(self, path: Path, value, tenant: bytes) -> None:
        """``value`` written under a temporary name, then renamed to be ``path``'s; the
        temporary file removed again on any failure."""
        if path.parent.name not in self._made:
            await _make_bucket(path.parent)
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
        sizes = self._run(LoopCalls.each([self._file(k) for k in keys], _remove))
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
        self._calls.close(CLOSE_WAIT_S)


_read_value = aiofiles.os.wrap(file_entries.read_value)
_holds_value = aiofiles.os.wrap(file_entries.holds_value)
_remove = aiofiles.os.wrap(file_entries.remove)
_publish = aiofiles.os.wrap(file_entries.publish)
_fsync = aiofiles.os.wrap(os.fsync)
_sync_dir = aiofiles.os.wrap(sync_dir)
_make_bucket = aiofiles.os.wrap(make_bucket)
