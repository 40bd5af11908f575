"""The page cache, for the cold-read figures of both benchmarks: how much of a file is resident
(mincore over a fresh mapping), and dropping files from it (fsync + ``posix_fadvise(DONTNEED)``,
plus ``/proc/sys/vm/drop_caches`` when this process may write it), with the residency after
the drop reported so a "cold" figure can be checked to be cold."""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
from collections.abc import Sequence
from pathlib import Path

_PAGE = mmap.PAGESIZE
_LOW_BIT = bytes(i & 1 for i in range(256))  # mincore: bit 0 of each byte = resident


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                          ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    return libc


def resident_pages(path: str | Path) -> tuple[int | None, int]:
    """(pages of ``path`` in the page cache or None when mmap / mincore failed, file size)."""
    size = os.path.getsize(path)
    if size == 0:
        return 0, 0
    libc = _libc()
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            return None, size
        try:
            vec = (ctypes.c_ubyte * ((size + _PAGE - 1) // _PAGE))()
            if libc.mincore(addr, size, vec) != 0:
                return None, size
            return bytes(vec).translate(_LOW_BIT).count(1), size
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)


def resident_bytes(path: str) -> tuple[int, int]:
    """(bytes of ``path`` in the page cache, -1 when unknown; file size)."""
    pages, size = resident_pages(path)
    if pages is None:
        return -1, size
    return min(size, pages * _PAGE), size


def files_under(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path]
    return [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]


def resident_fraction(paths: Sequence[str]) -> float | None:
    got = total = 0
    for p in paths:
        r, s = resident_bytes(p)
        if r < 0:
            return None
        got += r
        total += s
    return round(got / total, 4) if total else None


def fadvise_out(path: str | Path) -> None:
    """fsync ``path`` and drop its pages with ``posix_fadvise(POSIX_FADV_DONTNEED)``."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


class Evictor:
    """Drops files from the page cache: fsync + posix_fadvise(DONTNEED), plus drop_caches when
    this process may write /proc/sys/vm/drop_caches (tried once, reported)."""

    def __init__(self) -> None:
        self.drop_caches: str = "untried"

    def probe(self) -> None:
        try:
            os.sync()
            with open("/proc/sys/vm/drop_caches", "w") as fh:
                fh.write("1")
            self.drop_caches = "ok"
        except OSError as exc:
            self.drop_caches = f"not permitted ({type(exc).__name__}: {exc.strerror or exc})"

    @property
    def method(self) -> str:
        m = "fsync + posix_fadvise(POSIX_FADV_DONTNEED) per file"
        return m + (" + echo 1 > /proc/sys/vm/drop_caches" if self.drop_caches == "ok" else "")

    def evict(self, paths: Sequence[str]) -> None:
        for p in paths:
            fadvise_out(p)
        if self.drop_caches == "ok":
            try:
                with open("/proc/sys/vm/drop_caches", "w") as fh:
                    fh.write("1")
            except OSError:
                pass


COLD_MAX_FRACTION = 0.01  # of a file set's bytes still resident after a drop: above, not cold


def not_cold(fraction: float | None) -> str | None:
    """Why a figure taken after an eviction is not a cold figure (None: it is): the residency
    was unknown, or more than ``COLD_MAX_FRACTION`` of the bytes stayed in the page cache."""
    if fraction is None:
        return "residency after the eviction unknown (mincore failed): not checked cold"
    if fraction > COLD_MAX_FRACTION:
        return f"not cold: {fraction:.1%} of the files still in the page cache after the eviction"
    return None


def _store_resident(files: list[Path]) -> int | None:
    """Page-cache bytes of ``files``, None if unknown."""
    total = 0
    for path in files:
        try:
            pages = resident_pages(path)[0]
        except (OSError, AttributeError):
            return None
        if pages is None:
            return None
        total += pages * _PAGE
    return total


def _store_files(store_dir: str) -> list[Path]:
    from storage_backends.lmdb_disk import LmdbBackend

    return LmdbBackend.store_files(Path(store_dir))


def store_resident_mib(store_dir: str) -> float | None:
    """MiB of the LMDB store's files (environment and segment files) in the page cache now."""
    got = _store_resident(_store_files(store_dir))
    return None if got is None else round(got / 2**20, 1)


def drop_page_cache(store_dir: str, *, require_cold: bool = False) -> dict:
    """fsync + POSIX_FADV_DONTNEED on every file of the LMDB store (its medium names them: the
    environment and its segment files); residency before and after, and ``cold`` (False, with
    ``not_cold`` saying why, when more than ``COLD_MAX_FRACTION`` stayed or it is unknown).
    ``require_cold``: raise RuntimeError instead of returning a drop that left the store warm."""
    files = _store_files(store_dir)
    before = _store_resident(files)
    for path in files:
        fadvise_out(path)
    after = _store_resident(files)
    size = sum(p.stat().st_size for p in files)
    allocated = sum(p.stat().st_blocks * 512 for p in files)
    why = not_cold(None if after is None else (after / size if size else 0.0))
    out = {"store_allocated_mib": round(allocated / 2**20, 1), "files": len(files),
           "resident_mib_before": None if before is None else round(before / 2**20, 1),
           "resident_mib_after": None if after is None else round(after / 2**20, 1),
           "cold": why is None}
    if why is not None:
        out["not_cold"] = why
        if require_cold:
            raise RuntimeError(f"page cache drop of {store_dir}: {why}")
    return out
