"""What became of one value a file medium's put wrote: stored, or refused, one value's miss
(never the batch's error), counted and said in the log at most once a minute per kind:

- ``NOT_A_FILE``: something that is no regular file holds the key's name (a directory an
  operator or another program made there): renaming the value over it fails with EISDIR, which
  used to fail the whole batch;
- ``FULL``: the file system is full (ENOSPC, EDQUOT), which used to fail the whole batch even
  below the tier's capacity. The medium makes room and writes such values once more
  (:mod:`storage_backends.file_dir`); a value the full disk refuses again is a miss.

A refused value is never half visible: it is written under a temporary name, removed again."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

from storage_backends.log_throttle import LogThrottle

log = logging.getLogger(__name__)

STORED, NOT_A_FILE, FULL = "stored", "not a file", "full"
_REFUSALS = {errno.EISDIR: NOT_A_FILE, errno.ENOSPC: FULL, errno.EDQUOT: FULL}

_not_files = LogThrottle(log)
_full = LogThrottle(log)


def refusal_of(exc: OSError, path: Path | None = None) -> str | None:
    """The refusal of one value that ``exc`` (raised writing it under ``path``) stands for,
    said in the log; None: a failure of the medium (the call's error)."""
    refusal = _REFUSALS.get(exc.errno)
    if refusal == NOT_A_FILE:
        _not_files.warning("file store: %s is no regular file (a directory?): a value of its key is "
                           "refused (a miss) until it is removed", exc.filename2 or path)
    return refusal


def never_fits(root: Path, nbytes: int) -> bool:
    """Whether a value of ``nbytes`` is larger than the whole file system holding ``root``
    (evicting for it would empty the store for nothing)."""
    try:
        st = os.statvfs(root)
    except OSError:
        return False
    return nbytes > st.f_blocks * st.f_frsize


def say_full(root: Path, refused: int, evicted: int, bounded: bool) -> None:
    """``refused`` values the full file system took no room for, after ``evicted`` values went
    to make room (none when the store is not ``bounded``: it evicts nothing)."""
    why = (f"{evicted} values evicted first" if evicted else "nothing left to evict") if bounded \
        else "no capacity set: nothing is evicted"
    _full.warning("file store at %s: the file system is full: %d values refused (%s)", root, refused, why)
