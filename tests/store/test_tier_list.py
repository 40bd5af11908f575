"""Lower tiers come from the config as an ordered list: a medium added through config alone
takes part in saves, lookups, loads and copies back up like the built-in ones."""

from __future__ import annotations

import threading

import pytest
import torch

from tests.store.helpers import NS, keys_for, load, make_store, payloads
from tiered_kv.config import TieredKVConfig
from tiered_kv.errors import ConfigError


def archive(tmp_path, **settings) -> list[dict]:
    return [{"name": "archive", "url": f"file://{tmp_path}/archive", **settings}]


def test_a_file_medium_added_as_a_third_tier_by_config_carries_a_block_there_and_back(tmp_path):
    with make_store(tmp_path, host="64KiB", tiers=archive(tmp_path)) as store:  # 4 host slots
        assert [t.name for t in store.tiers] == ["disk", "archive"]
        keys = keys_for(4)
        data = payloads(store, 4)
        store.save(keys, data)
        store.flush()
        assert store.tier("archive").contains(keys) == [True] * 4  # host -> disk -> file
        store.save(keys_for(4, first_token=10_000), payloads(store, 4, seed=1))  # host evicts
        store.flush()
        store.tier("disk").backend.delete_many([store.tier("disk").ns + k for k in keys])
        assert store.locate(keys) == ["archive"] * 4
        assert store.lookup(keys) == 4

        ok, outs = load(store, keys)  # file -> the caller, and copied back up into the disk tier

        assert all(ok) and all(torch.equal(a, b) for a, b in zip(data, outs))
        assert store.metrics.snapshot()["tiers"]["archive"]["hits"] == 4
        store.flush()  # the copies up are write-behind
        assert store.tier("disk").contains(keys) == [True] * 4
        assert store.locate(keys) == ["disk"] * 4
        assert "archive" in store.stats()["backends"]


def test_the_third_tier_survives_a_restart_and_serves_a_new_process(tmp_path):
    keys = keys_for(3)
    with make_store(tmp_path, tiers=archive(tmp_path)) as store:
        data = payloads(store, 3)
        store.save(keys, data)
    with make_store(tmp_path, disk=None, tiers=archive(tmp_path)) as store:  # no disk tier now
        assert [t.name for t in store.tiers] == ["archive"]
        ok, outs = load(store, keys)
        assert all(ok) and all(torch.equal(a, b) for a, b in zip(data, outs))


def test_a_tier_list_entry_is_checked_like_any_section(tmp_path):
    with pytest.raises(ConfigError, match="x.policy must be one of"):
        TieredKVConfig.from_dict({"tiers": [{"name": "x", "url": "file:///tmp/x", "policy": "sometimes"}]})
    with pytest.raises(ConfigError, match="name"):
        TieredKVConfig.from_dict({"tiers": [{"url": "file:///tmp/x"}]})
    with pytest.raises(ConfigError, match="two lower tiers are named 'disk'"):
        TieredKVConfig.from_dict({"tiers": [{"name": "disk", "url": "file:///tmp/x"}]})
    with pytest.raises(ConfigError, match="no storage backend"):
        TieredKVConfig.from_dict({"tiers": [{"name": "s3", "url": "s3://bucket/kv"}]})
    with pytest.raises(ConfigError, match="list of tables"):
        TieredKVConfig.from_dict({"tiers": {"name": "x"}})


def test_tiers_from_toml_keep_their_order_and_medium_settings(tmp_path):
    path = tmp_path / "tkv.toml"
    path.write_text(f'''
[disk]
url = "lmdb://{tmp_path}/lmdb"
[[tiers]]
name = "nfs"
url = "file://{tmp_path}/nfs"
capacity = "1GiB"
options = {{ sync = true }}
[[tiers]]
name = "cold"
url = "file://{tmp_path}/cold"
policy = "on_evict"
''')
    config = TieredKVConfig.from_toml(path)
    assert [t.name for t in config.lower_tiers] == ["disk", "nfs", "cold"]
    assert config.lower_tiers[1].medium_options() == {"sync": True, "capacity": 1 << 30}
    assert hash(config) == hash(TieredKVConfig.from_toml(path))  # configs key shared stores
    with TieredStore_of(config) as store:
        assert store.tier("nfs").backend.sync is True
        assert store.tier("cold").policy == "on_evict"


def TieredStore_of(config):
    from tiered_kv.store import TieredStore

    return TieredStore(config, NS)


def test_a_block_withdrawn_while_it_is_being_loaded_is_not_copied_back_up(tmp_path):
    tiers = [{"name": "shared", "url": f"file://{tmp_path}/shared"}]
    keys = keys_for(2)
    with make_store(tmp_path, disk=None, tiers=tiers) as other_replica:
        other_replica.save(keys, payloads(other_replica, 2))
    with make_store(tmp_path, tiers=tiers, workers=4) as store:
        reached, go = threading.Event(), threading.Event()
        copy_up = store.loader.reader._copy_up

        def held_copy_up(*args):
            reached.set()
            go.wait(10)
            return copy_up(*args)

        store.loader.reader._copy_up = held_copy_up
        plan = store.load(store.prepare_load(keys))
        assert reached.wait(10)
        withdrawn = store.invalidate(keys)  # the scheduler learned their KV may be wrong
        go.set()
        withdrawn.result(10)
        plan.wait(10)
        store.release(plan)
        store.flush()
        assert store.tier("disk").contains(keys) == [False, False]
        assert store.tier("shared").contains(keys) == [False, False]
        assert store.lookup(keys) == 0


@pytest.mark.parametrize("staged", [True, False], ids=["through_host_slots", "into_callers_memory"])
def test_a_load_served_by_a_lower_tier_does_not_wait_for_its_copy_up(tmp_path, staged):
    """A Redis or shared-tier hit warms the local disk, but the engine's restore ended only once
    that disk write had: every cross-replica restore paid a disk write on top of its read."""
    tiers = [{"name": "shared", "url": f"file://{tmp_path}/shared"}]
    keys = keys_for(3)
    with make_store(tmp_path, disk=None, tiers=tiers) as other_replica:
        data = payloads(other_replica, 3)
        other_replica.save(keys, data)
    with make_store(tmp_path, tiers=tiers, workers=4) as store:
        disk, disk_writes = store.tier("disk").backend, threading.Event()
        put_many = disk.put_many
        disk.put_many = lambda *args, **kwargs: disk_writes.wait(30) and put_many(*args, **kwargs)
        served = {}

        def restore() -> None:
            if staged:
                plan = store.load(store.prepare_load(keys)).wait(30)
                served["ok"] = plan.ok
                store.release(plan)
            else:
                served["ok"] = load(store, keys)[0]

        engine = threading.Thread(target=restore)
        engine.start()
        engine.join(10)  # a restore waiting for its copy up waits until the 30 s gate gives way
        assert not engine.is_alive(), "the restore waited for the disk tier's copy"
        assert served["ok"] == [True] * 3
        assert store.tier("disk").contains(keys) == [False] * 3
        disk_writes.set()
        store.flush()
        assert store.tier("disk").contains(keys) == [True] * 3  # the copy up landed after
        disk.put_many = put_many
        store.host.delete_many(keys)
        store.tier("shared").backend.delete_many([store.tier("shared").ns + k for k in keys])
        ok, outs = load(store, keys)
        assert ok == [True] * 3 and all(torch.equal(o, d) for o, d in zip(outs, data))


def test_two_loads_of_the_same_blocks_copy_them_up_once(tmp_path):
    tiers = [{"name": "shared", "url": f"file://{tmp_path}/shared"}]
    keys = keys_for(3)
    with make_store(tmp_path, disk=None, tiers=tiers) as other_replica:
        other_replica.save(keys, payloads(other_replica, 3))
    with make_store(tmp_path, tiers=tiers, workers=1) as store:
        disk, first_write, written = store.tier("disk").backend, threading.Event(), []
        put_many = disk.put_many

        def held_put(items, **kwargs):
            first_write.wait(30)  # the first copy up waits here while the second load queues its own
            written.extend(k for k, _ in items if not k.startswith(b"tkv-ns:"))  # (not the namespace record)
            return put_many(items, **kwargs)

        disk.put_many = held_put
        assert load(store, keys)[0] == [True] * 3
        assert load(store, keys)[0] == [True] * 3  # the disk does not hold them yet: shared again
        first_write.set()
        store.flush()
        assert sorted(written) == sorted(store.tier("disk").ns + k for k in keys)


def test_a_restore_larger_than_the_write_behind_budget_still_copies_every_block_up(tmp_path):
    """Copies up queue as write-behind within its budget; past it they were dropped, so a large
    cross-replica restore warmed the local disk with only its first part. They are written at
    once then (the restore waits for that part of the disk write instead)."""
    tiers = [{"name": "shared", "url": f"file://{tmp_path}/shared"}]
    first, second = keys_for(2), keys_for(2, first_token=5_000)
    with make_store(tmp_path, disk=None, tiers=tiers) as other_replica:
        other_replica.save(first + second, payloads(other_replica, 4))
    with make_store(tmp_path, tiers=tiers, max_inflight_save=1) as store:  # one job in flight at a time
        disk, first_written = store.tier("disk").backend, threading.Event()
        put_many, held = disk.put_many, {store.tier("disk").ns + k for k in first}

        def put(items, **kwargs):
            if held & {k for k, _ in items}:
                first_written.wait(30)  # the first copy up holds the whole budget meanwhile
            return put_many(items, **kwargs)

        disk.put_many = put
        assert load(store, first)[0] == [True] * 2
        assert load(store, second)[0] == [True] * 2
        assert store.tier("disk").contains(second) == [True, True]  # written by the restore itself
        first_written.set()
        store.flush()
        assert store.tier("disk").contains(first) == [True, True]
        assert store.metrics.events.get("saves_dropped", 0) == 0
