"""Evicted host entries whose ``on_evict`` hook has not run yet, and which of them were
withdrawn meanwhile.

The host tier copies an evicted entry's bytes under its lock and hands them to the hook after
releasing it (the hook queues their write to a lower tier). A withdrawal of the key in that gap
(:meth:`HostBackend.retire_many`: the bytes may be wrong) finds no entry left to retire, and
could begin and end before the hook queues its write, which would then store the wrong bytes
after their delete. So the withdrawal is remembered here until the hook has run, and the hook's
writer asks for it. Every method but :meth:`handing` and :meth:`run` is called under the host
tier's lock."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager

log = logging.getLogger(__name__)

EvictHook = Callable[[bytes, memoryview, bytes], None]  # (key, value, tenant)


class PendingEvictions:
    """Keys whose evicted bytes are on their way to the hook."""

    def __init__(self) -> None:
        self._pending: Counter[bytes] = Counter()  # key -> evictions whose hook has not ended
        self._withdrawn: set[bytes] = set()  # of those, keys withdrawn since their bytes were taken

    def taken(self, key: bytes) -> None:
        """An eviction took ``key``'s bytes for the hook."""
        self._pending[key] += 1

    def withdraw(self, keys: Iterable[bytes]) -> None:
        """``keys`` are withdrawn: bytes of theirs on the way to the hook may be wrong."""
        if self._pending:
            self._withdrawn.update(k for k in keys if k in self._pending)

    def withdrawn(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key's evicted bytes were withdrawn before their hook ended."""
        if not self._withdrawn:
            return [False] * len(keys)
        return [k in self._withdrawn for k in keys]

    def hooked(self, key: bytes) -> None:
        """The hook of one eviction of ``key`` ended."""
        left = self._pending[key] - 1
        if left > 0:
            self._pending[key] = left
        else:
            del self._pending[key]
            self._withdrawn.discard(key)

    @contextmanager
    def handing(self, hook: EvictHook | None, lock: AbstractContextManager) -> Iterator[list]:
        """The list an eviction appends the (key, bytes, tenant) it took to (:meth:`taken`),
        handed to ``hook`` (:meth:`run`) when the block ends, also when it raised: the entries
        are gone from the tier either way, and a key left pending would read as withdrawn for
        good once withdrawn, its later evicted copies dropped."""
        evicted: list[tuple[bytes, bytes, bytes]] = []
        try:
            yield evicted
        finally:
            self.run(hook, evicted, lock)

    def run(self, hook: EvictHook | None, evicted: list[tuple[bytes, bytes, bytes]],
            lock: AbstractContextManager) -> None:
        """Hand ``hook`` the (key, bytes, tenant) of entries this thread evicted (outside the host
        lock: the hook queues writes), then forget them here (under it)."""
        for key, value, tenant in evicted:
            try:
                hook(key, memoryview(value), tenant)  # type: ignore[misc]
            except Exception:  # a failing hook must not break the tier
                log.exception("host on_evict hook failed for key %s", key.hex())
            finally:
                with lock:
                    self.hooked(key)
