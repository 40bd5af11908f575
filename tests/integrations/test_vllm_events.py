"""vLLM's KV events (``--kv-events-config``) carry the store's blocks: the worker hands its
store's events to vLLM, the scheduler half turns them into vLLM's ``BlockStored`` /
``BlockRemoved`` named by vLLM's block hashes. Stand-in engine, real store (host + LMDB)."""

from __future__ import annotations

import hashlib
from types import SimpleNamespace

import pytest

from tests.integrations.test_vllm_adapter import extra, prompt
from tests.integrations.vllm_engine import BS, Engine, kv_cache_config, vllm_config
from tiered_kv.errors import ConfigError
from tiered_kv.integrations import vllm_events, vllm_holdings
from tiered_kv.integrations.vllm import KVConnectorRole, TieredKVConnector
from tiered_kv.store.block_events import BlockEvent


def vllm_hashes(tokens: list[int]) -> list[bytes]:
    """Chained per-block hashes, as vLLM keeps them in ``request.block_hashes``."""
    out, parent = [], b"none"
    for i in range(len(tokens) // BS):
        parent = hashlib.sha256(parent + repr(tokens[i * BS:(i + 1) * BS]).encode()).digest()
        out.append(parent)
    return out


def halves(tmp_path, events: bool = True, host: str = "256KiB"):
    cfg = vllm_config(extra(tmp_path, host={"capacity": host}))
    cfg.kv_events_config = SimpleNamespace(enable_kv_cache_events=events)
    return (TieredKVConnector(cfg, KVConnectorRole.WORKER, kv_cache_config()),
            TieredKVConnector(cfg, KVConnectorRole.SCHEDULER, kv_cache_config()))


def step_events(worker, sched) -> list:
    """What vLLM does after a step: the worker's events ride KVConnectorOutput to the scheduler
    half, whose take_events vLLM publishes."""
    sched.update_connector_output(SimpleNamespace(kv_cache_events=worker.get_kv_connector_kv_cache_events(),
                                                  invalid_block_ids=set()))
    return list(sched.take_events())


def test_stored_blocks_are_published_under_vllms_block_hashes(tmp_path):
    worker, sched = halves(tmp_path)
    try:
        tokens = prompt(4 * BS + 1, seed=7)  # with 2 generated tokens: still 4 full blocks
        engine = Engine(sched, worker)
        request = engine.add("a", tokens, max_tokens=2)
        request.block_hashes = vllm_hashes(tokens)
        engine.run()
        worker._worker.core.flush_copies()  # saves still being copied into the host tier
        worker._worker.store.flush()
        events = step_events(worker, sched)
        stored = [e for e in events if type(e).__name__ == "BlockStored"]
        by_tier = {e.medium: e for e in stored}
        assert set(by_tier) >= {"host", "disk"}
        want = [vllm_events.maybe_convert_block_hash(h) for h in request.block_hashes]
        for tier in ("host", "disk"):
            hashes = [h for e in stored if e.medium == tier for h in e.block_hashes]
            assert sorted(hashes) == sorted(want)  # copies into the host tier complete in any order
            for event in (e for e in stored if e.medium == tier):  # each a run of chained blocks
                at = want.index(event.block_hashes[0])
                assert event.block_hashes == want[at : at + len(event.block_hashes)]
                assert event.parent_block_hash == (want[at - 1] if at else None) and event.block_size == BS
                assert event.token_ids == tokens[at * BS : (at + len(event.block_hashes)) * BS]
        assert step_events(worker, sched) == []  # taken once
    finally:
        worker.shutdown()
        sched.shutdown()


def test_evicted_blocks_are_published_removed_and_nothing_without_kv_events(tmp_path):
    worker, sched = halves(tmp_path, host="8KiB")  # 16 blocks
    quiet, quiet_sched = halves(tmp_path / "quiet", events=False)
    try:
        engine = Engine(sched, worker, num_blocks=256)
        for i in range(12):  # far more than the host tier holds
            engine.add(f"r{i}", prompt(6 * BS, seed=100 + i), max_tokens=1)
        engine.run()
        events = step_events(worker, sched)
        removed = [h for e in events if type(e).__name__ == "BlockRemoved" and e.medium == "host"
                   for h in e.block_hashes]
        assert removed  # evicted from the host tier, named as they were announced
        announced = {h for e in events if type(e).__name__ == "BlockStored" for h in e.block_hashes}
        assert set(removed) <= announced
        assert quiet.get_kv_connector_kv_cache_events() is None and quiet._worker.feed is None
    finally:
        for c in (worker, sched, quiet, quiet_sched):
            c.shutdown()


def test_a_block_is_announced_once_every_rank_stored_its_shard():
    tracker = vllm_events.VllmEventTracker(block_size=4, ranks=2)
    tokens = list(range(8))
    keys = [b"k0" * 8, b"k1" * 8]
    request = SimpleNamespace(all_token_ids=tokens, block_hashes=[b"h0", b"h1"], lora_request=None)
    tracker.remember(request, keys, 0, keys)
    stored = BlockEvent("stored", "disk", tuple(keys), 0.0)
    tracker.receive(vllm_events.TieredKVEvents([(0, stored)]))
    assert tracker.take() == []  # rank 1 has not stored its shard yet
    tracker.receive(vllm_events.TieredKVEvents([(1, stored), (1, BlockEvent("removed", "host", (keys[1],), 0.0))]))
    [done, gone] = tracker.take()
    h0, h1 = (vllm_events.maybe_convert_block_hash(h) for h in (b"h0", b"h1"))  # as vLLM converts its own
    assert done == vllm_events.BlockStored(block_hashes=[h0, h1], parent_block_hash=None, token_ids=tokens,
                                           block_size=4, lora_id=None, medium="disk", lora_name=None)
    assert gone == vllm_events.BlockRemoved(block_hashes=[h1], medium="host")
    unknown = BlockEvent("removed", "disk", (b"x" * 16,), 0.0)  # never planned here: the key itself
    tracker.receive(vllm_events.TieredKVEvents([(0, unknown)]))
    assert tracker.take()[0].block_hashes == [vllm_events.maybe_convert_block_hash(b"x" * 16)]


def test_an_eviction_past_the_remembered_names_is_removed_under_the_announced_hash(tmp_path, monkeypatch):
    """Planned names are forgotten least recently planned first (REMEMBERED), a tier evicts least
    recently stored first: once the host tier held more blocks than names were remembered, its
    evictions were announced under our keys, hashes no BlockStored carried (the router kept
    them). REMEMBERED is scaled down to the host tier of 16 blocks."""
    monkeypatch.setattr(vllm_events, "REMEMBERED", 8)
    worker, sched = halves(tmp_path, host="8KiB")
    try:
        engine = Engine(sched, worker, num_blocks=256)
        announced, removed = set(), []
        for i in range(12):
            tokens = prompt(6 * BS, seed=100 + i)
            engine.add(f"r{i}", tokens, max_tokens=1).block_hashes = vllm_hashes(tokens)
            engine.run()
            for e in step_events(worker, sched):
                if type(e).__name__ == "BlockStored":
                    announced.update(e.block_hashes)
                elif e.medium == "host":
                    removed.extend(e.block_hashes)
        assert removed
        assert [h for h in removed if h not in announced] == []
    finally:
        worker.shutdown()
        sched.shutdown()


def _two_ranks(key: bytes = b"k" * 16):
    tracker = vllm_events.VllmEventTracker(block_size=4, ranks=2)
    request = SimpleNamespace(all_token_ids=list(range(4)), block_hashes=[b"h"], lora_request=None)
    tracker.remember(request, [key], 0, [key])

    def step(*events):  # (kind, rank) pairs about ``key`` in the host tier
        tracker.receive(vllm_events.TieredKVEvents([(r, BlockEvent(k, "host", (key,), 0.0)) for k, r in events]))
        return [type(e).__name__ for e in tracker.take()]

    return tracker, step


def test_a_block_stored_again_by_the_rank_that_dropped_it_is_announced_again():
    """TP=2: removed as soon as rank 0 dropped its shard; rank 1 kept its own and stores nothing,
    so rank 0 storing it again makes the block whole again (it used to wait for rank 1 forever)."""
    _, step = _two_ranks()
    assert step(("stored", 0), ("stored", 1)) == ["BlockStored"]
    assert step(("removed", 0)) == ["BlockRemoved"]
    assert step(("stored", 0)) == ["BlockStored"]


def test_a_block_both_ranks_drop_is_announced_removed_once():
    _, step = _two_ranks()
    assert step(("stored", 0), ("stored", 1)) == ["BlockStored"]
    assert step(("removed", 1), ("removed", 0)) == ["BlockRemoved"]
    assert step(("stored", 1)) == []  # rank 0 has not stored its shard again
    assert step(("stored", 1)) == []  # a shard stored again while it is held: nothing new


def test_a_rank_whose_feed_dropped_events_has_its_tiers_blocks_announced_removed():
    """A worker's feed overflowed: its "removed" may be among the dropped, so every block the
    tier announced is retracted, and announced again when that rank stores it again."""
    _, step = _two_ranks()
    assert step(("stored", 0), ("stored", 1)) == ["BlockStored"]
    assert step(("lost", 0)) == ["BlockRemoved"]
    assert step(("lost", 0)) == []  # nothing announced any more
    assert step(("stored", 0)) == ["BlockStored"]  # rank 1 kept its shard


def test_a_queue_nobody_drains_past_its_bound_tells_the_router_to_forget_every_block(monkeypatch):
    """Dropping the oldest queued events could drop a BlockRemoved (its blocks announced for
    ever): past the bound every event goes and the router is told AllBlocksCleared."""
    monkeypatch.setattr(vllm_events, "QUEUED", 2)
    tracker, step = _two_ranks()
    tracker.receive(vllm_events.TieredKVEvents([(r, BlockEvent("stored", "host", (b"k" * 16,), 0.0))
                                                for r in (0, 1)]))
    tracker.receive(vllm_events.TieredKVEvents([(0, BlockEvent("removed", "host", (b"k" * 16,), 0.0))]))
    tracker.receive(vllm_events.TieredKVEvents([(r, BlockEvent("stored", "disk", (b"j" * 16,), 0.0))
                                                for r in (0, 1)]))
    assert [type(e).__name__ for e in tracker.take()] == ["AllBlocksCleared"]
    assert tracker.dropped == 3
    assert step(("stored", 0), ("stored", 1)) == ["BlockStored"]  # announced anew once stored again


def test_a_tier_holding_more_blocks_than_are_tracked_retracts_the_least_recently_stored(monkeypatch):
    """Per tier HELD blocks are tracked; past that the least recently stored is forgotten, and
    announced removed under the hash it was stored under (nothing could retract it later)."""
    monkeypatch.setattr(vllm_holdings, "HELD", 2)
    tracker = vllm_events.VllmEventTracker(block_size=4)
    keys = [b"k%d" % i * 8 for i in range(3)]
    for i, key in enumerate(keys):  # three separate prompts
        request = SimpleNamespace(all_token_ids=list(range(4)), block_hashes=[b"h%d" % i], lora_request=None)
        tracker.remember(request, [key], 0, [key])
    tracker.receive(vllm_events.TieredKVEvents([(0, BlockEvent("stored", "remote", (k,), 0.0)) for k in keys]))
    events = tracker.take()
    h0 = vllm_events.maybe_convert_block_hash(b"h0")
    assert [type(e).__name__ for e in events] == ["BlockStored"] * 3 + ["BlockRemoved"]
    assert events[-1] == vllm_events.BlockRemoved(block_hashes=[h0], medium="remote")
    assert len(tracker.held) == 2
    tracker.receive(vllm_events.TieredKVEvents([(0, BlockEvent("removed", "remote", keys, 0.0))]))
    [gone] = tracker.take()  # the two tracked by their hashes; the forgotten one as named now
    assert sorted(gone.block_hashes) == sorted(vllm_events.maybe_convert_block_hash(b"h%d" % i) for i in range(3))
    assert len(tracker.held) == 0


def test_with_vllm_installed_the_events_are_vllms_own_classes():
    kv_events = pytest.importorskip("vllm.distributed.kv_events")
    assert vllm_events.BlockStored is kv_events.BlockStored
    assert vllm_events.BlockRemoved is kv_events.BlockRemoved
    assert vllm_events.AllBlocksCleared is kv_events.AllBlocksCleared
    assert issubclass(vllm_events.TieredKVEvents, kv_events.KVConnectorKVEvents)


@pytest.mark.parametrize("tier, key", [({"disk": {"name": "GPU"}}, "disk.name"),
                                       ({"disk": {"name": "cpu"}}, "disk.name"),
                                       ({"tiers": [{"name": "Storage", "url": "file:///tmp/x"}]}, "tiers.name")])
def test_regression_with_kv_events_on_a_tier_named_like_vllms_own_medium_passed_for_its_gpu_cache(tmp_path, tier, key):
    """A tier's name is its KV events' ``medium``: a tier named "GPU" had its blocks announced as
    if vLLM's own GPU prefix cache held them. With events on such a name is refused; without
    them it is only a name."""
    settings = extra(tmp_path)
    settings["disk"].update(tier.get("disk", {}))
    cfg = vllm_config({**settings, **{k: v for k, v in tier.items() if k != "disk"}})
    cfg.kv_events_config = SimpleNamespace(enable_kv_cache_events=True)
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(ConfigError, match=rf"^{key}\W.*GPU, CPU, STORAGE"):
            TieredKVConnector(cfg, role, kv_cache_config())
    cfg.kv_events_config = SimpleNamespace(enable_kv_cache_events=False)
    TieredKVConnector(cfg, KVConnectorRole.SCHEDULER, kv_cache_config()).shutdown()


def test_the_reserved_tier_names_are_vllms_own_media():
    kv_events = pytest.importorskip("vllm.distributed.kv_events")
    media = {v for k, v in vars(kv_events).items() if k.startswith("MEDIUM_") and isinstance(v, str)}
    assert media and {m.upper() for m in media} <= set(vllm_events.VLLM_MEDIA)
