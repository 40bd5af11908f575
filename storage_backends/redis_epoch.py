"""Noticing that a Redis tier's content was lost (a restart without persistence, ``FLUSHALL``,
``FLUSHDB``), so that the tier's listener hears ``"lost"`` (no keys): every block this process
announced there may be gone (:mod:`tiered_kv.store.block_events` publishes a ``lost`` event of
the tier; vLLM's tracker retracts the tier's blocks and announces them again as they are stored).

How: a marker key, ``tkv-epoch:`` + the tier's prefix (outside the prefix: no SCAN of the tier,
no entry count sees it), holding a random token written ``SET NX`` (no TTL). A background thread
of the backend, started when a listener is set, looks every ``CHECK_EVERY_S`` seconds (one
pipeline of ``SET NX`` + ``GET``, one round trip; never on a caller's thread, nothing added to
the hot path): a token other than the one it saw last (absent and set anew, or set anew by
another process sharing the server, which saw the loss first) means the keyspace was emptied
since. The first look only records. A look that fails (the server away, the breaker open) is
skipped: the look after the server is back sees the marker gone. A dropped connection that
reconnects to the same server keeps the marker: no ``lost``. Between looks the thread waits on an
event that the backend's ``close()`` (:meth:`EpochWatch.close`) or the backend's collection sets:
it sleeps the whole interval and ends at once (it holds the backend strongly only during a look).

A Redis ACL must let the tier's user read and write the marker: one limited to the prefix
(``~tkv:*``) is refused it (``NOPERM``), and losses would go unseen. The watch then says so once
at WARNING, naming the key pattern to allow (:func:`marker_pattern`: ``~tkv-epoch:tkv:``, in a
cluster ``~tkv-epoch:{*}tkv:``), or the command when the ACL refuses ``SET`` or ``GET`` itself,
and looks only every ``DENIED_EVERY_S`` seconds (an ACL allowing it later is noticed then);
nothing else of the tier is affected. A replica (``READONLY``) or a Redis that cannot persist
(``MISCONF``) refuses the marker's ``SET NX`` too: said once at WARNING (the watch is off until it
is writable), looked at as usual (:mod:`storage_backends.redis_epoch_refusals`).

Why a marker rather than the server's ``run_id`` (``INFO server``): a restart *with* persistence
(RDB, AOF) changes ``run_id`` but keeps the blocks (a ``lost`` then made routers forget blocks
still there), and a flush keeps ``run_id``; the marker tells both apart with one mechanism.
``GET`` keeps the marker recently used, so ``allkeys-lru`` / ``allkeys-lfu`` eviction does not
take it before colder blocks; ``volatile-*`` policies never take a key without a TTL.

Redis Cluster: one marker per master, its name hash-tagged into a slot that master serves (read
again from the client's slot map at each look), so a master restarted empty or a ``FLUSHALL`` on
one node is seen; a slot that moves takes its marker along (no ``lost``). A failover to a
replica keeps the data and the marker: no ``lost``.

Not seen: a partial loss (an RDB restart loses the writes since the last save, the marker
survives; ``DEL`` / ``UNLINK`` of our keys by another client), an ``allkeys-random`` eviction of
the marker (a needless ``lost``), and losses shorter than one look apart are one ``lost``. Blocks
stored between the loss and the look are announced, then retracted by the ``lost`` (a router
misses them until they are stored again; it is never told of blocks that are not there).
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from typing import Any

from storage_backends.redis_deadline import call_deadline
from storage_backends.redis_epoch_refusals import MarkerRefusals
from storage_backends.redis_names import glob_escape
from storage_backends.redis_pool import close_client

log = logging.getLogger(__name__)

CHECK_EVERY_S = 5.0  # seconds between looks at the marker(s)
DENIED_EVERY_S = 300.0  # seconds between looks while the server's ACL refuses the marker (NOPERM)
MARKER = b"tkv-epoch:"  # + the tier's prefix
TAG_TRIES = 1 << 16  # hash tags tried to find one in each master's slots


class EpochWatch:
    """The watching thread of one Redis backend (see the module docstring), made by the backend
    when a listener is set; it holds the backend weakly and ends once it is closed or dropped."""

    def __init__(self, backend: Any) -> None:
        self.looks = 0  # looks done (tests wait on it instead of on time)
        self.refusals = MarkerRefusals(log)  # the marker refused: said once (READONLY, MISCONF, NOPERM)
        self._stop = threading.Event()  # set by close() or the backend's collection: the thread ends
        self._end = weakref.finalize(backend, self._stop.set)  # (holds the event, not the backend)
        self.thread = threading.Thread(target=_watch, args=(weakref.ref(backend), self), daemon=True,
                                       name="tiered-kv-redis-epoch")
        self.thread.start()

    def close(self) -> None:
        """End the thread now (a look under way ends first, within the backend's timeout). Idempotent."""
        self._end()

    @property
    def denied(self) -> bool:
        """Whether the ACL refuses the marker: looks are DENIED_EVERY_S apart."""
        return self.refusals.denied

    def wait(self) -> bool:
        """Sleep until the next look is due; True when the thread is to end instead."""
        return self._stop.wait(DENIED_EVERY_S if self.denied else CHECK_EVERY_S)


def _watch(ref: weakref.ref, watch: EpochWatch) -> None:
    seen: dict[bytes, bytes] = {}  # marker name -> its token at the last look
    while True:
        backend = ref()
        if backend is None or backend._closed:
            return
        try:
            lost = look(backend, seen)
        except Exception as exc:  # away, closed meanwhile, or the marker refused (said once)
            lost = False
            pattern = marker_pattern(backend.prefix, backend.cluster)
            if not watch.refusals.refused(exc, backend.url, pattern, DENIED_EVERY_S):
                log.debug("redis at %s: epoch marker not read: %s", backend.url, exc)
        else:
            if lost is not None:  # (None: skipped, the tier down: no answer either way)
                watch.refusals.answered(backend.url)
        watch.looks += 1
        if lost and backend.listener is not None:
            log.warning("redis at %s lost its content (restarted or flushed): blocks announced "
                        "there are retracted", backend.url)
            try:
                backend.listener("lost", [])
            except Exception:
                log.exception("%s: block listener failed", backend.name)
        del backend  # (the wait holds no reference: a dropped backend is collected, which ends it)
        if watch.wait():
            return


def marker_pattern(prefix: bytes, cluster: bool) -> str:
    """The ACL key pattern (``~...``) that allows the marker(s) of a tier under ``prefix``."""
    tag = b"{*}" if cluster else b""
    return "~" + (MARKER + tag + glob_escape(prefix)).decode("latin-1")


def look(backend: Any, seen: dict[bytes, bytes]) -> bool | None:
    """Read (and set where absent) the marker(s); True when one holds another token than ``seen``,
    None when no look was made (the tier is down)."""
    if not backend.available:  # the breaker's probe watches a server that is away
        return None
    token = os.urandom(8).hex().encode()
    base = MARKER + backend.prefix
    try:
        with call_deadline(backend.timeout):
            client = backend.client
            if backend.cluster:
                now = {}
                for name in _cluster_markers(client, base):
                    client.set(name, token, nx=True)
                    now[name] = client.get(name)
            else:
                pipe = client.pipeline(transaction=False)
                pipe.set(base, token, nx=True)
                pipe.get(base)
                now = {base: pipe.execute()[1]}
    finally:
        if backend._closed:  # close() ran meanwhile: the connection put back goes too
            close_client(backend._client)
    lost = any(name in seen and value != seen[name] for name, value in now.items())
    seen.update(now)
    return lost


def _cluster_markers(client: Any, base: bytes) -> list[bytes]:
    """One marker name per master, hash-tagged into a slot the client's slot map gives it."""
    from redis.crc import key_slot

    slots = client.nodes_manager.slots_cache
    masters = {nodes[0].name for nodes in slots.values() if nodes}
    names: dict[str, bytes] = {}
    for i in range(TAG_TRIES):
        name = b"%s{%d}%s" % (MARKER, i, base[len(MARKER):])  # (our tag first)
        nodes = slots.get(key_slot(name))
        if nodes and nodes[0].name not in names:
            names[nodes[0].name] = name
            if len(names) == len(masters):
                break
    return list(names.values())
