"""A medium option no medium knows (``lmdb:///x?no_such=1``, ``redis://h?bogus=2``) is refused as
the config is built, from a dict, a TOML file or the environment, naming the tier: it was a
config until the tier opened, in an engine's worker. The tenant's ``cache_salt`` (a secret) is in
no repr of a config."""

from __future__ import annotations

import pytest

from tiered_kv.config import TieredKVConfig
from tiered_kv.errors import ConfigError

UNKNOWN = {  # section: (settings, what the refusal names)
    "lmdb_query": ({"disk": {"url": "lmdb:///tmp/tkv-never-made?no_such=1"}}, "disk: unknown lmdb option 'no_such'"),
    "lmdb_options": ({"disk": {"url": "lmdb:///tmp/tkv-never-made", "options": {"no_such": 1}}},
                     "disk: unknown lmdb option 'no_such'"),
    "redis_query": ({"remote": {"url": "redis://cache:6379/0?bogus=2"}}, "remote: bad Redis URL .*bogus"),
    "redis_options": ({"remote": {"url": "redis://cache:6379/0", "options": {"bogus": 2}}},
                      "remote: unknown redis option 'bogus'"),
    "redis_cluster_query": ({"remote": {"url": "redis+cluster://cache:7000?bogus=2"}},
                            "remote: unknown redis option 'bogus'"),
    "redis_capacity": ({"remote": {"url": "redis://cache:6379/0", "capacity": "1GiB"}},
                       "remote: unknown redis option 'capacity'"),
    "file_query": ({"tiers": [{"name": "archive", "url": "file:///tmp/tkv-never-made?nope=1"}]},
                   "archive: unknown file option 'nope'"),
}


@pytest.mark.parametrize("case", list(UNKNOWN))
def test_an_unknown_medium_option_is_refused_as_the_config_is_built_not_as_the_tier_opens(case, tmp_path):
    settings, refusal = UNKNOWN[case]
    with pytest.raises(ConfigError, match=refusal):
        TieredKVConfig.from_dict(settings)
    section, table = next(iter(settings.items()))
    if section in ("disk", "remote") and "options" not in table:
        toml = tmp_path / "tkv.toml"
        toml.write_text(f"[{section}]\n" + "".join(f'{k} = "{v}"\n' for k, v in table.items()))
        with pytest.raises(ConfigError, match=refusal):
            TieredKVConfig.from_toml(toml)
        env = {f"TIERED_KV_{section.upper()}_{k.upper()}": str(v) for k, v in table.items()}
        with pytest.raises(ConfigError, match=refusal):
            TieredKVConfig.from_env(env)


def test_a_redis_url_refused_for_its_options_quotes_no_password():
    with pytest.raises(ConfigError) as refused:
        TieredKVConfig.from_dict({"remote": {"url": "redis://:hunter2-secret-pw@cache:6379/0?bogus=2"}})
    assert "hunter2" not in str(refused.value) and "bogus" in str(refused.value)


def test_the_options_each_medium_knows_still_make_a_config():
    config = TieredKVConfig.from_dict({
        "disk": {"url": "lmdb:///tmp/tkv-never-made?sync=true&map_size=1GiB&direct_io=off",
                 "options": {"max_readers": 64}},
        "remote": {"url": "rediss://cache:6380/2?ttl=1h&prefix=tkv&ssl_cert_reqs=none&max_connections=8"},
        "tiers": [{"name": "archive", "url": "file:///tmp/tkv-never-made?touch=0", "options": {"timeout": 2}},
                  {"name": "cluster", "url": "redis+cluster://cache:7000?read_from_replicas=1&socket_keepalive=true"}]})
    assert config.disk.sync is True and config.remote.ttl == 3600.0
    assert [t.name for t in config.lower_tiers] == ["disk", "remote", "archive", "cluster"]


def test_the_cache_salt_is_in_no_repr_of_the_config():
    salt = "tenant-7f3a-secret-salt"
    config = TieredKVConfig.from_dict({"cache_salt": salt, "disk": {"url": "lmdb:///tmp/tkv-never-made"}})
    assert config.cache_salt == salt
    for shown in (repr(config), str(config), f"{config}", f"{config!r}", repr(config.with_overrides(workers=3))):
        assert salt not in shown
