"""Slots holding stored blocks migrate to another master while a replica keeps loading them:
ASK (mid-migration) and MOVED (after it) are followed, blocks stay bit-exact, saves land."""

from __future__ import annotations

from redis.crc import key_slot

from tests.cluster.helpers import LOOKUP_S, bit_exact_loads, masters_of, stored_name
from tests.store.helpers import keys_for, make_store, payloads

N = 24


def test_blocks_in_migrating_and_migrated_slots_load_bit_exact_and_new_saves_land(redis_cluster):
    keys = keys_for(N, first_token=40_000)
    with make_store(host="64KiB", disk=None, remote_url=redis_cluster.url, lookup_timeout=LOOKUP_S) as writer, \
            make_store(host="16KiB", disk=None, remote_url=redis_cluster.url, lookup_timeout=LOOKUP_S) as reader:
        data = payloads(writer, N, seed=5)
        writer.save(keys, data)
        writer.flush()
        assert all(bit_exact_loads(reader, keys, data))  # the reader now caches the slot map
        where = masters_of(redis_cluster, keys)
        source = where[0]
        target = next(m for m in redis_cluster.masters() if m is not source)
        slots = sorted({key_slot(stored_name(keys[i])) for i, m in where.items() if m is source})
        moved, waiting = slots[: len(slots) // 2 + 1], slots[len(slots) // 2 + 1 :]
        for slot in slots:
            redis_cluster.begin_migration(slot, source, target)
        assert sum(redis_cluster.migrate_keys(slot, source, target) for slot in moved) > 0
        assert all(bit_exact_loads(reader, keys, data)), "ASK redirections were not followed"
        for slot in waiting:
            redis_cluster.migrate_keys(slot, source, target)
        for slot in slots:
            redis_cluster.end_migration(slot, target)
        assert all(bit_exact_loads(reader, keys, data)), "MOVED redirections were not followed"
        assert reader.metrics.misses("remote_unavailable") == 0
        assert {m.port for i, m in masters_of(redis_cluster, keys).items() if where[i] is source} == {target.port}
        fresh = keys_for(N, first_token=50_000)
        fresh_data = payloads(reader, N, seed=6)
        reader.save(fresh, fresh_data)
        reader.flush()
        assert reader.tier("remote").contains(fresh) == [True] * N
        assert all(bit_exact_loads(writer, fresh, fresh_data))
