"""A tool's open of a config's tier hands its medium the settings the engine's store opens it
with (``TierConfig.medium_options``: the tier's own fields such as ``[disk] sync`` and
``[remote] ttl``, its quotas, its options table), and the medium reads them itself: a record
``verify --fix`` rewrites expires as the engine's do, a tool's LMDB or file medium keeps the
config's tenant quotas. Real LMDB and file stores under tmp_path, a real redis-server."""

from __future__ import annotations

import dataclasses
import json

import pytest
import redis

from storage_backends.registry import open_backend
from tests.cli.conftest import cli
from tests.store.helpers import NS
from tiered_kv.admin.opening import open_config
from tiered_kv.config import TieredKVConfig
from tiered_kv.store.records import namespace_key

ALICE = bytes.fromhex("a11ce00000000001")


def test_regression_a_record_verify_fix_rewrote_into_redis_got_no_ttl(redis_url, tmp_path):
    # [remote] ttl is a field of the config, not of its options table: the tool's URL carried
    # only the table, so the record verify --fix rewrote (without its salt) never expired
    salted = dataclasses.replace(NS, cache_salt="tenant-42-private-salt")
    key = namespace_key(salted.digest())
    writer = open_backend(redis_url)  # (an older version's record: the salt in the clear, no ttl)
    try:
        assert writer.put_many([(key, json.dumps(salted.describe(), sort_keys=True).encode())]) == [True]
    finally:
        writer.close()
    config = tmp_path / "tkv.toml"
    config.write_text(f'[remote]\nurl = "{redis_url}"\nttl = "1h"\n')
    fixed = cli("verify", "--config", config, "--fix", "--json")
    assert fixed.code in (0, 1), fixed.err  # (1: a record with no blocks is only a note)
    assert any("without their cache_salt" in a for a in fixed.json()["tiers"][0]["actions"]), fixed.out
    client = redis.Redis.from_url(redis_url)
    try:
        assert b"private-salt" not in client.get(b"tkv:" + key)
        assert 0 < client.ttl(b"tkv:" + key) <= 3600  # (-1: no expiry)
    finally:
        client.close()


@pytest.mark.parametrize("scheme", ["lmdb", "file"])
def test_regression_a_configs_sync_and_tenant_quotas_did_not_reach_a_tools_medium(tmp_path, scheme):
    # the tools folded only the options table into the URL: a tier's sync, its tenant_quota
    # field and its tenant_quotas table never reached the medium a tool opened (a tool's
    # writes, verify --fix and evict, went unsynced and unbounded; only the figures shown had
    # the quotas)
    url = f"{scheme}://{tmp_path / 'store'}"
    open_backend(url).close()
    config = tmp_path / "tkv.toml"
    config.write_text(f'[[tiers]]\nname = "t"\nurl = "{url}"\ntenant_quota = "8000"\n'
                      f'[tiers.options]\nsync = true\ntenant_quotas = {{ "{ALICE.hex()}" = "2000" }}\n')
    (section,) = TieredKVConfig.from_toml(config).lower_tiers
    engine_side = open_backend(section.url, **section.medium_options())
    try:
        wanted = (engine_side.sync, engine_side.quotas)
    finally:
        engine_side.close()
    assert wanted[0] is True and wanted[1].of(ALICE) == 2000
    (tier,) = open_config(str(config))
    try:
        assert (tier.backend.sync, tier.backend.quotas) == wanted
    finally:
        tier.close()


def test_regression_a_disk_sections_own_sync_did_not_reach_a_tools_lmdb_medium(tmp_path):
    # [disk] sync = true is a field of the section (not of [disk.options]): a tool's fix and
    # evict committed without fsync on a store its engine syncs
    url = f"lmdb://{tmp_path / 'store'}"
    open_backend(url).close()
    config = tmp_path / "tkv.toml"
    config.write_text(f'[disk]\nurl = "{url}"\nsync = true\ncapacity = "64MiB"\n')
    (tier,) = open_config(str(config))
    try:
        assert tier.backend.sync is True and tier.capacity == 64 << 20
        assert tier.backend.capacity is None  # (a tool's open evicts to no capacity)
    finally:
        tier.close()


def test_a_tools_read_of_a_config_with_a_ttl_a_capacity_and_quotas_changes_nothing(redis_url, tmp_path):
    # the engine's settings now reach a tool's medium: its reads still touch no file's times,
    # set no TTL and make nothing
    files = f"file://{tmp_path / 'files'}"
    for url in (files, redis_url):
        writer = open_backend(url)
        try:
            assert all(writer.put_many([(b"k-%d" % i, b"v" * 100) for i in range(3)], tenant=ALICE))
        finally:
            writer.close()
    config = tmp_path / "tkv.toml"
    config.write_text(f'[remote]\nurl = "{redis_url}"\nttl = "1h"\n'
                      f'[[tiers]]\nname = "f"\nurl = "{files}"\ncapacity = "1MiB"\ntenant_quota = "200"\n'
                      f'[tiers.options]\nsync = true\n')

    def times() -> dict:  # (a listing reads directories: their access times are not the store's)
        return {p: (p.is_dir() or p.stat().st_atime_ns, p.stat().st_mtime_ns) for p in (tmp_path / "files").rglob("*")}

    before = times()
    for command in ("inspect", "ls", "verify"):  # (verify: 1, the values are no blocks)
        result = cli(command, "--config", config, "--json")
        assert (result.code, result.err) == (1 if command == "verify" else 0, ""), command
    assert times() == before
    client = redis.Redis.from_url(redis_url)
    try:
        assert [client.ttl(b"tkv:k-%d" % i) for i in range(3)] == [-1, -1, -1]
    finally:
        client.close()
