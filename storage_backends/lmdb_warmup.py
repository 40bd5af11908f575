"""Reading the LMDB tier's index into the page cache after it opens.

After a restart the page cache is often cold, and the first lookups of a long prompt read the
``meta`` table's pages from disk one B-tree descent at a time: 2048 keys took ~60 ms here, over
the scheduler's lookup deadline. A daemon thread walks the ``meta`` table once when the tier
opens (its records are small and dense: ~50 bytes a block, so a million blocks are ~50 MB read
sequentially), a batch of keys per read transaction so that a remap or ``close`` never waits for
it long. It reads no block values, changes nothing, and stops when the tier closes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

KEYS_PER_TXN = 8192  # meta records read per transaction


class IndexWarmup:
    """The walk of one ``meta`` table on a daemon thread (``txn_factory()``: a read-transaction
    context, as the environment hands them out). ``seen``: records read so far."""

    def __init__(self, txn_factory: Callable, meta_db, closed: Callable[[], bool], name: str) -> None:
        self._txn, self._db, self._closed, self.name = txn_factory, meta_db, closed, name
        self.seen = 0
        self.thread = threading.Thread(target=self._walk, name="tiered-kv-lmdb-warmup", daemon=True)
        self.thread.start()

    def _walk(self) -> None:
        start, last = time.perf_counter(), None
        try:
            while not self._closed():
                last = self._batch(last)
                if last is None:
                    break
        except Exception as exc:  # a warm-up only: lookups read the pages themselves otherwise
            log.debug("%s: index warm-up stopped: %r", self.name, exc)
            return
        log.debug("%s: index of %d blocks read in %.0f ms", self.name, self.seen,
                  (time.perf_counter() - start) * 1000)

    def _batch(self, after: bytes | None) -> bytes | None:
        """Read up to KEYS_PER_TXN records after ``after`` in one transaction; the last key read
        when more may follow, else None."""
        with self._txn() as txn:
            cursor = txn.cursor(db=self._db)
            if not (cursor.set_range(after) if after is not None else cursor.first()):
                return None
            if after is not None and bytes(cursor.key()) == after and not cursor.next():
                return None
            batch = 0
            for key in cursor.iternext(keys=True, values=False):
                batch += 1
                self.seen += 1
                if batch >= KEYS_PER_TXN:
                    return bytes(key)
        return None


def warm_index(txn_factory: Callable, meta_db, closed: Callable[[], bool], name: str) -> IndexWarmup:
    """Start reading ``meta_db`` into the page cache in the background."""
    return IndexWarmup(txn_factory, meta_db, closed, name)
