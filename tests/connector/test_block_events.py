"""A router subscribed to the store's block events learns which tier holds a served prompt's
blocks, and which blocks each tier dropped again (reference engine, real host and LMDB tiers)."""

from __future__ import annotations

from tests.connector.engine_helpers import GREEDY, connector, engine, prompt
from tiered_kv.keys import block_keys


def held(events, tier: str) -> set[bytes]:
    """What a router replaying ``events`` believes ``tier`` holds."""
    out: set[bytes] = set()
    for e in events:
        if e.tier == tier:
            out = out | set(e.keys) if e.kind == "stored" else out - set(e.keys)
    return out


def test_a_served_prompt_is_announced_per_tier_and_evictions_withdraw_it(tmp_path):
    conn = connector(tmp_path / "db")
    feed = conn.subscribe_block_events()
    try:
        ns, first = conn.store.namespace, prompt(5 * conn.store.namespace.block_size + 3, seed=1)
        engine(conn).generate([first], GREEDY)
        conn.worker.flush_copies()  # saves still being copied into the host tier
        conn.store.flush()
        keys = block_keys(ns, first)[:5]
        events = feed.take()
        assert {e.kind for e in events} == {"stored"}
        assert set(keys) <= held(events, "host")
        assert set(keys) <= held(events, "disk")

        # enough other prompts to push the first one out of the host tier
        slots = conn.store.host.num_slots
        others = [prompt(5 * ns.block_size + 3, seed=10 + i) for i in range(slots // 5 + 2)]
        engine(conn).generate(others, GREEDY)
        conn.worker.flush_copies()  # saves still being copied into the host tier
        conn.store.flush()
        events += feed.take()
        removed = {k for e in events if e.kind == "removed" and e.tier == "host" for k in e.keys}
        assert set(keys) & removed
        assert not set(keys) & held(events, "host") - set(conn.store.host.scan())
        assert set(keys) <= held(events, "disk")  # the disk tier still has them
        assert feed.dropped == 0
    finally:
        conn.close()


def test_a_withdrawn_block_is_announced_removed_from_every_tier(tmp_path):
    conn = connector(tmp_path / "db")
    feed = conn.subscribe_block_events()
    try:
        served = prompt(4 * conn.store.namespace.block_size, seed=3)
        engine(conn).generate([served], GREEDY)
        conn.worker.flush_copies()  # saves still being copied into the host tier
        conn.store.flush()
        keys = block_keys(conn.store.namespace, served)[:2]
        feed.take()
        conn.store.invalidate(keys).result(timeout=10)
        events = feed.take()
        assert {(e.kind, e.tier) for e in events} == {("removed", "host"), ("removed", "disk")}
        assert all(set(e.keys) == set(keys) for e in events)
    finally:
        conn.close()
