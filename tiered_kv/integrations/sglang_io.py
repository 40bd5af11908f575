"""SGLang pages in and out of a :class:`~tiered_kv.store.TieredStore`, each call bounded in time.

- **Which pages are stored**: this rank's copy only (SGLang takes the smallest answer of its ranks
  itself): the host staging tier, then each lower tier within the store's ``lookup_timeout``.
- **Reads** load the leading stored run and stop at the first page missing or failing its checks.
- **Backups** copy the pages into the host staging tier, wait ``write_timeout`` for their
  write-behind and report a page stored only once a lower tier holds it when some lower tier is
  written through (the staging copy is evicted a few batches later: counting it reported pages
  stored that no tier kept). With no such tier (none, or only ``on_evict`` / ``off`` ones) the
  staging copy is what there is.

SGLang joins each of its storage threads for 10 s when it flushes its cache (``/flush_cache``,
after every weight update) or detaches the backend, and fails the flush if one is still running.
A backup call waits at most ``write_timeout`` plus one lookup deadline per lower tier, so
:func:`write_timeout_of` refuses settings that could reach :data:`BACKUP_BUDGET_S`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from tiered_kv.errors import ConfigError
from tiered_kv.keys import leading_present
from tiered_kv.units import parse_duration

log = logging.getLogger(__name__)

SGLANG_JOIN_S = 10.0  # cache_controller._stop_storage_threads: t.join(timeout=10), then RuntimeError
BACKUP_BUDGET_S = 8.0  # the most a backup may wait in all (2 s of the join left for the host copy)
DEFAULT_WRITE_TIMEOUT = 5.0
STAGING_BYTES = 64 << 20  # reads into non-contiguous host pages are staged this much at a time


def write_timeout_of(value: Any, config: Any) -> float:
    """The extra config's ``write_timeout`` (default :data:`DEFAULT_WRITE_TIMEOUT`) for the
    tiered-kv settings ``config``; ConfigError when a backup waiting that long plus a lookup
    deadline per lower tier could outlive SGLang's join of its storage threads."""
    timeout = DEFAULT_WRITE_TIMEOUT if value is None else parse_duration(value, name="write_timeout")
    lookups = config.lookup_timeout * len(config.lower_tiers)
    if not timeout > 0 or timeout + lookups > BACKUP_BUDGET_S:
        raise ConfigError(
            f"SGLang extra config: write_timeout {timeout:g} s (+ lookup_timeout {config.lookup_timeout:g} s "
            f"x {len(config.lower_tiers)} tiers) must be above 0 and at most {BACKUP_BUDGET_S:g} s in all: "
            f"SGLang waits {SGLANG_JOIN_S:g} s for a backup when it flushes its cache, then fails the flush")
    return timeout


def stored_run(store, keys: Sequence[bytes]) -> int:
    """The leading run of ``keys`` some tier holds this rank's copy of."""
    return leading_present([w is not None for w in store.locate(keys)])


def read_pages(store, keys: Sequence[bytes], pages: Sequence[Any], staging: Staging) -> list[bool]:
    """Load the leading stored run of ``keys`` into ``pages`` (tensors of one page each, any shape
    or strides); False from the first page that is missing or fails its checks."""
    found = stored_run(store, keys)
    ok = [False] * len(keys)
    shape = store.shape
    direct = [p.is_contiguous() and p.device.type == "cpu" for p in pages[:found]]
    done = 0
    while done < found:  # runs of pages of one kind: contiguous host pages, or others
        kind = direct[done]
        limit = found if kind else min(found, done + max(1, STAGING_BYTES // store.block_nbytes))
        end = done + 1
        while end < limit and direct[end] == kind:
            end += 1
        if kind:  # decoded straight into the page (contiguous host memory)
            got = store.load_into(keys[done:end], [p.view(shape) for p in pages[done:end]])
        else:  # staged, then copied into the page's parts
            blocks = staging.blocks(store, end - done)
            got = store.load_into(keys[done:end], list(blocks))
            for page, block, good in zip(pages[done:end], blocks, got):
                if not good:
                    break
                page.copy_(block.view(page.shape))
        lead = leading_present(got)
        ok[done : done + lead] = [True] * lead
        if lead < len(got):
            break
        done = end
    return ok


def backup(store, keys: Sequence[bytes], pages: Sequence[Any], timeout: float) -> list[bool]:
    """Store ``pages`` (flat data pages) under ``keys``, wait up to ``timeout`` for their
    write-behind; True where a written-through lower tier holds this rank's copy afterwards (the
    staging copy where no lower tier is written through)."""
    if not keys:
        return []
    deadline = time.monotonic() + timeout  # (staging more pages than the host tier holds waits too)
    future = store.save(keys, [p.reshape(store.shape) for p in pages], wait=timeout)
    if future is not None:
        try:
            future.result(timeout=max(0.0, deadline - time.monotonic()))
        except FutureTimeout:
            log.warning("tiered-kv SGLang storage: %d pages not written within %.1f s; reported "
                        "to SGLang as not stored", len(keys), timeout)
    lower = any(t.policy == "write_through" for t in store.tiers)
    where = store.locate(keys, host=not lower)
    return [w is not None for w in where]


class Staging:
    """Per-thread staging blocks for pages that cannot be decoded into in place (reused across
    calls; SGLang reads from its prefetch and I/O threads at once)."""

    def __init__(self) -> None:
        self._local = threading.local()

    def blocks(self, store, n: int):
        """This thread's staging blocks for ``store``, the first ``n`` of them."""
        import torch

        buf = getattr(self._local, "staging", None)
        if (buf is None or buf.shape[0] < n or tuple(buf.shape[1:]) != tuple(store.shape)
                or buf.dtype != store.dtype):
            buf = torch.empty((max(n, 1), *store.shape), dtype=store.dtype)
            self._local.staging = buf
        return buf[:n]
