"""How values reach segment files. Buffered (the default): ``pwrite`` into the page cache, so a
restore soon after reads memory, and the disk is written behind (``writeback``: see
:mod:`storage_backends.segment_writeback`). Direct (``direct_io``): ``O_DIRECT`` writes from
page-aligned staging buffers, so a value is on the disk when its write returns (an fsync then
only flushes the file's size and the device's cache), at the disk's steady pace, and the page
cache is left to other uses (a restore reads the disk; the host tier is the warm copy). A
direct value starts and ends on an ``ALIGN`` boundary (the pad after it is zeros, counted as
dead bytes), so no page is shared by two values. A file system without ``O_DIRECT`` (tmpfs)
gets buffered writes, said once. Reads are gathered ``preadv`` calls (:func:`read_fully`)."""

from __future__ import annotations

import errno
import logging
import mmap
import os
import threading
from pathlib import Path

import numpy as np

from storage_backends.gathered import Gathered
from storage_backends.segment_fds import Descriptors
from storage_backends.segment_writeback import BackgroundWriteback, start_writeback

log = logging.getLogger(__name__)

ALIGN = 4096  # direct values' offsets and lengths are multiples of this
VALUE_END_ALIGN = 64  # buffered values end on a multiple of this (see SegmentWriter.start)
PROBE_NAME = ".direct-probe"


def aligned(length: int) -> int:
    return -(-length // ALIGN) * ALIGN


def supports_direct(directory: Path) -> bool:
    """Whether files in ``directory`` take ``O_DIRECT`` writes of an aligned buffer."""
    if not hasattr(os, "O_DIRECT"):
        return False
    probe = directory / f"{PROBE_NAME}.{os.getpid()}.{threading.get_ident()}"
    buf = mmap.mmap(-1, ALIGN)
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT | os.O_CLOEXEC, 0o644)
        try:
            return os.pwrite(fd, buf, 0) == ALIGN
        finally:
            os.close(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
            raise
        return False
    finally:
        buf.close()
        try:
            os.unlink(probe)
        except FileNotFoundError:
            pass


class SegmentWriter:
    """Writes values at reserved offsets; ``stride(length)`` is how far a value of ``length``
    bytes moves the end of its segment."""

    def __init__(self, directory: Path, fds: Descriptors, direct: bool = False,
                 writeback: str = "later") -> None:
        self.fds = fds
        self.eager_writeback = writeback == "eager"
        self.direct: Descriptors | None = None
        if direct:
            directory.mkdir(parents=True, exist_ok=True)
            if supports_direct(directory):
                self.direct = Descriptors(fds.path_of, max_idle=4, extra_flags=os.O_DIRECT)
            else:
                log.warning("segment files in %s: the file system refuses O_DIRECT; writes are buffered",
                            directory)
        # (direct values are on the disk when written: nothing to write behind)
        self.background = BackgroundWriteback(fds) if writeback == "background" and self.direct is None else None
        self._staging = threading.local()  # per thread: one page-aligned buffer, grown as needed

    def stride(self, length: int) -> int:
        return aligned(length) if self.direct is not None else length

    @property
    def max_pad(self) -> int:
        """The most bytes :meth:`stride` adds to a value's length (a direct value's pad)."""
        return ALIGN - 1 if self.direct is not None else 0

    def start(self, end: int, length: int) -> int:
        """Where a value of ``length`` bytes goes when its segment ends at ``end``: direct
        values on the next page (``end`` is one); buffered ones so that they end on a multiple
        of ``VALUE_END_ALIGN``, which puts a raw block's payload (its last bytes, a multiple of
        64 long) on a cache line of the file, as it is on a cache line of a host slot or a torch
        tensor: on some CPUs the kernel copies between the page cache and user memory at a
        quarter to three quarters of its pace unless the two sit a multiple of 32 bytes apart
        (this VM: 3.3-11 against 13-15 GB/s, by the offset; tools/probe_vm_memory.py)."""
        return end if self.direct is not None else end + (-(end + length)) % VALUE_END_ALIGN

    def write_many(self, segment: int, items: list[tuple[int, object]]) -> None:
        """Write values (``(offset, value)``, each one buffer or :class:`Gathered` parts, one
        after the other as :meth:`start` places them) to ``segment``: buffered ones with one
        gathered write, the pad between them zeros; direct ones one at a time. OSError when the
        disk refuses it (any of them may then be unwritten)."""
        if self.direct is not None:
            for offset, value in items:
                self._write_direct(segment, offset, _parts(value))
            return
        parts: list[memoryview] = []
        start = end = items[0][0]
        for offset, value in items:
            if not 0 <= offset - end < VALUE_END_ALIGN:
                raise ValueError(f"segment values not one after the other: {offset} after {end}")
            if offset > end:
                parts.append(_ZEROS[: offset - end])
            value_parts = _parts(value)
            parts += value_parts
            end = offset + sum(len(p) for p in value_parts)
        with self.fds.use(segment, write=True) as fd:
            _write_fully(fd, parts, start, segment)
            if self.eager_writeback:
                start_writeback(fd, start, end - start)
        if self.background is not None:
            self.background.wrote(segment, start, end - start)

    def _write_direct(self, segment: int, offset: int, parts: list[memoryview]) -> None:
        """One value through this thread's page-aligned staging buffer, padded with zeros."""
        length = sum(len(p) for p in parts)
        padded = aligned(length)
        buf, array = self._buffer(padded)
        at = 0
        for part in parts:  # (numpy copies without the GIL)
            array[at : at + len(part)] = np.frombuffer(part, np.uint8)
            at += len(part)
        array[length:padded] = 0
        with self.direct.use(segment, write=True) as fd:
            _write_fully(fd, [memoryview(buf)[:padded]], offset, segment)

    def _buffer(self, length: int) -> tuple[mmap.mmap, np.ndarray]:
        staging = getattr(self._staging, "buf", None)
        if staging is None or len(staging[0]) < length:
            buf = mmap.mmap(-1, aligned(length))  # anonymous: page-aligned
            staging = self._staging.buf = (buf, np.frombuffer(buf, np.uint8))
        return staging

    def forget(self, segment: int) -> None:
        if self.background is not None:
            self.background.forget(segment)
        if self.direct is not None:
            self.direct.forget(segment)

    def close(self) -> None:
        if self.background is not None:
            self.background.close()
        if self.direct is not None:
            self.direct.close()


_ZEROS = memoryview(bytes(VALUE_END_ALIGN))  # the pad between buffered values written together


def _parts(value) -> list[memoryview]:
    """A value's byte views: its :class:`Gathered` parts, or the one buffer."""
    return list(value.parts) if isinstance(value, Gathered) else [memoryview(value).cast("B")]


def _write_fully(fd: int, parts: list[memoryview], offset: int, segment: int) -> None:
    """``parts`` one after the other from ``offset``: one gathered write, continued after a
    short one."""
    while parts:
        n = os.pwritev(fd, parts, offset)
        if n <= 0:
            raise OSError(errno.EIO, f"short write to segment {segment:016x}")
        offset += n
        while parts and n >= len(parts[0]):
            n -= len(parts[0])
            parts = parts[1:]
        if parts and n:
            parts = [parts[0][n:], *parts[1:]]


def read_fully(fd: int, views: list[memoryview], offset: int) -> bool:
    """Fill byte views ``views`` in turn from ``offset`` of ``fd`` (gathered reads, going on
    after a short one); False when the file ends first (OSError as the kernel raised it).
    ``views`` is left as it was (a retry of the read starts from its first byte again)."""
    views = list(views)
    length, done = sum(map(len, views)), 0
    while done < length:
        n = os.preadv(fd, views, offset + done)
        if n <= 0:
            return False
        done += n
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]
    return True


def advise(fd: int, offset: int, length: int) -> None:
    """Have the kernel start reading ``length`` bytes at ``offset`` of ``fd`` (advice: a part
    that cannot be read is found by the read that follows)."""
    try:
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)
    except OSError:
        pass
