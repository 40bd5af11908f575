"""Read-only memory maps of segment files, for readers that go through many values in several
passes (layer group by layer group): a view of a value in the map costs nothing until a page
of it is touched, so the first layer group of every block is in place before the rest of any
block was read from the disk. A map covers the file as long as it was when mapped (a segment
still being appended to is mapped again once a value lies beyond it); a view keeps its map
alive however long the caller holds it. A reader asks for the parts it uses next
(:meth:`SegmentMaps.advise`), so those arrive before the rest. Maps of files another process
deleted are dropped (at most once a second), so their disk space goes once no view is left.

A map holds no descriptor (:class:`FileMap`): ``mmap.mmap`` keeps a duplicate of the file's
descriptor for as long as it lives (Python 3.13 can be asked not to: ``trackfd=False``), so a
reader that had visited as many segments as the process may open files held every descriptor
the process had (the engine's own opens then fail), and the segments after those were misses.
At most ``MAX_MAPS`` maps are kept (the least recently used go first): each is one of the
process's ``vm.max_map_count`` mappings.

Touching a page of a map that the file no longer has (cut short behind the store's back) or
that the disk fails to read kills the process with SIGBUS, where a ``preadv`` only comes back
short or with EIO. A reader asks for the pages it is about to touch with :func:`populate` first,
which reads them in and says whether they could be had, so those become misses."""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import numpy as np

from storage_backends.segment_pruning import Pruning, forget_gone

log = logging.getLogger(__name__)

MAX_MAPS = 1024  # maps kept: 128 GiB of address space at the default segment size

_libc = ctypes.CDLL(None, use_errno=True)
_mmap = _libc.mmap
_mmap.restype = ctypes.c_void_p
_mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int64]
_munmap = _libc.munmap
_munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_madvise = _libc.madvise
_madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
MAP_FAILED = ctypes.c_void_p(-1).value
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux 5.14
_populating = [True]  # False once the kernel refused MADV_POPULATE_READ (older than 5.14)
# what MADV_POPULATE_READ answers for a page that touching would SIGBUS on: past the file's end,
# or the disk failing to read it (a poisoned page)
_CANNOT_BE_HAD = frozenset({errno.EFAULT, errno.EIO, getattr(errno, "EHWPOISON", 133)})


def populate(view) -> bool | None:
    """Have every page under ``view`` (of a file's memory map) read in and mapped now
    (``MADV_POPULATE_READ``, which waits for the disk): True. False when a page cannot be had,
    the file cut short under the map or the disk failing to read it: touching the view would
    have killed the process with SIGBUS, and must not happen. None when the kernel cannot do
    this (before Linux 5.14): touching is then the only way to read it. A page populated can
    still be taken away by a truncation after this returns: the window is from here to the
    touch, no longer the whole visit."""
    view = memoryview(view).cast("B")
    if not len(view):
        return True
    if not _populating[0]:
        return None
    address = np.frombuffer(view, np.uint8).ctypes.data
    start = address - address % mmap.PAGESIZE
    if _madvise(start, address + len(view) - start, MADV_POPULATE_READ) == 0:
        return True
    err = ctypes.get_errno()
    if err in _CANNOT_BE_HAD:
        return False
    if err == errno.EINVAL:  # an older kernel: said once, then not asked again
        _populating[0] = False
        log.warning("this kernel cannot populate maps (MADV_POPULATE_READ, Linux 5.14): a segment cut short "
                    "or a disk error under a layer-wise read is not caught before the read touches it")
    return None  # (ENOMEM under a memory limit, EINTR, ...: says nothing of the file)


class FileMap:
    """A read-only shared map of a file's first ``length`` bytes that keeps no descriptor:
    ``len()``, :meth:`view` and :meth:`madvise`. Unmapped once neither it nor a view of it is
    left (a view holds the mapped bytes, so an unmapped page is never read), or when the process
    ends."""

    def __init__(self, fd: int, length: int) -> None:
        if length <= 0:
            raise ValueError(f"a map of {length} bytes")
        address = _mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if address is None or address == MAP_FAILED:
            err = ctypes.get_errno()
            raise OSError(err, f"mmap: {os.strerror(err)}")
        self.address, self.length = address, length
        self._bytes = (ctypes.c_char * length).from_address(address)
        # (views keep _bytes alive); not at exit: threads still reading a view would fault, and
        # the kernel unmaps everything when the process ends anyway
        weakref.finalize(self._bytes, _munmap, address, length).atexit = False

    def __len__(self) -> int:
        return self.length

    def view(self, offset: int, length: int) -> memoryview:
        """A read-only view of ``length`` bytes at ``offset`` (inside the map)."""
        if offset < 0 or length < 0 or offset + length > self.length:
            raise ValueError(f"{length} bytes at {offset} of a map of {self.length}")
        return memoryview(self._bytes).cast("B")[offset : offset + length].toreadonly()

    def madvise(self, option: int, start: int, length: int) -> None:
        """``madvise(2)`` over ``length`` bytes at ``start`` (as ``mmap.mmap.madvise``)."""
        if start < 0 or length < 0 or start + length > self.length:
            raise ValueError(f"{length} bytes at {start} of a map of {self.length}")
        if _madvise(self.address + start, length, option) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"madvise: {os.strerror(err)}")


class SegmentMaps:
    """``path_of(segment)`` names each segment's file."""

    def __init__(self, path_of: Callable[[int], Path]) -> None:
        self.path_of = path_of
        self._lock = threading.Lock()
        self._maps: OrderedDict[int, tuple[FileMap, int]] = OrderedDict()  # segment -> (map, inode), LRU
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
            if entry is not None:
                self._maps.move_to_end(segment)
        if entry is None or len(entry[0]) < offset + length:
            entry = self._map(segment)
            if entry is None or len(entry[0]) < offset + length:
                return None
        return entry[0].view(offset, length)

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

    def _map(self, segment: int) -> tuple[FileMap, int] | None:
        try:
            fd = os.open(self.path_of(segment), os.O_RDONLY | os.O_CLOEXEC)
        except OSError:  # gone, or unreadable: a miss
            return None
        try:
            st = os.fstat(fd)
            if st.st_size == 0:
                return None
            entry = (FileMap(fd, st.st_size), st.st_ino)
        except (OSError, ValueError):
            return None
        finally:
            os.close(fd)  # the map holds the file
        with self._lock:
            self._maps[segment] = entry  # an older, shorter map lives on in its views
            self._maps.move_to_end(segment)
            while len(self._maps) > MAX_MAPS:
                self._maps.popitem(last=False)  # unmapped once no view of it is left
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
            self._maps = OrderedDict()
