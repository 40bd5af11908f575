"""Room in a bounded file medium (a capacity or tenant quotas): what puts evict and refuse.

The medium's view of its directory is a :class:`~storage_backends.recency.RecencyIndex` built by
one listing (access times give the order), kept up to date with this process's puts, reads and
deletes, and rebuilt every RESCAN_S to adopt other processes' files: approximate when several
processes share the directory; a rescan also removes the temporary files that writers killed
mid-put left behind (:func:`~storage_backends.file_entries.drop_leftovers`: counted nowhere, they
stayed until an operator's ``check --fix``). :mod:`storage_backends.eviction` decides on the
view. A key admitted stays pinned until its put wrote it (:meth:`FileRoom.written`): a put
evicting a value still being written (by another thread's put, or earlier in its own batch)
removed nothing, and the value then landed beyond the capacity, unseen by the view. A file
system that fills before the capacity is reached makes room the same way
(:meth:`FileRoom.make_room`).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from storage_backends.eviction import Eviction
from storage_backends.file_entries import Stored, drop_leftovers
from storage_backends.recency import RecencyIndex

RESCAN_S = 60.0  # how old the in-memory view may get before a rescan


@dataclass
class Admission:
    """What one put call may store, and what must go first."""

    accepted: list[bool] = field(default_factory=list)
    victims: list[bytes] = field(default_factory=list)  # evicted (quota ones included)
    quota_victims: int = 0
    dropped: list[bytes] = field(default_factory=list)  # overwritten by a put that was refused


class FileRoom:
    def __init__(self, eviction: Eviction, listing: Callable[[list[Path]], list[Stored]],
                 pinned: Callable[[bytes], bool]) -> None:
        """``listing(leftovers)``: the stored values, and temporary files left behind added to
        ``leftovers``."""
        self.eviction = eviction
        self._listing, self._pinned = listing, pinned
        self._lock = threading.Lock()
        self._index: RecencyIndex | None = None
        self._scanned = 0.0
        self._writing: Counter = Counter()  # keys admitted, not written yet (pinned meanwhile)

    def admit(self, keys: Sequence[bytes], sizes: Sequence[int], tenant: bytes) -> Admission:
        """Plan a put of ``keys`` (in order) for ``tenant``: each is stored unless the eviction
        rule refuses it; an overwritten key that is refused goes too (as in every medium)."""
        index = self._current()
        out = Admission()
        with self._lock:
            for key, size in zip(keys, sizes):
                if not self.eviction.fits(tenant, size):  # the old value stays
                    out.accepted.append(False)
                    continue
                old = index.remove(key)
                plan = self.eviction.plan(index, tenant, size)
                if plan is None:
                    out.accepted.append(False)
                    out.dropped += [key] if old is not None else []
                    continue
                for victim, _ in plan.victims:
                    index.remove(victim)
                out.victims += [victim for victim, _ in plan.victims]
                out.quota_victims += len(plan.quota)
                index.add(key, size, tenant)
                self._writing[key] += 1
                out.accepted.append(True)
        return out

    def written(self, keys: Sequence[bytes]) -> None:
        """The put that admitted ``keys`` is over (written or failed): they may be evicted."""
        with self._lock:
            for key in keys:
                self._writing[key] -= 1
                if self._writing[key] <= 0:
                    del self._writing[key]

    def touched(self, key: bytes) -> None:
        with self._lock:
            if self._index is not None:
                self._index.touch(key)

    def removed(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            for key in keys if self._index is not None else ():
                self._index.remove(key)

    def make_room(self, nbytes: int, count: int, may_go: Callable[[bytes], bool] | None = None) -> list[bytes]:
        """The file system filled (or a quota was spent) before the capacity was reached: the
        first values to go (the policy's order; pinned ones, those being written and those
        ``may_go`` refuses stay) that hold ``nbytes`` in ``count`` files at least, or all there
        are, out of the view (the caller removes them)."""
        index = self._current()
        with self._lock:
            victims, freed = [], 0
            for key, size in self.eviction.policy.candidates(index):
                if freed >= nbytes and len(victims) >= count:
                    break
                if may_go is not None and not may_go(key):
                    continue
                victims.append(key)
                freed += size
            for key in victims:
                index.remove(key)
        return victims

    def failed(self, keys: Sequence[bytes], found: Callable[[bytes], tuple[int, bytes] | None]) -> None:
        """``keys`` were admitted but refused: out of the view, or back in it as ``found(key)``
        says the directory still holds them ((size, tenant): the old value a refused overwrite
        left; None: nothing)."""
        held = [(key, found(key)) for key in keys]
        with self._lock:
            for key, old in held if self._index is not None else ():
                self._index.remove(key)
                if old is not None:
                    self._index.add(key, *old)

    def forget(self) -> None:
        """Rebuild the view at the next put (a write failed: it may hold what is not there)."""
        with self._lock:
            self._index = None

    def _held(self, key: bytes) -> bool:
        """(under the lock, as eviction plans) pinned by the medium, or being written."""
        return key in self._writing or self._pinned(key)

    def _current(self) -> RecencyIndex:
        if self._index is None or time.monotonic() - self._scanned > RESCAN_S:
            index, leftovers = RecencyIndex(self._held), []
            for stored in sorted(self._listing(leftovers), key=lambda s: s.stat.st_atime_ns):
                index.add(stored.key, stored.stat.st_size, stored.tenant)
            with self._lock:
                self._index, self._scanned = index, time.monotonic()
            drop_leftovers(leftovers)
        return self._index
