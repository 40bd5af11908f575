"""Block events: which tier of a store now holds, or no longer holds, which blocks.

Every medium tells its listener (:meth:`storage_backends.base.Backend.listen`) the keys this
process's calls stored and removed; the store hands those of its own namespace, per tier, to
the feeds subscribed to :attr:`TieredStore.events <tiered_kv.store.tiered_store.TieredStore>`
as :class:`BlockEvent` batches. A router, or an engine's own KV-event publisher, drains a feed::

    feed = store.events.subscribe()        # or connector.subscribe_block_events()
    for event in feed.take():              # oldest first, since the last take
        event.kind, event.tier, event.keys  # "stored" / "removed" / "lost", "host" / "disk" / ..., keys

- **stored**: a tier accepted blocks (a host commit: saves and blocks promoted by loads; a lower
  tier's put: write-behind, ``on_evict`` copies, copies between tiers).
- **removed**: a tier dropped blocks (evicted to make room, withdrawn after a failed load,
  deleted as unusable or by a tool in this process).
- Keys are the store's content keys (16-byte chained hashes, :mod:`tiered_kv.keys`).
- Not seen: what other processes do to a shared tier (they publish their own), and what a medium
  drops by its own policy (Redis ``maxmemory`` evictions and TTL expiry). A Redis delete names
  the keys of every call that ran (or was sent and failed: it may have run).
- **Other ranks' copies**: tensor-parallel ranks sharing a tier (one LMDB directory) evict each
  other's copies, which the rank whose copy went never hears of. A listener given every rank's
  prefix (``ranks``) reports those removals too, as events of that ``rank``: the block is no
  longer loadable by the replica (every rank's copy is needed). Their stores are left to the
  rank that made them.
- **Bounded**: a feed holds at most ``limit`` blocks; when more arrive the oldest events go and
  their blocks are counted in ``feed.dropped`` (an event of more than ``limit`` blocks keeps
  its last ``limit``). Nothing grows when nobody drains. The next :meth:`EventFeed.take` then
  starts with a **lost** event (no keys) for each tier that lost events: what its consumer
  knows of that tier may be wrong (a dropped removal would leave blocks announced stored for
  ever), so it forgets the tier, then applies the events after the marker.
- **A medium that lost everything** (a Redis server restarted empty or flushed:
  :mod:`storage_backends.redis_epoch`) tells its listener ``"lost"``: feeds get a **lost** event
  (no keys) of the tier in its place among the tier's events: forget the tier, then apply the
  events after it (blocks stored again are announced again).
- **Cheap and quiet**: with no subscriber a medium's report costs one check; publishing never
  raises into the media's callers (the engine's hot path): a failure is logged.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tiered_kv.errors import ConfigError

log = logging.getLogger(__name__)

STORED, REMOVED, LOST = "stored", "removed", "lost"
DEFAULT_LIMIT = 1 << 16  # blocks a feed holds undrained (a few MiB of keys at most)


@dataclass(frozen=True)
class BlockEvent:
    """``keys`` were stored in (or removed from) tier ``tier`` at ``ts`` (``time.time()``)."""

    kind: str  # STORED, REMOVED, or LOST (events of the tier were dropped: forget what you knew)
    tier: str  # "host" or a lower tier's name
    keys: tuple[bytes, ...]  # content keys, in the order the medium handled them (LOST: none)
    ts: float
    rank: int | None = None  # another tensor-parallel rank whose copies these were (None: this store's)


class EventFeed:
    """One subscriber's bounded queue of block events."""

    def __init__(self, limit: int = DEFAULT_LIMIT) -> None:
        if limit < 1:
            raise ConfigError(f"a block event feed must hold at least one block, got limit={limit}")
        self.limit = limit
        self.dropped = 0  # blocks of events dropped because the feed was full
        self._events: deque[BlockEvent] = deque()
        self._held = 0  # blocks in _events
        self._lost: dict[str, float] = {}  # tier -> when its first event was dropped since the last take
        self._lock = threading.Lock()

    def put(self, event: BlockEvent) -> None:
        cut = len(event.keys) - self.limit
        if cut > 0:  # its newest blocks only, the events held before it all go (dropping it whole
            # kept an older "stored" of the blocks it removed: a replaying router kept them)
            event = BlockEvent(event.kind, event.tier, event.keys[cut:], event.ts, event.rank)
        n = len(event.keys)
        with self._lock:
            if n == 0 and self._events and self._events[-1].kind == LOST and self._events[-1].tier == event.tier:
                return  # (a tier lost twice in a row is lost once: keyless events stay bounded)
            if cut > 0:
                self.dropped += cut
                self._lost.setdefault(event.tier, event.ts)
            while self._held + n > self.limit:
                old = self._events.popleft()
                self._held -= len(old.keys)
                self.dropped += len(old.keys)
                self._lost.setdefault(old.tier, old.ts)
            self._events.append(event)
            self._held += n

    def take(self) -> list[BlockEvent]:
        """The events since the last take, oldest first, after a LOST event for each tier that
        lost some since (the module docstring)."""
        with self._lock:
            out = [BlockEvent(LOST, tier, (), ts) for tier, ts in self._lost.items()]
            out += self._events
            self._events.clear()
            self._lost.clear()
            self._held = 0
        return out

    @property
    def pending(self) -> int:
        """Blocks waiting to be taken."""
        return self._held


class BlockEvents:
    """The feeds of one store, and the listeners its media report to."""

    def __init__(self) -> None:
        self._feeds: tuple[EventFeed, ...] = ()  # replaced, never mutated: read without a lock
        self._lock = threading.Lock()

    @property
    def active(self) -> bool:
        return bool(self._feeds)

    def subscribe(self, limit: int = DEFAULT_LIMIT) -> EventFeed:
        """A new feed of every block event from now on (see the module docstring)."""
        feed = EventFeed(limit)
        with self._lock:
            self._feeds = (*self._feeds, feed)
        return feed

    def unsubscribe(self, feed: EventFeed) -> None:
        with self._lock:
            self._feeds = tuple(f for f in self._feeds if f is not feed)

    def publish(self, kind: str, tier: str, keys: Sequence[bytes], rank: int | None = None) -> None:
        feeds = self._feeds
        if not feeds or not keys and kind != LOST:  # (a lost tier has no keys: the medium lost them all)
            return
        try:
            event = BlockEvent(kind, tier, tuple(bytes(k) for k in keys), time.time(), rank)
            for feed in feeds:
                feed.put(event)
        except Exception:  # never into the medium's caller
            log.exception("block events of tier %s could not be published", tier)

    def listener(self, tier: str, prefix: bytes = b"", ranks: Sequence[bytes] = ()) -> Callable[[str, list[bytes]], None]:
        """What tier ``tier``'s medium reports to: keys under ``prefix`` (the namespace's, in a
        lower tier shared by namespaces) become events of the keys without it. ``ranks``: every
        tensor-parallel rank's prefix, by rank (``prefix`` among them): removals of the other
        ranks' copies become events of their rank (the module docstring)."""
        others = {bytes(p): r for r, p in enumerate(ranks) if p != prefix}

        def heard(change: str, keys: list[bytes]) -> None:
            if not self._feeds:
                return
            if change == LOST:  # the medium lost everything: every rank's copies, this namespace's
                self.publish(LOST, tier, ())
                return
            theirs: dict[int, list[bytes]] = {}
            if others and change == REMOVED:  # (all prefixes are digests of one length)
                for k in keys:
                    if (r := others.get(bytes(k[: len(prefix)]))) is not None:
                        theirs.setdefault(r, []).append(k[len(prefix):])
            if prefix:
                keys = [k[len(prefix):] for k in keys if k[: len(prefix)] == prefix]
            self.publish(change, tier, keys)
            for r, gone in theirs.items():
                self.publish(change, tier, gone, r)

        return heard
