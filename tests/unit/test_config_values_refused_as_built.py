"""Settings the tiers would refuse as they open are refused as the config is built, naming the
setting: a config built from a TOML file or ``TIERED_KV_*`` variables used to pass, and fail
only in the engine's worker when the tier opened (or, for an empty variable, mean something
other than its default)."""

from __future__ import annotations

import pytest

from tiered_kv.config import TieredKVConfig
from tiered_kv.errors import ConfigError

URL = "redis://127.0.0.1:6379/0"  # (building a config connects nowhere)


@pytest.mark.parametrize(("remote", "named"), [
    ({"options": {"max_connections": "0"}}, "max_connections"),
    ({"url": f"{URL}?max_connections=0"}, "max_connections"),
    ({"options": {"node_threads": 999}}, "node_threads"),
    ({"options": {"pipeline_bytes": "lots"}}, "pipeline_bytes"),
    ({"options": {"cluster": "maybe"}}, "cluster"),
    ({"url": f"{URL}?read_from_replicas=perhaps"}, "read_from_replicas"),
    ({"options": {"read_from_replicas": True}}, "read_from_replicas"),  # (not a cluster)
    ({"tenant_quota": "1GiB"}, "tenant_quota"),  # Redis keeps no per-tenant quotas
    ({"options": {"prefix": 5}}, "prefix"),  # (became bytes(5): five NUL bytes)
])
def test_regression_a_redis_option_value_the_tier_refuses_was_a_config_until_the_engine_opened_it(remote, named):
    with pytest.raises(ConfigError, match=f"remote: redis {named}"):
        TieredKVConfig.from_dict({"remote": {"url": URL, **remote}})


def test_redis_option_values_the_tier_takes_still_build():
    config = TieredKVConfig.from_dict({"remote": {
        "url": f"{URL}?max_connections=8&pipeline_bytes=4MiB",
        "options": {"prefix": "tkv-a:", "node_threads": 4, "cluster": "no", "read_from_replicas": "off"}}})
    assert config.remote.options["prefix"] == "tkv-a:"
    cluster = TieredKVConfig.from_dict({"remote": {"url": "redis+cluster://127.0.0.1:7000/0",
                                                   "options": {"read_from_replicas": True}}})
    assert cluster.remote.options["read_from_replicas"] is True


def test_regression_an_empty_close_timeout_variable_meant_waiting_for_ever_at_close():
    # TIERED_KV_CLOSE_TIMEOUT=$UNSET gives "": it was read as None (close waits for ever on a
    # hung tier), not the 30 s default; "none" still says wait for ever
    with pytest.raises(ConfigError, match="close_timeout is empty"):
        TieredKVConfig.load(None, {"TIERED_KV_CLOSE_TIMEOUT": ""})
    with pytest.raises(ConfigError, match="close_timeout is empty"):
        TieredKVConfig.from_dict({"close_timeout": "  "})
    assert TieredKVConfig.load(None, {"TIERED_KV_CLOSE_TIMEOUT": "none"}).close_timeout is None
    assert TieredKVConfig.load(None, {}).close_timeout == 30.0


def test_empty_variables_of_settings_whose_default_is_none_still_mean_their_default():
    config = TieredKVConfig.load({"disk": {"url": "lmdb:///tmp/tkv-never-opened"}},
                                 {"TIERED_KV_METRICS_PORT": "", "TIERED_KV_DISK_SYNC": "",
                                  "TIERED_KV_HOST_TENANT_QUOTA": "", "TIERED_KV_CACHE_SALT": ""})
    assert config.metrics_port is None and config.disk.sync is False
    assert config.host.tenant_quota is None and config.cache_salt == ""
