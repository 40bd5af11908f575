"""Per-tenant quotas of a lower tier (``options.tenant_quotas``, a mapping of labels, bytes or their
hex as ``tiered-kv inspect`` shows them, to sizes) keep the config hashable (the integrations share
one store per (config, namespace) in a dict), a TOML file can write them (its table keys are text),
and a table the medium would refuse (text that is no hex label, sizes that are not positive) is
refused as the config is built, naming the setting, not as the tier opens in an engine's worker."""

from __future__ import annotations

import pytest

from tiered_kv.config import DiskConfig, TierConfig, TieredKVConfig
from tiered_kv.errors import ConfigError
from tiered_kv.keys import tenant_label

A = b"tenant-a"


def test_a_config_with_per_tenant_quotas_is_hashable(tmp_path):
    """Its options were hashed as JSON, which has no bytes keys: TypeError."""
    disk = DiskConfig(url=f"lmdb://{tmp_path}/db", options={"tenant_quotas": {A: "1GiB"}})
    config = TieredKVConfig(disk=disk)
    again = TieredKVConfig(disk=DiskConfig(url=f"lmdb://{tmp_path}/db", options={"tenant_quotas": {A: "1GiB"}}))
    assert {config: 1}[again] == 1
    other = TieredKVConfig(disk=DiskConfig(url=f"lmdb://{tmp_path}/db", options={"tenant_quotas": {A: "2GiB"}}))
    assert other != config


@pytest.mark.parametrize(("quotas", "match"), [
    ({"tenant-a": "1GiB"}, "disk.options.tenant_quotas: a tenant label written as text is its hex"),
    ({"00" * 17: "1GiB"}, "disk.options.tenant_quotas: a tenant label has at most 16 bytes"),
    ({b"\xab": "1GiB", "ab": "2GiB"}, "names the tenant ab twice"),
    ({"AB": "1GiB", "ab": "2GiB"}, "names the tenant ab twice"),
    ({A: 0}, "disk.options.tenant_quotas: .*must be positive"),
    ({A: "lots"}, "disk.options.tenant_quotas"),
    ("tenant-a=1GiB", "disk.options.tenant_quotas: .*mapping"),
])
def test_per_tenant_quotas_the_medium_would_refuse_are_refused_as_the_config_is_built(quotas, match, tmp_path):
    with pytest.raises(ConfigError, match=match):
        DiskConfig(url=f"lmdb://{tmp_path}/never-made", options={"tenant_quotas": quotas})
    assert not (tmp_path / "never-made").exists()


def test_regression_a_toml_file_could_not_give_a_tenant_its_own_quota(tmp_path):
    """A TOML table's labels are text, and a label was bytes only: no config file could."""
    alice = tenant_label("alice's salt")
    path = tmp_path / "tkv.toml"
    path.write_text(f'[disk]\nurl = "lmdb://{tmp_path}/db"\ntenant_quota = "4GiB"\n'
                    f'[disk.options.tenant_quotas]\n"{alice.hex()}" = "1GiB"\n"" = "2GiB"\n')
    quotas = TieredKVConfig.from_toml(path).disk.quotas()
    assert quotas.of(alice) == 1 << 30
    assert quotas.of(b"") == 2 << 30, "unlabelled blocks: the empty label"
    assert quotas.of(tenant_label("bob")) == 4 << 30


def test_a_toml_tenant_label_that_is_no_hex_is_refused_as_the_config_loads(tmp_path):
    path = tmp_path / "tkv.toml"
    path.write_text(f'[[tiers]]\nname = "archive"\nurl = "file://{tmp_path}/files"\n'
                    'options = { tenant_quotas = { "tenant-a" = "1GiB" } }\n')
    with pytest.raises(ConfigError, match="archive.options.tenant_quotas: a tenant label written as text is its hex"):
        TieredKVConfig.from_toml(path)


def test_valid_per_tenant_quotas_pass_and_reach_the_medium(tmp_path):
    tier = TierConfig(name="archive", url=f"file://{tmp_path}/files", options={"tenant_quotas": {A: "1GiB"}})
    assert tier.medium_options()["tenant_quotas"] == {A: "1GiB"}
