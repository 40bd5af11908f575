"""Byte quotas per tenant (``cache_salt``) per tier, through the store: a tenant over its quota
evicts its own least recently used blocks, never another tenant's, in the host tier and in the
disk tier, and the disk tier's accounting survives a restart."""

from __future__ import annotations

import urllib.request
from dataclasses import replace

import pytest
import torch

from tests.store.helpers import NS, keys_for, load, make_store, payloads
from tiered_kv.config import TieredKVConfig
from tiered_kv.errors import ConfigError
from tiered_kv.keys import tenant_label
from tiered_kv.store import TieredStore

A, B = tenant_label("tenant-a"), tenant_label("tenant-b")
BLOCK = 16 << 10  # raw 16 KiB blocks (+ a small header when stored)
QUOTA = 4 * BLOCK + 2048  # four stored blocks


def quota_store(tmp_path, **extra):
    return make_store(tmp_path, disk={"codec": "raw", "tenant_quota": QUOTA}, **extra)


def save_in_turn(store, keys, data, tenant) -> None:
    """Requests one after another: write-behind order (so LRU order) follows the keys."""
    for key, block in zip(keys, data):
        store.save([key], [block], tenant=tenant)
        store.flush()


def test_a_tenant_over_its_disk_quota_never_evicts_another_tenants_blocks(tmp_path):
    a_keys, b_keys = keys_for(10), keys_for(4, first_token=90_000)
    with quota_store(tmp_path) as store:
        b_data = payloads(store, 4, seed=1)
        save_in_turn(store, b_keys, b_data, B)
        save_in_turn(store, a_keys, payloads(store, 10), A)
        disk = store.tier("disk")
        assert disk.contains(b_keys) == [True] * 4
        assert disk.contains(a_keys) == [False] * 6 + [True] * 4  # A paid with its own oldest
        usage = disk.backend.tenant_usage()
        assert usage[A] <= QUOTA and usage[B] <= QUOTA and usage[A] > 3 * BLOCK
        assert disk.backend.stats().extra["quota_evictions"] == 6


def test_quotas_and_usage_survive_a_restart_of_the_lmdb_tier(tmp_path):
    a_keys, b_keys = keys_for(6), keys_for(4, first_token=90_000)
    with quota_store(tmp_path) as store:
        b_data = payloads(store, 4, seed=1)
        save_in_turn(store, b_keys, b_data, B)
        save_in_turn(store, a_keys, payloads(store, 6), A)
        before = store.tier("disk").backend.tenant_usage()
    with quota_store(tmp_path) as store:  # a new process: nothing in host memory
        disk = store.tier("disk")
        assert disk.backend.tenant_usage() == before
        more = keys_for(3, first_token=50_000)
        save_in_turn(store, more, payloads(store, 3, seed=2), A)
        assert disk.contains(more) == [True] * 3
        assert disk.contains(a_keys) == [False] * 5 + [True]  # still only A's own blocks go
        ok, outs = load(store, b_keys)
        assert all(ok) and all(torch.equal(a, b) for a, b in zip(b_data, outs))


def test_a_tenant_over_its_host_quota_keeps_the_other_tenants_host_blocks(tmp_path):
    a_keys, b_keys = keys_for(8), keys_for(3, first_token=90_000)
    config = TieredKVConfig.from_dict({"host": {"capacity": "1MiB", "tenant_quota": 4 * BLOCK}})
    with TieredStore(config, NS) as store:
        store.save(b_keys, payloads(store, 3, seed=1), tenant=B)
        a_data = payloads(store, 8)
        for i in range(0, 8, 2):  # requests arrive one after another
            store.save(a_keys[i : i + 2], a_data[i : i + 2], tenant=A)
        assert store.host.contains_many(b_keys) == [True] * 3
        assert store.host.contains_many(a_keys) == [False] * 4 + [True] * 4
        assert store.host.tenant_usage() == {A: 4 * BLOCK, B: 3 * BLOCK}



def test_regression_a_host_tenant_quota_under_one_block_silently_cached_no_tenants_blocks():
    """Every labelled tenant's save found no room (counted, nothing said): the setting turned
    caching off for them. It is refused where the block size is known."""
    config = TieredKVConfig.from_dict({"host": {"capacity": "1MiB", "tenant_quota": BLOCK // 2}})
    with pytest.raises(ConfigError, match="host.tenant_quota 8.0 KiB holds no block"):
        TieredStore(config, NS)


def test_blocks_of_a_namespace_with_a_cache_salt_are_that_tenants(tmp_path):
    with quota_store(tmp_path, ns=replace(NS, cache_salt="tenant-a")) as store:
        store.save(keys_for(2), payloads(store, 2))
        store.flush()
        usage = store.tier("disk").backend.tenant_usage()
        assert usage[A] > 2 * BLOCK
        assert usage.get(b"", 0) < 1024  # only the namespace record, which is no tenant's


def test_metrics_show_quota_evictions_usage_per_tenant_and_skipped_admissions(tmp_path):
    from tiered_kv.store.prometheus import export, unexport

    with make_store(tmp_path, disk={"codec": "raw", "tenant_quota": QUOTA, "admit_after_hits": 1},
                    tiers=[{"name": "ssd2", "url": f"file://{tmp_path}/f", "admit_after_hits": 2}]) as store:
        store.save(keys_for(6), payloads(store, 6), tenant=A)
        store.flush()
        port = export(store, 0, "127.0.0.1")
        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        finally:
            unexport(store)
    lines = [line for line in text.splitlines() if not line.startswith("#")]
    assert any(line.startswith("tiered_kv_quota_evictions_total") and 'tier="disk"' in line
               and line.endswith(" 2.0") for line in lines)
    assert any(line.startswith("tiered_kv_tenant_used_bytes") and f'tenant="{A.hex()}"' in line
               for line in lines)
    assert any('event="admission_skipped"' in line and line.endswith(" 6.0") for line in lines)


def test_a_block_a_lease_earns_a_tier_for_is_charged_to_the_leasing_tenant(tmp_path):
    with make_store(tmp_path, disk={"admit_after_hits": 2}) as store:
        keys = keys_for(3)
        store.save(keys, payloads(store, 3), tenant=A)  # request 1 (the worker saves it)
        plan = store.lease("request-2", keys, A)  # request 2: the scheduler half leases it
        store.release(store.take_lease("request-2", keys, A))
        store.release(plan)
        store.flush()
        usage = store.tier("disk").backend.tenant_usage()
        assert usage[A] > 2 * BLOCK and usage.get(b"", 0) < 1024


def test_a_salt_per_user_does_not_make_a_metrics_series_per_user(tmp_path):
    from tiered_kv.store.prometheus import TENANT_SERIES, export, unexport

    tenants = [tenant_label(f"user-{i}") for i in range(TENANT_SERIES + 8)]
    with make_store(tmp_path, disk={"codec": "raw"}) as store:
        for i, tenant in enumerate(tenants):  # user i saves i + 1 blocks: the larger users rank first
            keys = keys_for(i + 1, first_token=1000 * (i + 1))
            store.save(keys, payloads(store, i + 1, seed=i), tenant=tenant)
            store.flush()  # one user at a time: a 1 MiB host tier full of unwritten blocks refuses saves
        events = store.metrics.snapshot()["events"]
        assert events.get("saves_no_room", 0) == 0 and events.get("saves_dropped", 0) == 0
        usage = store.tier("disk").backend.tenant_usage()
        port = export(store, 0, "127.0.0.1")
        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        finally:
            unexport(store)
    series = {}
    for line in text.splitlines():
        if line.startswith("tiered_kv_tenant_used_bytes{") and 'tier="disk"' in line:
            label = line.split('tenant="')[1].split('"')[0]
            series[label] = float(line.rsplit(" ", 1)[1])
    assert len(series) == TENANT_SERIES + 1
    largest = sorted(usage, key=usage.get, reverse=True)[:TENANT_SERIES]
    assert {t.hex() or "-" for t in largest} | {"other"} == set(series)
    assert series["other"] == sum(usage.values()) - sum(usage[t] for t in largest)
    assert sum(series.values()) == sum(usage.values())  # nobody's bytes go unreported
