"""What became of one value a file medium's put wrote: stored, or refused, one value's miss
(never the batch's error), counted and said in the log at most once a minute per kind:

- ``NOT_A_FILE``: something that is no regular file holds the key's name (a directory an
  operator or another program made there): renaming the value over it fails with EISDIR, which
  used to fail the whole batch; or a file that is no directory holds its bucket's name
  (ENOTDIR), which failed every batch holding a key of that bucket (1/256 of all keys);
- ``FULL``: the file system is full (ENOSPC), which used to fail the whole batch even below the
  tier's capacity. The medium makes room and writes such values once more
  (:mod:`storage_backends.file_dir`); a value the full disk refuses again is a miss;
- ``OVER_QUOTA``: this user's (group's, project's) disk quota is spent (EDQUOT): as for a full
  disk, but only this user's values are evicted for it (in a directory several users share,
  removing another user's values would free none of this one's quota).

A refused value is never half visible: it is written under a temporary name, removed again."""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

from storage_backends.log_throttle import LogThrottle

log = logging.getLogger(__name__)

STORED, NOT_A_FILE, FULL, OVER_QUOTA = "stored", "not a file", "full", "over quota"
_REFUSALS = {errno.EISDIR: NOT_A_FILE, errno.ENOTDIR: NOT_A_FILE, errno.ENOSPC: FULL, errno.EDQUOT: OVER_QUOTA}

_not_files = LogThrottle(log)
_full = LogThrottle(log)
_over_quota = LogThrottle(log)


def refusal_of(exc: OSError, path: Path | None = None) -> str | None:
    """The refusal of one value that ``exc`` (raised writing it under ``path``) stands for,
    said in the log; None: a failure of the medium (the call's error)."""
    refusal = _REFUSALS.get(exc.errno)
    if refusal == NOT_A_FILE and exc.errno == errno.ENOTDIR:
        _not_files.warning("file store: %s is no directory: values of the keys it holds are refused "
                           "(misses) until it is removed", exc.filename if path is None else path.parent)
    elif refusal == NOT_A_FILE:
        _not_files.warning("file store: %s is no regular file (a directory?): a value of its key is "
                           "refused (a miss) until it is removed", exc.filename2 or path)
    return refusal


class Room(NamedTuple):
    """What a full file system must free for values it refused (:func:`room_for`)."""

    fits: list[bool]  # per value: whether it could fit at all (none larger than the whole disk)
    nbytes: int  # of the values that could fit
    files: int  # files that must go too: as many as those values where inodes are short, else 0


def room_for(root: Path, sizes: Sequence[int]) -> Room:
    """The room values of ``sizes`` that the file system holding ``root`` refused need: a value
    larger than the whole file system needs none (evicting for it would empty the store for
    nothing, and it kept the room from being made for its batch's others); files only where the
    file system is short of inodes (a count of files on top of the bytes evicted large values
    for small ones). Each value may take three inodes (a tenant's file, its link, the link's
    temporary name). Where the file system cannot be asked, both bytes and files."""
    try:
        st = os.statvfs(root)
    except OSError:
        return Room([True] * len(sizes), sum(max(n, 1) for n in sizes), len(sizes))
    fits = [n <= st.f_blocks * st.f_frsize for n in sizes]
    count = sum(fits)
    short = st.f_files > 0 and st.f_favail < 3 * count
    return Room(fits, sum(max(n, 1) for n, f in zip(sizes, fits) if f), count if short else 0)


def say_full(root: Path, refused: int, evicted: int, bounded: bool, kind: str = FULL) -> None:
    """``refused`` values the full file system (``kind`` FULL) or the spent quota (OVER_QUOTA)
    took no room for, after ``evicted`` values went to make room (none when the store is not
    ``bounded``: it evicts nothing)."""
    why = (f"{evicted} values evicted first" if evicted else "nothing left to evict") if bounded \
        else "no capacity set: nothing is evicted"
    what = "the file system is full" if kind == FULL else "this user's disk quota is spent"
    (_full if kind == FULL else _over_quota).warning("file store at %s: %s: %d values refused (%s)",
                                                     root, what, refused, why)
