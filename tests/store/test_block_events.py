"""Block events straight from the store: what each tier accepted and dropped, bounded when
nobody drains them."""

from __future__ import annotations

from tests.store.helpers import keys_for, make_store, payloads
from tiered_kv.store.block_events import BlockEvents


def replay(events, tier: str) -> set[bytes]:
    out: set[bytes] = set()
    for e in events:
        if e.tier == tier:  # (a "lost" event: what was known of the tier is forgotten)
            out = set() if e.kind == "lost" else out | set(e.keys) if e.kind == "stored" else out - set(e.keys)
    return out


def test_the_disk_tier_announces_what_its_capacity_evicts(tmp_path):
    with make_store(tmp_path, host="1MiB", disk="96KiB") as store:
        feed = store.events.subscribe()
        keys = keys_for(24)
        store.save(keys, payloads(store, 24))
        store.flush()
        events = feed.take()
        disk = store.tier("disk").backend
        on_disk = {k[len(store.tier("disk").ns):] for k in disk.scan()}
        assert disk.stats().evictions > 0
        assert any(e.kind == "removed" and e.tier == "disk" for e in events)
        assert replay(events, "disk") == on_disk  # a replaying router agrees with the medium
        assert replay(events, "host") == set(store.host.scan()) == set(keys)


def test_a_full_feed_keeps_the_newest_events_and_counts_the_rest(tmp_path):
    with make_store(tmp_path) as store:
        feed = store.events.subscribe(limit=5)
        store.save(keys_for(4), payloads(store, 4))
        store.save(keys_for(4, first_token=10_000), payloads(store, 4))
        store.flush()
        kept = feed.take()
        assert sum(len(e.keys) for e in kept) <= 5
        assert feed.dropped > 0 and feed.pending == 0


def test_nobody_subscribed_means_nothing_is_kept(tmp_path):
    with make_store(tmp_path) as store:
        feed = store.events.subscribe()
        store.events.unsubscribe(feed)
        assert not store.events.active
        store.save(keys_for(3), payloads(store, 3))
        store.flush()
        assert feed.take() == [] and feed.dropped == 0


def test_a_failing_subscriber_never_reaches_the_medium():
    events = BlockEvents()
    feed = events.subscribe()
    feed.put = None  # a broken feed: publishing logs, the caller goes on
    events.listener("host")("stored", [b"k" * 16])
    events.listener("disk", b"ns")("stored", [b"nsk", b"other"])


def three_stored_on_disk(limit: int):
    """A feed of ``limit`` blocks that heard three blocks stored on disk: (feed, the disk
    tier's listener, the three keys)."""
    events = BlockEvents()
    feed = events.subscribe(limit=limit)
    hear = events.listener("disk")
    stored = [bytes([i]) * 16 for i in range(3)]
    hear("stored", stored)
    return feed, hear, stored

def test_a_removal_larger_than_the_feed_does_not_leave_its_blocks_announced_stored():
    feed, hear, stored = three_stored_on_disk(limit=4)
    hear("removed", [*stored, b"x" * 16, b"y" * 16])  # one medium call, more blocks than the feed holds
    kept = feed.take()
    assert replay(kept, "disk") == set()  # the older "stored" no longer outlives the removal
    assert sum(len(e.keys) for e in kept) == 4 and feed.dropped == 4  # (3 stored, 1 removed)


def test_a_router_that_took_stored_events_before_a_removal_was_dropped_is_told_to_forget_the_tier():
    feed, hear, stored = three_stored_on_disk(limit=4)
    router = replay(feed.take(), "disk")  # the router knows the three blocks are on disk
    hear("removed", stored)
    hear("stored", [b"x" * 16, b"y" * 16])  # the removal is dropped: the feed is full
    hear("stored", [b"z" * 16])
    kept = feed.take()
    assert [(e.kind, e.tier) for e in kept][0] == ("lost", "disk")
    for e in kept:  # the router applies them to what it knew
        router = set() if e.kind == "lost" else router | set(e.keys) if e.kind == "stored" else router - set(e.keys)
    assert not router & set(stored), "blocks the tier removed are still announced stored"
    assert feed.take() == [], "a lost event is given once"
