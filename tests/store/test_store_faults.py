"""Restart, corruption, wrong namespace and a Redis that dies: misses are counted, never crashes."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import lmdb
import pytest
import redis
import torch

from tests.store.helpers import NS, keys_for, load, make_store, payloads, rewrite_stored_blocks
from tiered_kv.errors import ConfigError
from tiered_kv.store.codec import BlockCodec

REPO = Path(__file__).resolve().parents[2]


def _lmdb_values(path: Path) -> list[tuple[bytes, int]]:
    """(key, length) of every stored block, read with lmdb directly."""
    env = lmdb.open(str(path), max_dbs=16, readonly=True, lock=True)
    try:
        out = []
        for name in _db_names(env):
            db = env.open_db(name)
            with env.begin(db=db) as txn:
                for k, v in txn.cursor():
                    if len(k) == 32 and k.startswith(NS.digest()) and v[:4] == b"TKVB":
                        out.append((name, k, len(v)))
        return out
    finally:
        env.close()


def _db_names(env) -> list[bytes]:
    with env.begin() as txn:
        return [k for k, _ in txn.cursor()]


def test_restart_child_saves_flushes_exits_and_a_new_process_loads_everything(tmp_path):
    n = 24
    child = textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {str(REPO)!r})
        from tests.store.helpers import keys_for, make_store, payloads
        from pathlib import Path
        store = make_store(Path({str(tmp_path)!r}), host="64KiB")
        keys = keys_for({n})
        data = payloads(store, {n}, seed=7)
        store.save(keys, data)
        store.flush()
        print(json.dumps(store.stats()["backends"]["disk"]))
        store.close()
    """)
    proc = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    before = json.loads(proc.stdout.strip().splitlines()[-1])
    with make_store(tmp_path, host="64KiB") as store:
        after = store.stats()["backends"]["disk"]
        # n blocks plus the namespace record (tiered_kv.store.records) the store keeps beside them
        assert (after["entries"], after["used_bytes"]) == (before["entries"], before["used_bytes"])
        assert after["entries"] == n + 1
        keys = keys_for(n)
        assert store.lookup(keys) == n
        ok, outs = load(store, keys)
        assert all(ok)
        expected = payloads(store, n, seed=7)
        assert all(torch.equal(a, b) for a, b in zip(expected, outs))


def test_disk_full_mid_write_behind_is_counted_and_what_was_committed_survives(tmp_path):
    """The disk fills up (RLIMIT_FSIZE stands in for a full filesystem): saves keep returning,
    failed writes are counted, and after a restart every block that was committed loads
    byte-identical while the rest are plain misses, never damaged blocks."""
    n = 400  # 16 KiB raw blocks: 6.25 MiB against a 2 MiB file-size limit
    child = textwrap.dedent(f"""
        import json, resource, signal, sys
        sys.path.insert(0, {str(REPO)!r})
        from pathlib import Path
        from tests.store.helpers import keys_for, make_store, payloads
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (2 << 20, 2 << 20))
        store = make_store(Path({str(tmp_path)!r}), disk={{"codec": "raw"}})
        keys, data = keys_for({n}), payloads(store, {n}, seed=3)
        for i in range(0, {n}, 20):
            store.save(keys[i:i + 20], data[i:i + 20])
            store.flush()
        snap = store.stats()
        store.close()
        print(json.dumps({{"events": snap["events"], "disk": snap["tiers"]["disk"]}}))
    """)
    proc = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["events"].get("disk_save_failed", 0) > 0
    committed = report["disk"]["blocks_in"]
    assert 0 < committed < n
    with make_store(tmp_path, host="8MiB", disk={"codec": "raw"}) as store:
        keys, expected = keys_for(n), payloads(store, n, seed=3)
        ok, outs = load(store, keys)
        assert sum(ok) == committed
        assert all(torch.equal(a, b) for a, b, good in zip(expected, outs, ok) if good)
        misses = store.stats()["tiers"]["disk"]["misses"]
        assert misses.get("absent", 0) == n - committed and "corrupt" not in misses


def test_flipped_bytes_in_lmdb_values_are_corrupt_misses_never_returned(tmp_path):
    keys = keys_for(6)
    with make_store(tmp_path) as store:
        store.save(keys, payloads(store, 6))
        store.flush()

    def flip(k: bytes, v: bytes) -> bytes:
        pos = len(v) - 7 if k[-1] % 2 else 40  # some bodies, some headers
        return v[:pos] + bytes([v[pos] ^ 0x5A]) + v[pos + 1:]

    assert rewrite_stored_blocks(tmp_path / "lmdb", flip) == 6
    with make_store(tmp_path) as store:
        assert store.lookup(keys) == 6, "lookup only asks for presence"
        ok, outs = load(store, keys)
        assert ok == [False] * 6
        assert all(not o.any() for o in outs), "nothing decoded from a corrupt block reaches the caller"
        assert store.metrics.misses("corrupt") == 6
        assert store.lookup(keys) == 0, "corrupt blocks are removed once found"


def test_truncated_lmdb_values_are_corrupt_misses(tmp_path):
    keys = keys_for(3)
    with make_store(tmp_path) as store:
        store.save(keys, payloads(store, 3))
        store.flush()
    rewrite_stored_blocks(tmp_path / "lmdb", lambda k, v: v[: len(v) // 2])
    with make_store(tmp_path) as store:
        ok, _ = load(store, keys)
        assert ok == [False] * 3
        assert store.metrics.misses("corrupt") == 3


def test_block_stored_under_another_namespace_is_a_namespace_mismatch_miss(tmp_path):
    from dataclasses import replace

    keys = keys_for(2)
    with make_store(tmp_path) as store:
        store.save(keys, payloads(store, 2))
        store.flush()
    other = replace(NS, model_id="another-model").digest()

    def reown(k: bytes, v: bytes) -> bytes:
        header = BlockCodec.read_header(v)
        shape = header.shape
        codec = BlockCodec("raw")
        raw = BlockCodec().decode(v)[1]
        return codec.encode(raw, dtype=header.dtype, shape=shape, namespace=other, key=header.key)

    rewrite_stored_blocks(tmp_path / "lmdb", reown)
    with make_store(tmp_path) as store:
        ok, _ = load(store, keys)
        assert ok == [False, False]
        assert store.metrics.misses("namespace_mismatch") == 2


def test_redis_killed_mid_test_store_serves_host_and_disk_then_uses_redis_again(tmp_path, own_redis,
                                                                                monkeypatch):
    keys = keys_for(8)
    with make_store(tmp_path, host="64KiB", remote_url=own_redis.url) as store:
        data = payloads(store, 8)
        store.save(keys[:4], data[:4])
        store.flush()
        assert store.tier("remote").contains(keys[:4]) == [True] * 4
        own_redis.stop()
        made = _connects_per_thread(monkeypatch)
        store.save(keys[4:], data[4:])
        store.flush()
        assert store.lookup(keys) == 8, "host and disk keep serving"
        ok, outs = load(store, keys)
        assert all(ok) and all(torch.equal(a, b) for a, b in zip(data, outs))
        # nothing waited on the dead Redis (counted, not timed): a thread's first call is refused
        # at most 1 + retries times, then the open breaker refuses every later call unsent
        retries = store.tier("remote").backend.retries
        assert all(len(tries) <= 1 + retries for tries in made.values()), made
        monkeypatch.undo()
        remote = store.metrics.snapshot()["tiers"]["remote"]
        assert store.metrics.events["remote_save_failed"] == 4  # the writes Redis missed, counted once
        # regression: the save's presence check counted 4 remote_unavailable misses, though no
        # block was asked of Redis (host and disk served every load): the hit rate fell for nothing
        assert sum(remote["misses"].values()) == 0 and remote["hits"] == 0
        own_redis.start()  # empty again
        deadline = time.monotonic() + 10
        while store.tier("remote").contains(keys[:1]) != [False] or not _remote_put_works(store, keys):
            assert time.monotonic() < deadline, "remote tier did not come back"
            time.sleep(0.2)
        assert store.tier("remote").contains(keys[-2:]) == [True, True]


def _connects_per_thread(monkeypatch) -> dict[str, list[object]]:
    """thread name -> the Redis connections it made from now on, but the breaker's background
    probe (which keeps trying while Redis is away: it is no caller)."""
    made: dict[str, list[object]] = {}
    connect = redis.connection.Connection._connect

    def counted_connect(conn):
        name = threading.current_thread().name
        if name != "tiered-kv-redis-probe":
            made.setdefault(f"{name}/{threading.get_ident()}", []).append(conn)
        return connect(conn)

    monkeypatch.setattr(redis.connection.Connection, "_connect", counted_connect)
    return made


def _remote_put_works(store, keys) -> bool:
    tier = store.tier("remote")
    payload = torch.zeros(store.shape, dtype=store.dtype)
    blob = tier.encode(keys[-1], payload.view(torch.uint8).numpy())
    blob2 = tier.encode(keys[-2], payload.view(torch.uint8).numpy())
    return all(tier.put_blobs([(keys[-1], blob), (keys[-2], blob2)], 2 * store.block_nbytes))


def test_remote_hit_is_loaded_and_copied_down_to_disk(tmp_path, redis_url):
    keys = keys_for(4)
    with make_store(tmp_path / "a", remote_url=redis_url) as store:
        data = payloads(store, 4)
        store.save(keys, data)
        store.flush()
    with make_store(tmp_path / "b", remote_url=redis_url) as replica:  # another replica, empty disk
        assert replica.locate(keys) == ["remote"] * 4
        ok, outs = load(replica, keys)
        assert all(ok) and all(torch.equal(a, b) for a, b in zip(data, outs))
        replica.flush()
        assert replica.tier("disk").contains(keys) == [True] * 4


def test_regression_a_store_whose_constructor_failed_after_opening_its_tiers_left_threads_running(
        tmp_path, monkeypatch):
    # metrics_port without prometheus-client: ConfigError after the pool, the tiers and the
    # cost recorder had started; their threads and the LMDB environment stayed in the process
    monkeypatch.setitem(sys.modules, "tiered_kv.store.prometheus", None)  # not installed
    before = {t.ident for t in threading.enumerate()}
    with pytest.raises(ConfigError):
        make_store(tmp_path, metrics_port=0)
    assert [t.name for t in threading.enumerate() if t.ident not in before and t.is_alive()] == []
    with make_store(tmp_path) as store:  # and the directory opens again at once
        assert store.lookup([b"x" * 32]) == 0


def test_regression_a_save_after_close_was_counted_as_written_to_the_host_tier_and_stored_nowhere(tmp_path):
    store = make_store(tmp_path)
    keys = keys_for(3)
    batch = store.prepare_save(keys[:1])
    store.close()
    assert store.commit_save(batch) is None  # an engine shutting down gets no error...
    assert store.save(keys[1:2], payloads(store, 1)) is None
    assert store.prepare_save(keys[2:]).keys == []
    assert store.metrics.events["saves_after_close"] == 3  # ...and the drop is counted
    store.commit_save(batch, ok=False)  # rolling back is still allowed
