"""``tiered-kv copy`` into an LMDB store an engine already fills: the tool does not know the
capacity the engine runs the store with, so it never evicts the engine's blocks to make room (a
put that does not fit is refused and reported), and whatever a destination does evict is counted,
the namespace records' puts included. Real LMDB stores under tmp_path, the real CLI."""

from __future__ import annotations

from pathlib import Path

from storage_backends import lmdb_disk
from storage_backends.lmdb_disk import LmdbBackend
from tests.cli.conftest import cli
from tests.store.helpers import NS, keys_for, make_store, payloads
from tiered_kv.admin.evict_copy import copy
from tiered_kv.admin.opening import Tier, open_tier
from tiered_kv.keys import Namespace
from tiered_kv.store.records import namespace_key

KiB, MiB = 1 << 10, 1 << 20
OTHER = Namespace(model_id="other-llama", dtype="bfloat16", num_layers=4, num_kv_heads=2,
                  head_dim=32, block_size=16)  # the copied model's blocks: 16 KiB each


def saved(tmp_path: Path, n: int, ns: Namespace = NS, capacity: str = "64MiB") -> tuple[str, list[bytes]]:
    """An engine's store of ``n`` blocks of ``ns`` (and its record) on a disk tier of ``capacity``;
    (its URL, the blocks' storage keys)."""
    keys = keys_for(n, ns)
    with make_store(tmp_path, ns=ns, disk=capacity) as store:
        store.save(keys, payloads(store, n))
        store.flush()
        url = store.tier("disk").backend.url.split("?", 1)[0]
    return url, [ns.digest() + k for k in keys]


def still_held(url: str, keys: list[bytes], capacity: str = "64MiB") -> int:
    """How many of ``keys`` the store at ``url`` holds, opened as its engine opens it."""
    backend = LmdbBackend(url.split("://", 1)[1], capacity=capacity)
    try:
        return sum(backend.contains_many(keys))
    finally:
        backend.close()


def test_regression_copy_into_an_engine_store_fuller_than_the_tools_default_capacity_evicts_its_blocks(
        tmp_path, monkeypatch):
    """The tool opened the destination with a made-up capacity (8 GiB, the URL default; 64 KiB
    here, so that a few hundred KiB stand for a store of more than 8 GiB) and its puts evicted
    the engine's blocks down to it, while the report said ``evicted_at_destination 0``, exit 0."""
    engine_url, engine_keys = saved(tmp_path / "engine", 32)  # ~0.5 MiB under a 64 MiB capacity
    source_url, copied_keys = saved(tmp_path / "source", 4, OTHER)
    monkeypatch.setattr(lmdb_disk, "DEFAULT_CAPACITY", 64 * KiB)

    result = cli("copy", source_url, engine_url, "--json")

    assert result.code == 0, result.out + result.err
    report = result.json()
    assert (report["copied"], report["rejected"], report["evicted_at_destination"]) == (4, 0, 0)
    assert still_held(engine_url, engine_keys) == 32, "the engine's blocks are all there"
    assert still_held(engine_url, copied_keys + [namespace_key(OTHER.digest())]) == 5
    with make_store(tmp_path / "engine", disk="64MiB") as engine:  # the engine serves them still
        assert engine.lookup(keys_for(32)) == 32


def test_a_tool_open_of_an_engine_store_has_no_capacity_and_keeps_the_stores_map(tmp_path):
    engine = LmdbBackend(tmp_path / "store", capacity=64 * MiB, map_size=2 * MiB)
    engine.put_many([(b"engine-%d" % i, bytes(1000)) for i in range(8)])
    map_size = engine.stats().extra["map_size"]
    engine.close()

    tier = open_tier(f"lmdb://{tmp_path / 'store'}?capacity=1KiB")  # the URL's capacity: reported only
    try:
        stats = tier.backend.stats()
        assert tier.capacity == 1 * KiB and stats.capacity_bytes is None
        assert stats.extra["map_size"] == map_size, "the map the engine left, not one the tool made up"
        assert tier.backend.put_many([(b"tool", bytes(4 * KiB))]) == [True]
        assert tier.backend.stats().evictions == 0
    finally:
        tier.close()
    assert still_held(f"lmdb://{tmp_path / 'store'}", [b"engine-%d" % i for i in range(8)]) == 8


def test_a_tool_open_refuses_a_put_its_full_map_cannot_hold_and_evicts_nothing(tmp_path):
    engine = LmdbBackend(tmp_path / "store", capacity=64 * MiB, map_size=512 * KiB, segment_min="1GiB")
    engine_keys = [b"engine-%d" % i for i in range(16)]
    assert all(engine.put_many([(k, bytes(8 * KiB)) for k in engine_keys]))
    engine.close()

    tier = open_tier(f"lmdb://{tmp_path / 'store'}?segment_min=1GiB")  # values in the map, as the engine's
    try:
        tier.backend._db.max_map = tier.backend._db.map_size  # the map cannot grow (as on a full disk)
        assert tier.backend.put_many([(b"too-big", bytes(2 * MiB))]) == [False]
        stats = tier.backend.stats()
        assert (stats.evictions, stats.put_rejected) == (0, 1)
    finally:
        tier.close()
    assert still_held(f"lmdb://{tmp_path / 'store'}", engine_keys) == 16


def test_regression_copy_did_not_count_the_evictions_its_namespace_records_made(tmp_path):
    """A destination that evicts (an engine's own open, with its capacity) evicted for the
    namespace records before ``evicted_at_destination`` started counting: those were unreported."""
    source_url, _ = saved(tmp_path / "source", 2, OTHER)
    full = LmdbBackend(tmp_path / "full", capacity=64 * KiB, segment_min="1GiB")
    fillers = [b"filler-%02d" % i for i in range(16)]
    assert all(full.put_many([(k, bytes(4 * KiB)) for k in fillers]))  # exactly at its capacity
    assert full.stats().evictions == 0
    src = open_tier(source_url, name="source")
    try:
        report = copy(src, Tier("destination", full), namespace=OTHER.digest())
        lost = 16 - sum(full.contains_many(fillers))
    finally:
        src.close()
        full.close()
    assert report["copied"] == 2 and lost > 0
    assert report["evicted_at_destination"] == lost


def test_regression_copy_into_a_new_store_evicts_what_it_copied_beyond_the_default_capacity(
        tmp_path, monkeypatch):
    """A copy into a new directory created the store with the engine's default capacity (8 GiB;
    64 KiB here, so a few hundred KiB stand for a store of more than 8 GiB) and evicted the
    blocks it had just copied down to it: a partial copy that exited 0. A new destination now
    has only the capacity its URL gives, and room for what the source holds."""
    source_url, copied_keys = saved(tmp_path / "source", 32, OTHER)  # ~0.5 MiB
    monkeypatch.setattr(lmdb_disk, "DEFAULT_CAPACITY", 64 * KiB)
    new = tmp_path / "new"

    result = cli("copy", source_url, f"lmdb://{new}", "--json")

    assert result.code == 0, result.out + result.err
    report = result.json()
    assert (report["copied"], report["rejected"], report["evicted_at_destination"]) == (32, 0, 0)
    assert still_held(f"lmdb://{new}", copied_keys, capacity="64MiB") == 32


def test_a_new_destination_keeps_the_capacity_its_url_gives(tmp_path):
    source_url, _ = saved(tmp_path / "source", 32, OTHER)  # 32 blocks of 16 KiB
    new = tmp_path / "new"

    result = cli("copy", source_url, f"lmdb://{new}?capacity=256KiB", "--json")

    report = result.json()
    assert report["evicted_at_destination"] > 0 and report["copied"] == 32
    assert result.code == 0, "what the user asked for: evictions reported, not a failure"
    backend = LmdbBackend(new, capacity=256 * KiB)
    try:
        assert backend.stats().used_bytes <= 256 * KiB
    finally:
        backend.close()
