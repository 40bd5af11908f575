"""A lower tier's tenant quota below one block would refuse every block of its tenants for good
(seen only as the medium's ``put_rejected``): the store refuses it as it opens, naming the setting,
wherever the quota was written (the field, the URL's query, per-tenant options)."""

from __future__ import annotations

import pytest

from tests.store.helpers import NS, make_store
from tiered_kv.config import DiskConfig, TieredKVConfig
from tiered_kv.errors import ConfigError
from tiered_kv.store import TieredStore


def test_regression_a_disk_tenant_quota_below_one_block_refused_every_block_of_its_tenants(tmp_path):
    with pytest.raises(ConfigError, match=r"disk\.tenant_quota 1(\.0)? KiB holds no block"):
        make_store(tmp_path, disk={"tenant_quota": "1KiB"})


def test_a_quota_below_one_block_in_the_disk_url_is_refused_as_the_store_opens(tmp_path):
    config = TieredKVConfig(disk=DiskConfig(url=f"lmdb://{tmp_path}/db?tenant_quota=4KiB", capacity=64 << 20))
    with pytest.raises(ConfigError, match=r"disk\.tenant_quota 4(\.0)? KiB"):
        TieredStore(config, NS)


def test_a_per_tenant_quota_below_one_block_is_refused_by_its_label(tmp_path):
    config = TieredKVConfig(disk=DiskConfig(url=f"lmdb://{tmp_path}/db", capacity=64 << 20,
                                            options={"tenant_quotas": {b"team-a": "2KiB", b"team-b": "1MiB"}}))
    with pytest.raises(ConfigError, match=r"disk\.options\.tenant_quotas\[b'team-a'\]"):
        TieredStore(config, NS)


def test_quotas_of_a_block_or_more_open_and_hold_blocks(tmp_path):
    with make_store(tmp_path, disk={"tenant_quota": "1MiB"}) as store:
        assert store.tier("disk") is not None
