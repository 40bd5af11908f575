"""Evicted host entries whose ``on_evict`` hook has not run yet, and which of them were
withdrawn meanwhile.

The host tier copies an evicted entry's bytes under its lock and hands them to the hook after
releasing it (the hook queues their write to a lower tier). A withdrawal of the key in that gap
(:meth:`HostBackend.retire_many`: the bytes may be wrong) finds no entry left to retire, and
could begin and end before the hook queues its write, which would then store the wrong bytes
after their delete. So the withdrawal is remembered here, per eviction, until that eviction's
hook has run, and the hook's writer asks for it: a hook asking of its own key learns of its own
eviction (a copy of the key stored after the withdrawal and evicted again is good: it was once
dropped as withdrawn while an earlier eviction's hook was still pending, written nowhere);
anyone else learns whether any pending eviction of the key was withdrawn. Every method but
:meth:`handing` and :meth:`run` is called under the host tier's lock."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager

log = logging.getLogger(__name__)

EvictHook = Callable[[bytes, memoryview, bytes], None]  # (key, value, tenant)


class Taken:
    """One eviction's bytes on their way to the hook; ``withdrawn`` once its key was withdrawn."""

    __slots__ = ("withdrawn",)

    def __init__(self) -> None:
        self.withdrawn = False


class PendingEvictions:
    """Keys whose evicted bytes are on their way to the hook."""

    def __init__(self) -> None:
        self._pending: dict[bytes, list[Taken]] = {}  # key -> its evictions whose hook has not ended
        self._hooking = threading.local()  # .now: (key, Taken) whose hook this thread runs

    def taken(self, key: bytes) -> Taken:
        """An eviction took ``key``'s bytes for the hook."""
        taken = Taken()
        self._pending.setdefault(key, []).append(taken)
        return taken

    def withdraw(self, keys: Iterable[bytes]) -> None:
        """``keys`` are withdrawn: bytes of theirs on the way to the hook may be wrong."""
        if self._pending:
            for key in keys:
                for taken in self._pending.get(key, ()):
                    taken.withdrawn = True

    def withdrawn(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key's evicted bytes were withdrawn before their hook ended: those of the
        eviction whose hook is asking, else those of any eviction of the key still pending."""
        if not self._pending:
            return [False] * len(keys)
        now = getattr(self._hooking, "now", None)
        return [now[1].withdrawn if now is not None and now[0] == k
                else any(t.withdrawn for t in self._pending.get(k, ())) for k in keys]

    def hooked(self, key: bytes, taken: Taken) -> None:
        """The hook of the eviction ``taken`` of ``key`` ended."""
        left = [t for t in self._pending.get(key, ()) if t is not taken]
        if left:
            self._pending[key] = left
        else:
            self._pending.pop(key, None)

    @contextmanager
    def handing(self, hook: EvictHook | None, lock: AbstractContextManager,
                undo: Callable[[], None] | None = None) -> Iterator[list]:
        """The list an eviction appends the (key, bytes, tenant, :meth:`taken`) it took to,
        handed to ``hook`` (:meth:`run`) when the block ends, also when it raised: the entries
        are gone from the tier either way, and a key left pending would read as withdrawn for
        good once withdrawn, its later evicted copies dropped. When the hook raises through
        :meth:`run`, ``undo`` rolls back what the block made: its caller gets that error, never
        the result (reservations it never learns of were held for good)."""
        evicted: list[tuple[bytes, bytes, bytes, Taken]] = []
        try:
            yield evicted
        finally:
            try:
                self.run(hook, evicted, lock)
            except BaseException:
                if undo is not None:
                    undo()
                raise

    def run(self, hook: EvictHook | None, evicted: list[tuple[bytes, bytes, bytes, Taken]],
            lock: AbstractContextManager) -> None:
        """Hand ``hook`` the (key, bytes, tenant) of entries this thread evicted (outside the host
        lock: the hook queues writes), then forget them here (under it). A hook raising what is
        no Exception (KeyboardInterrupt, SystemExit) has it raised after the last entry: the
        ones after it reached no tier and stayed pending for good (read as withdrawn once
        withdrawn: every later evicted copy of theirs dropped)."""
        interrupted: BaseException | None = None
        for key, value, tenant, taken in evicted:
            outer = getattr(self._hooking, "now", None)  # (a hook that evicts in turn)
            self._hooking.now = (key, taken)
            try:
                hook(key, memoryview(value), tenant)  # type: ignore[misc]
            except Exception:  # a failing hook must not break the tier
                log.exception("host on_evict hook failed for key %s", key.hex())
            except BaseException as exc:
                interrupted = interrupted or exc
            finally:
                self._hooking.now = outer
                with lock:
                    self.hooked(key, taken)
        if interrupted is not None:
            raise interrupted
