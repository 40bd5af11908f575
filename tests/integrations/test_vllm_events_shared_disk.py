"""Tensor-parallel ranks sharing one LMDB directory evict each other's copies: the rank whose
copy went never hears of it, so the rank that evicted it reports it (real stores, real LMDB;
the scheduler half's tracker as vLLM drives it)."""

from __future__ import annotations

from dataclasses import replace

from tests.store.helpers import NS, keys_for, make_store, payloads
from tiered_kv.integrations.vllm_events import BlockRemoved, BlockStored, VllmEventTracker, worker_events
from tiered_kv.store.block_events import BlockEvents
from tiered_kv.store.presence import rank_prefixes


def router_view(published: list) -> set:
    """What a router replaying vLLM's events believes the disk tier holds."""
    held: set = set()
    for e in published:
        if isinstance(e, BlockStored) and e.medium == "disk":
            held |= set(e.block_hashes)
        elif isinstance(e, BlockRemoved) and e.medium == "disk":
            held -= set(e.block_hashes)
    return held


def test_regression_a_rank_whose_disk_copies_another_rank_evicted_left_them_announced_on_disk(tmp_path):
    ranks = [replace(NS, tp_size=2, tp_rank=r) for r in range(2)]
    keys = keys_for(24, ranks[0])  # (the chained keys are the same on every rank)
    tracker = VllmEventTracker(NS.block_size, ranks=2)
    for ns in ranks:  # rank 0 stores its shards, then rank 1 stores its own: the disk holds ~30
        with make_store(tmp_path, ns=ns, host="1MiB", disk="512KiB") as store:
            feed = store.events.subscribe()
            store.save(keys, payloads(store, 24))
            store.flush()
            tracker.receive(worker_events(feed, ns.tp_rank))
    with make_store(tmp_path, ns=ranks[0], host="1MiB", disk="512KiB") as store:
        listed = set(store.tier("disk").backend.scan())
    loadable = {k for k in keys if all(p + k in listed for p in rank_prefixes(ranks[0]))}
    assert len(loadable) < len(keys), "rank 1's puts were to evict some of rank 0's copies"
    assert router_view(tracker.take()) == loadable  # (names: the keys, vLLM's placeholder form)


def test_a_removal_of_another_ranks_copy_is_its_ranks_and_its_stores_are_left_to_it():
    events = BlockEvents()
    feed = events.subscribe()
    mine, theirs, stranger = b"A" * 16, b"B" * 16, b"C" * 16
    hear = events.listener("disk", mine, [mine, theirs])
    hear("stored", [mine + b"k" * 16, theirs + b"s" * 16])
    hear("removed", [theirs + b"x" * 16, mine + b"y" * 16, stranger + b"z" * 16])
    assert [(e.kind, e.keys, e.rank) for e in feed.take()] == [
        ("stored", (b"k" * 16,), None), ("removed", (b"y" * 16,), None), ("removed", (b"x" * 16,), 1)]
