"""Read-only memory maps of segment files, for readers that go through many values in several
passes (layer group by layer group): a view of a value in the map costs nothing until a page
of it is touched, so the first layer group of every block is in place before the rest of any
block was read from the disk. A map covers the file as long as it was when mapped (a segment
still being appended to is mapped again once a value lies beyond it); a view keeps its map
alive however long the caller holds it. A reader asks for the parts it uses next
(:meth:`SegmentMaps.advise`), so those arrive before the rest. Maps of files another process
deleted are dropped (at most once a second), so their disk space goes once no view is left."""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Callable
from pathlib import Path

from storage_backends.segment_pruning import Pruning, forget_gone


class SegmentMaps:
    """``path_of(segment)`` names each segment's file."""

    def __init__(self, path_of: Callable[[int], Path]) -> None:
        self.path_of = path_of
        self._lock = threading.Lock()
        self._maps: dict[int, tuple[mmap.mmap, int]] = {}  # segment -> (map, inode)
        self._pruning = Pruning()

    def view(self, segment: int, offset: int, length: int, sizes: dict[int, int | None] | None = None
             ) -> memoryview | None:
        """A read-only view of ``length`` bytes at ``offset`` of ``segment``; None when the
        file is gone or shorter than that. Nothing is read until the view is touched (or
        :meth:`advise` asks for it).

        The file's size is asked for (once per segment in ``sizes``, a reader's dict for one
        visit): a map outlives a file cut short behind its back (damage, a tool), and touching
        a page of a map past its file's end kills the process (SIGBUS), where a read would only
        come back short. A value past the end is a miss. (A file cut while a view of it is being
        read can still do that: the window is the visit, not the life of the map.) A file
        deleted after it was mapped keeps its pages for the map, and reading them is safe."""
        self._maybe_prune()
        sizes = {} if sizes is None else sizes
        if segment not in sizes:
            sizes[segment] = self._size(segment)
        size = sizes[segment]
        if size is not None and size < offset + length:
            return None
        with self._lock:
            entry = self._maps.get(segment)
        if entry is None or len(entry[0]) < offset + length:
            entry = self._map(segment)
            if entry is None or len(entry[0]) < offset + length:
                return None
        return memoryview(entry[0])[offset : offset + length].toreadonly()

    def _size(self, segment: int) -> int | None:
        """The file's size now; None when it is deleted (a map made before keeps its pages);
        -1 when it cannot be asked (unreadable: every value in it is a miss)."""
        try:
            return os.stat(self.path_of(segment)).st_size
        except FileNotFoundError:
            return None
        except OSError:
            return -1

    def advise(self, segment: int, offset: int, length: int) -> None:
        """Have the kernel start reading ``length`` bytes at ``offset`` of ``segment``'s map now
        (``MADV_WILLNEED``), so a cold page cache is filled in large requests while the reader
        works, not one fault at a time. Advice only: a segment not mapped is left alone."""
        with self._lock:
            entry = self._maps.get(segment)
        if entry is None or length <= 0:
            return
        start = offset - offset % mmap.PAGESIZE
        try:
            entry[0].madvise(mmap.MADV_WILLNEED, start, min(offset + length, len(entry[0])) - start)
        except (OSError, ValueError):
            pass  # advice only

    def _map(self, segment: int) -> tuple[mmap.mmap, int] | None:
        try:
            fd = os.open(self.path_of(segment), os.O_RDONLY | os.O_CLOEXEC)
        except OSError:  # gone, or unreadable: a miss
            return None
        try:
            st = os.fstat(fd)
            if st.st_size == 0:
                return None
            entry = (mmap.mmap(fd, st.st_size, prot=mmap.PROT_READ), st.st_ino)
        except (OSError, ValueError):
            return None
        finally:
            os.close(fd)  # the map holds the file
        with self._lock:
            self._maps[segment] = entry  # an older, shorter map lives on in its views
        return entry

    def forget(self, segment: int) -> None:
        """Drop ``segment``'s map (views handed out keep it until they go)."""
        with self._lock:
            self._maps.pop(segment, None)

    def _maybe_prune(self) -> None:
        if not self._pruning.due():
            return
        with self._lock:
            entries = [(segment, inode) for segment, (_, inode) in self._maps.items()]
        forget_gone(entries, lambda segment, inode: os.stat(self.path_of(segment)).st_ino != inode, self.forget)

    def close(self) -> None:
        with self._lock:
            self._maps = {}
