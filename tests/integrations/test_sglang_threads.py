"""What SGLang's scheduler and storage threads can count on from the backend: a backup reported
stored is held by a lower tier; a backup on a stalled tier returns well inside the 10 s SGLang
joins its storage threads for before it fails a cache flush; ``get_stats`` (every scheduler step
with ``--enable-metrics``) touches no tier; an existence check asks for this rank's pages only
(SGLang agrees across its ranks itself); a clear that fails says so.

Real LMDB directories and real redis-servers throughout: a full Redis refuses writes, a paused
one stalls them, a stopped one is down."""

from __future__ import annotations

import os
import threading

import pytest
import redis

from tests.integrations.sglang_standins import MHAPool, StorageConfig
from tests.integrations.test_sglang_adapter import pages_of, sglang_keys
from tiered_kv.errors import ConfigError, TieredKVError
from tiered_kv.integrations.sglang import TieredKVHiCacheStorage

SGLANG_JOIN_S = 10.0  # cache_controller._stop_storage_threads joins each storage thread this long
HANG_GUARD_S = 60.0  # only so a call stuck on a hung tier fails the test instead of hanging it
STALLED_MS = 3_600_000  # a Redis paused this long (and a client waiting this long) never answers within it


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    for name in [n for n in os.environ if n.startswith("TIERED_KV_")]:
        monkeypatch.delenv(name)


def attach(pool, config: StorageConfig | None = None, **extra) -> TieredKVHiCacheStorage:
    """The backend SGLang builds with ``extra`` as its extra config, its host pool registered."""
    config = config or StorageConfig()
    config.extra_config = {"backend_name": "tiered_kv", "module_path": "tiered_kv.integrations.sglang",
                           "class_name": "TieredKVHiCacheStorage", "interface_v1": 1, **extra}
    storage = TieredKVHiCacheStorage(config, {})
    storage.register_mem_pool_host(pool)
    return storage


def disk(tmp_path) -> dict:
    return {"url": f"lmdb://{tmp_path}/l3", "capacity": "64MiB"}


def test_regression_a_backup_no_lower_tier_took_was_reported_stored(tmp_path, own_redis):
    # Redis full under noeviction refuses every SET: the write-behind stored nothing, yet the
    # backup answered True because the host staging copy counted; SGLang then took the pages for
    # stored, and they were gone once the staging copy was evicted
    pool = MHAPool("page_first", seed=1)
    storage = attach(pool, remote={"url": own_redis.url})
    r = redis.Redis.from_url(own_redis.url)
    r.config_set("maxmemory-policy", "noeviction")
    r.config_set("maxmemory", "1")
    try:
        keys = sglang_keys(3)
        assert storage.batch_set_v1(keys, pool.page_indices(0, 3)) == [False] * 3
        assert storage.batch_set(sglang_keys(2, seed="v0"), pages_of(pool, 4, 2)) is False
        assert storage.get_stats()["backup_pgs"] == []  # nothing counted as backed up (no SGLang: a dict)
    finally:
        r.config_set("maxmemory", "0")
        storage.close()


def test_a_backup_is_stored_once_the_lower_tier_holds_it(tmp_path, redis_url):
    pool = MHAPool("page_first", seed=1)
    keys = sglang_keys(3)
    storage = attach(pool, disk=disk(tmp_path), remote={"url": redis_url})
    assert storage.batch_set_v1(keys, pool.page_indices(0, 3)) == [True] * 3
    storage.close()
    reader = attach(MHAPool("page_first", seed=2), remote={"url": redis_url})  # Redis alone
    try:
        assert reader.batch_exists(keys) == 3
    finally:
        reader.close()


def test_without_a_written_through_tier_the_staging_copy_is_what_a_backup_has(tmp_path):
    pool = MHAPool("page_first", seed=1)
    keys = sglang_keys(2)
    host_only = attach(pool)
    on_evict = attach(pool, disk={**disk(tmp_path), "policy": "on_evict"})
    try:
        assert host_only.batch_set_v1(keys, pool.page_indices(0, 2)) == [True, True]
        assert on_evict.batch_set_v1(keys, pool.page_indices(0, 2)) == [True, True]
    finally:
        host_only.close()
        on_evict.close()


def test_regression_a_backup_waiting_on_a_stalled_tier_outlived_sglangs_10s_thread_join(tmp_path, own_redis):
    # the backup waited write_timeout = 60 s for a stalled tier; SGLang's flush_cache (after every
    # weight update) joins its backup thread for 10 s and then raises RuntimeError
    pool = MHAPool("page_first", seed=1)
    storage = attach(pool, disk=disk(tmp_path), remote={"url": own_redis.url})
    lookups = storage.store.config.lookup_timeout * len(storage.store.tiers)
    assert storage.write_timeout + lookups <= SGLANG_JOIN_S - 2  # the default leaves SGLang room
    storage.close()
    with pytest.raises(ConfigError, match="write_timeout"):
        attach(pool, disk=disk(tmp_path), write_timeout=60)  # a setting that could outlive it

    # a Redis that stalls every write for an hour, the client waiting as long: the backup comes back
    # at write_timeout, answering not stored, while its write is still waiting on Redis
    storage = attach(pool, remote={"url": own_redis.url, "timeout": f"{STALLED_MS}ms", "retries": 0},
                     write_timeout="300ms")
    r = redis.Redis.from_url(own_redis.url)
    r.execute_command("CLIENT", "PAUSE", STALLED_MS, "WRITE")
    answers: list = []
    backup = threading.Thread(target=lambda: answers.append(
        storage.batch_set_v1(sglang_keys(2), pool.page_indices(0, 2))), daemon=True)
    try:
        backup.start()
        backup.join(HANG_GUARD_S)
        assert not backup.is_alive(), "the backup waited on the stalled Redis"
        assert answers == [[False, False]]
        assert not storage.store.pool.drain(0)  # its write-behind still waits on Redis
    finally:
        r.execute_command("CLIENT", "UNPAUSE")
        backup.join(HANG_GUARD_S)
        storage.close()


def test_regression_get_stats_on_every_scheduler_step_ran_redis_info_and_scan(tmp_path, own_redis):
    # SGLang calls get_stats() on its scheduler thread every step with --enable-metrics; it ran
    # the store's whole stats(): an INFO and a SCAN of the shared Redis, and a stat of every LMDB
    # segment, per step
    pool = MHAPool("page_first", seed=1)
    storage = attach(pool, disk=disk(tmp_path), remote={"url": own_redis.url})
    keys = sglang_keys(2)
    assert storage.batch_set_v1(keys, pool.page_indices(0, 2)) == [True, True]
    r = redis.Redis.from_url(own_redis.url)
    r.config_resetstat()
    try:
        for _ in range(3):  # three scheduler steps
            stats = storage.get_stats()
        calls = {name: s["calls"] for name, s in r.info("commandstats").items()}
        assert all(name.startswith("cmdstat_config") for name in calls), calls  # (the reset itself)
        assert set(stats) == {"prefetch_pgs", "backup_pgs", "prefetch_bandwidth", "backup_bandwidth"}
    finally:
        storage.close()


def test_regression_existence_checks_asked_redis_for_every_tp_ranks_pages(tmp_path, redis_url):
    # SGLang takes the smallest answer of its ranks itself; each rank asked for all 8 ranks'
    # copies: 8x the presence checks under one lookup deadline (answers it cut were lost hits)
    keys = sglang_keys(64)
    pool = MHAPool("page_first", pages=64, seed=1)
    rank0 = attach(pool, StorageConfig(tp_rank=0, tp_size=8), remote={"url": redis_url})
    assert rank0.batch_set_v1(keys, pool.page_indices(0, 64)) == [True] * 64
    rank0.close()
    restarted = attach(MHAPool("page_first", pages=64, seed=2), StorageConfig(tp_rank=0, tp_size=8),
                       remote={"url": redis_url})  # its staging tier empty: every page is in Redis
    r = redis.Redis.from_url(redis_url)
    r.config_resetstat()
    try:
        assert restarted.batch_exists(keys) == 64  # this rank's pages (the other ranks answer theirs)
        assert r.info("commandstats")["cmdstat_type"]["calls"] == 64
    finally:
        restarted.close()


def test_regression_a_failed_clear_was_reported_to_sglang_as_cleared(tmp_path, own_redis):
    # the clear's failure was answered as None: SGLang logged "cleared successfully" (and dropped
    # its beliefs about L3) while the pages were still there to be served
    pool = MHAPool("page_first", seed=1)
    keys = sglang_keys(3)
    storage = attach(pool, disk=disk(tmp_path), remote={"url": own_redis.url, "retries": 0, "timeout": "200ms"})
    assert storage.batch_set_v1(keys, pool.page_indices(0, 3)) == [True] * 3
    own_redis.stop()
    try:
        with pytest.raises(TieredKVError):  # SGLang's storage attachment: logged, clear() -> False
            storage.clear()
    finally:
        storage.close()


def test_a_clear_while_backups_are_still_being_written_clears_nothing_and_says_so(tmp_path, own_redis):
    pool = MHAPool("page_first", seed=1)
    # Redis stalls writes for an hour (the client waiting as long): the backups are still being
    # written whenever the clear looks, however slowly this machine runs
    storage = attach(pool, remote={"url": own_redis.url, "timeout": f"{STALLED_MS}ms", "retries": 0},
                     write_timeout="300ms")
    r = redis.Redis.from_url(own_redis.url)
    r.execute_command("CLIENT", "PAUSE", STALLED_MS, "WRITE")
    try:
        storage.batch_set_v1(sglang_keys(2), pool.page_indices(0, 2))  # still being written
        # (said at once, or, when the clear's thread was slower than clear() waits for it, as
        # going on in the background: that thread then clears nothing either)
        with pytest.raises(TieredKVError, match="nothing cleared|in the background"):
            storage.clear()  # (the write landing after it would bring the pages back)
        storage._clearing.join(HANG_GUARD_S)
        assert not storage._clearing.is_alive(), "the clear waited on the stalled Redis"
        assert len(list(storage.store.host.scan())) == 2  # the staged pages: not cleared
        assert not storage.store.pool.drain(0)  # (their writes still wait on Redis)
    finally:
        r.execute_command("CLIENT", "UNPAUSE")
        storage.close()


def test_regression_a_backup_larger_than_the_staging_tier_waited_on_a_hung_tier_for_as_long_as_it_hung(tmp_path):
    # more pages than the host staging tier holds are staged in chunks, each waiting for the
    # write-behind of the ones before: with the disk tier hung (a stalled network disk, another
    # process holding LMDB's writer) that wait had no bound, past SGLang's 10 s thread join.
    # The hung tier answers only when the test lets it: the backup returning at all, within the
    # hang guard, is what SGLang's join needs (its own wait is write_timeout)
    pool = MHAPool("page_first", seed=1)
    probe = attach(pool, disk=disk(tmp_path))
    page_bytes = probe.store.block_nbytes
    probe.close()
    storage = attach(pool, disk=disk(tmp_path), host={"capacity": 4 * page_bytes}, write_timeout="300ms")
    backend, hung = storage.store.tier("disk").backend, threading.Event()
    put_many = backend.put_many
    backend.put_many = lambda items, **kw: hung.wait(STALLED_MS / 1000) and put_many(items, **kw)
    answers: list = []
    backup = threading.Thread(target=lambda: answers.append(
        storage.batch_set_v1(sglang_keys(12), pool.page_indices(0, 12))))
    try:
        backup.start()
        backup.join(HANG_GUARD_S)
        assert not backup.is_alive(), "the backup waited on the hung disk tier"
        assert answers == [[False] * 12]  # nothing was written: nothing reported stored
        assert storage.store.metrics.events["saves_no_room"] > 0  # what found no room, counted
    finally:
        hung.set()
        backup.join(HANG_GUARD_S)
        storage.close()


def test_a_clear_with_a_hung_tier_does_not_stall_sglangs_scheduler_thread(tmp_path):
    # clear() ran the deletes on SGLang's scheduler thread: a lower tier that stopped answering
    # (a stalled network disk, a hung Redis) stalled every request behind the admin call
    import threading

    pool = MHAPool("page_first", seed=1)
    storage = attach(pool, disk=disk(tmp_path), write_timeout="300ms")
    keys = sglang_keys(3)
    assert storage.batch_set_v1(keys, pool.page_indices(0, 3)) == [True] * 3
    backend, hung, entered = storage.store.tier("disk").backend, threading.Event(), threading.Event()
    delete_many = backend.delete_many
    backend.delete_many = lambda batch, **kw: (entered.set(), hung.wait(STALLED_MS / 1000)) and delete_many(batch, **kw)
    answers: list = []

    def scheduler_clear():
        try:
            storage.clear()
            answers.append("cleared")
        except TieredKVError as exc:
            answers.append(exc)

    scheduler = threading.Thread(target=scheduler_clear, daemon=True)
    try:
        scheduler.start()
        assert entered.wait(HANG_GUARD_S)  # the deletes reached the hung tier
        scheduler.join(HANG_GUARD_S)  # (clear() itself waits 2 x write_timeout; the tier answers only when let)
        assert not scheduler.is_alive(), "clear() waited on the hung disk tier"
        assert len(answers) == 1 and "background" in str(answers[0])  # SGLang: logged, clear() -> False
        with pytest.raises(TieredKVError, match="still running"):
            storage.clear()  # one at a time
    finally:
        hung.set()
        storage._clearing.join(HANG_GUARD_S)
    storage.clear()  # the tier answers again: the next clear goes through
    assert storage.batch_exists(keys) == 0
    storage.close()
