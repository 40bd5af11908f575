"""Settings past what anything can hold, other scripts' digits, a query option given twice and a
Redis URL path that names no db: each a ConfigError naming the setting when the config is built
or the medium opened, never accepted to fail later (an OverflowError from LMDB, a repr that
raises ValueError, every lookup raising, every Redis SET refused, data in another db)."""

from __future__ import annotations

import pytest

from storage_backends.registry import open_backend
from tiered_kv.config import TieredKVConfig
from tiered_kv.errors import ConfigError
from tiered_kv.units import parse_duration, parse_size

DOWN = "127.0.0.1:1"  # (a Redis backend connects on first use: none is made here)


@pytest.mark.parametrize("size", ["9" * 5000, 10**5000, 1 << 63, "99999999999PiB", 1e300],
                         ids=["5000 nines", "10**5000", "2**63", "PiB", "1e300"])
def test_a_size_past_8_eib_does_not_make_a_config_whose_repr_raises(size):
    with pytest.raises(ConfigError, match="^host.capacity: size must be at most 8 EiB"):
        TieredKVConfig.from_dict({"host": {"capacity": size}})
    assert parse_size((1 << 63) - 1) == (1 << 63) - 1


def test_an_lmdb_capacity_past_8_eib_is_a_config_error_not_an_overflow_error(tmp_path):
    with pytest.raises(ConfigError, match="capacity: size must be at most 8 EiB"):
        open_backend(f"lmdb://{tmp_path}/d?capacity=99999999999PiB")


@pytest.mark.parametrize("field", ["workers", "layer_groups", "metrics_port", "lookup_timeout"])
def test_an_integer_too_long_to_print_is_a_config_error_not_a_value_error(field):
    with pytest.raises(ConfigError, match=f"^{field}"):
        TieredKVConfig.from_dict({field: 10**5000})
    with pytest.raises(ConfigError, match="^max_inflight_save: size must not be negative, got a huge number"):
        TieredKVConfig.from_dict({"max_inflight_save": -(10**5000)})


@pytest.mark.parametrize("text", ["١٢GiB", "١٢", "٣s"])  # Arabic-Indic digits
def test_another_scripts_digits_are_no_size_or_duration(text):
    with pytest.raises(ConfigError, match="^x: expected a"):
        (parse_size if "s" not in text else parse_duration)(text, name="x")
    with pytest.raises(ConfigError, match="^disk.capacity"):
        TieredKVConfig.from_dict({"disk": {"url": "lmdb:///tmp/tkv", "capacity": "١٢GiB"}})


@pytest.mark.parametrize(("field", "value"), [("lookup_timeout", 2**64), ("lookup_timeout", "2d"),
                                              ("metrics_log_interval", 2**64), ("metrics_log_interval", "31d")])
def test_a_wait_no_thread_can_make_is_refused_not_raised_by_every_lookup(field, value):
    with pytest.raises(ConfigError, match=f"^{field} must be positive and at most"):
        TieredKVConfig.from_dict({field: value})
    assert TieredKVConfig.from_dict({"lookup_timeout": "1d", "metrics_log_interval": "30d"}).lookup_timeout == 86400


def test_a_redis_ttl_every_set_would_be_refused_for_is_a_config_error():
    with pytest.raises(ConfigError, match="^remote.ttl must be at most 100 years"):
        TieredKVConfig.from_dict({"remote": {"url": f"redis://{DOWN}/0", "ttl": 10**17}})
    with pytest.raises(ConfigError, match="^remote.ttl must be at most 100 years"):
        TieredKVConfig.from_dict({"remote": {"url": f"redis://{DOWN}/0?ttl=99999999999d"}})
    with pytest.raises(ConfigError, match="^redis ttl must be at most 100 years"):
        open_backend(f"redis://{DOWN}/0?ttl=99999999999d")
    assert TieredKVConfig.from_dict({"remote": {"url": f"redis://{DOWN}/0", "ttl": "3650d"}}).remote.ttl == 3650 * 86400


@pytest.mark.parametrize("url", ["lmdb:///tmp/tkv?sync=true&sync=false", f"redis://{DOWN}/0?retries=0&retries=5",
                                 f"redis://u:hunter2pw@{DOWN}/0?password=hunter3pw&password=hunter4pw"])
def test_a_query_option_given_twice_is_refused_not_read_as_its_last(url):
    section = "disk" if url.startswith("lmdb") else "remote"
    with pytest.raises(ConfigError, match="twice, to different values") as caught:
        TieredKVConfig.from_dict({section: {"url": url}})
    assert "hunter" not in str(caught.value)
    assert TieredKVConfig.from_dict({"disk": {"url": "lmdb:///tmp/tkv?sync=true&sync=true"}}).disk.sync is True


@pytest.mark.parametrize("url", [f"redis://{DOWN}/abc", f"redis://{DOWN}/O", f"redis://{DOWN}/1/2",
                                 f"redis://u:hunter2pw@{DOWN}/1?db=3", f"rediss://{DOWN}/0?db=2"])
def test_a_redis_url_path_naming_no_db_or_another_db_is_refused_not_read_as_some_db(url):
    with pytest.raises(ConfigError, match="^bad Redis URL") as caught:
        open_backend(url)
    assert "hunter" not in str(caught.value)


@pytest.mark.parametrize(("url", "db"), [(f"redis://{DOWN}/1?db=1", 1), (f"redis://{DOWN}/", 0),
                                         (f"redis://{DOWN}?db=4", 4), (f"redis://{DOWN}/15", 15)])
def test_a_redis_url_naming_its_db_once_opens_that_db(url, db):
    backend = open_backend(url)
    try:
        assert backend._client.connection_pool.connection_kwargs.get("db", 0) == db
    finally:
        backend.close()


@pytest.mark.parametrize("value", [["SALTY-secret"], 12345678, {"s": "SALTY-secret"}])
def test_regression_a_cache_salt_of_the_wrong_type_was_printed_in_its_error(value):
    with pytest.raises(ConfigError) as err:
        TieredKVConfig.from_dict({"cache_salt": value})
    assert "SALTY" not in str(err.value) and "12345678" not in str(err.value)
    assert "cache_salt" in str(err.value)


def test_an_engine_configs_cache_salt_is_not_in_its_repr():
    from tiered_kv.engine import EngineConfig

    assert "SALTY" not in repr(EngineConfig(cache_salt="SALTY-secret"))
