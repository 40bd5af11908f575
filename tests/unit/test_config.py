"""Configuration (tiered_kv.config) and the size/duration parsers it uses (tiered_kv.units)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from tiered_kv.config import DiskConfig, HostConfig, RemoteConfig, TieredKVConfig, env_dict, layerwise_on
from tiered_kv.errors import ConfigError
from tiered_kv.units import format_size, parse_duration, parse_size

GiB = 1 << 30

TOML = """
workers = 4
cache_salt = "tenant-a"
max_inflight_save = "256MiB"

[host]
capacity = "8GiB"
pinned = "no"

[disk]
url = "lmdb:///var/cache/tiered-kv"
capacity = "512MB"
policy = "on_evict"
sync = true

[remote]
url = "redis://cache:6379/0"
ttl = "1d"
timeout = "250ms"
retries = 5
"""


@pytest.fixture
def toml_file(tmp_path):
    path = tmp_path / "tiered-kv.toml"
    path.write_text(TOML)
    return path


# -- sources ---------------------------------------------------------------------------------

def test_defaults_need_no_input():
    cfg = TieredKVConfig.from_dict(None)
    assert cfg == TieredKVConfig() == TieredKVConfig.from_dict({})
    assert cfg.disk.url is None and cfg.remote.url is None and cfg.workers == 2


def test_from_dict_parses_sizes_durations_and_sections():
    cfg = TieredKVConfig.from_dict({
        "workers": 3,
        "host": {"capacity": "8GiB"},
        "disk": {"url": "lmdb:///tmp/x", "capacity": 4096, "level": 3, "codec": "zstd"},
        "remote": {"url": "rediss://h:6380/1", "ttl": "2h", "timeout": 1},
        "max_inflight_load": "512MB",
        "metrics_port": 9400,
    })
    assert cfg.workers == 3
    assert cfg.host.capacity == 8 * GiB
    assert (cfg.disk.url, cfg.disk.capacity, cfg.disk.level, cfg.disk.codec) == \
        ("lmdb:///tmp/x", 4096, 3, "zstd")
    assert (cfg.remote.ttl, cfg.remote.timeout) == (7200.0, 1.0)
    assert cfg.max_inflight_load == 512_000_000
    assert cfg.metrics_port == 9400


def test_from_toml_reads_a_file(toml_file):
    cfg = TieredKVConfig.from_toml(toml_file)
    assert cfg.workers == 4 and cfg.cache_salt == "tenant-a"
    assert cfg.max_inflight_save == 256 << 20
    assert cfg.host == HostConfig(capacity=8 * GiB, pinned="no")
    assert cfg.disk == DiskConfig(url="lmdb:///var/cache/tiered-kv", capacity=512_000_000,
                                  policy="on_evict", sync=True)
    assert cfg.remote.url == "redis://cache:6379/0"
    assert (cfg.remote.ttl, cfg.remote.timeout, cfg.remote.retries) == (86400.0, 0.25, 5)


def test_from_env_reads_prefixed_variables_as_strings():
    env = {
        "TIERED_KV_DISK_URL": "lmdb:///data/kv",
        "TIERED_KV_HOST_CAPACITY": "2GiB",
        "TIERED_KV_WORKERS": "3",
        "TIERED_KV_DISK_SYNC": "yes",
        "TIERED_KV_REMOTE_TTL": "none",
        "TIERED_KV_MAX_INFLIGHT_SAVE": "64MiB",
        "HOME": "/root",  # not ours: ignored
    }
    cfg = TieredKVConfig.from_env(env)
    assert cfg.disk.url == "lmdb:///data/kv"
    assert cfg.host.capacity == 2 * GiB
    assert cfg.workers == 3
    assert cfg.disk.sync is True
    assert cfg.remote.ttl is None
    assert cfg.max_inflight_save == 64 << 20


def test_from_env_defaults_to_the_process_environment(monkeypatch):
    monkeypatch.setenv("TIERED_KV_WORKERS", "5")
    assert TieredKVConfig.from_env().workers == 5


def test_env_dict_nests_section_variables():
    assert env_dict({"TIERED_KV_DISK_URL": "lmdb:///x", "TIERED_KV_WORKERS": "3", "OTHER": "1"}) == \
        {"disk": {"url": "lmdb:///x"}, "workers": "3"}


def test_load_overlays_environment_on_toml(toml_file):
    env = {"TIERED_KV_WORKERS": "7", "TIERED_KV_DISK_CAPACITY": "1GiB", "TIERED_KV_REMOTE_URL": "none"}
    cfg = TieredKVConfig.load(toml_file, environ=env)
    assert cfg.workers == 7  # env wins
    assert cfg.disk.capacity == GiB  # env wins inside a section ...
    assert cfg.disk.url == "lmdb:///var/cache/tiered-kv"  # ... and the file's other keys stay
    assert cfg.disk.policy == "on_evict"
    assert cfg.remote.url is None and cfg.remote.retries == 5
    assert cfg.host.capacity == 8 * GiB


@pytest.mark.parametrize("value, expected", [("auto", "auto"), (" AUTO ", "auto"), (True, True), ("off", False),
                                             ("1", True), (0, False)])
def test_layerwise_loads_is_true_false_or_auto(value, expected):
    assert TieredKVConfig.from_dict({"layerwise_loads": value}).layerwise_loads == expected
    assert TieredKVConfig.from_env({"TIERED_KV_LAYERWISE_LOADS": str(value)}).layerwise_loads == expected


def test_auto_layerwise_loads_stream_on_accelerators_and_not_on_cpu_engines():
    assert TieredKVConfig().layerwise_loads == "auto"
    assert [layerwise_on("auto", d) for d in ("cuda", "cpu", None)] == [True, False, True]
    assert [layerwise_on(s, "cpu") for s in (True, False)] == [True, False]
    assert [layerwise_on(s, "cuda") for s in (True, False)] == [True, False]


def test_load_accepts_a_dict_or_nothing():
    assert TieredKVConfig.load({"workers": 6}, environ={}).workers == 6
    assert TieredKVConfig.load(None, environ={"TIERED_KV_HOST_CAPACITY": "3GiB"}).host.capacity == 3 * GiB


# -- errors ----------------------------------------------------------------------------------

@pytest.mark.parametrize("data, key", [
    ({"wrokers": 2}, "wrokers"),
    ({"disk": {"capacty": "1GiB"}}, "disk.capacty"),
    ({"disk": {"capacity": -1}}, "disk.capacity"),
    ({"host": {"capacity": "-1GiB"}}, "host.capacity"),
    ({"host": {"capacity": "lots"}}, "host.capacity"),
    ({"max_inflight_save": "12 parsecs"}, "max_inflight_save"),
    ({"disk": {"url": "ftp://x"}}, "disk.url"),
    ({"remote": {"url": "ftp://x"}}, "remote.url"),
    ({"disk": {"policy": "sometimes"}}, "disk.policy"),
    ({"remote": {"policy": "write_back"}}, "remote.policy"),
    ({"disk": {"codec": "lz4"}}, "disk.codec"),
    ({"host": {"pinned": "maybe"}}, "host.pinned"),
    ({"workers": 0}, "workers"),
    ({"workers": True}, "workers"),
    ({"workers": 2.5}, "workers"),
    ({"workers": "two"}, "workers"),
    ({"workers": 100_000}, "workers"),  # regression: accepted, and a store started 100,000 threads
    ({"remote": {"retries": True}}, "remote.retries"),
    ({"remote": {"retries": -1}}, "remote.retries"),
    ({"host": {"capacity": True}}, "host.capacity"),
    ({"disk": {"sync": "maybe"}}, "disk.sync"),
    ({"disk": {"url": 5}}, "disk.url"),
    ({"disk": "lmdb:///x"}, "disk"),
    ({"remote": {"ttl": "forever"}}, "remote.ttl"),
    ({"hash_algo": "md5"}, "hash_algo"),
    ({"metrics_port": 70000}, "metrics_port"),
    ({"layerwise_loads": "sometimes"}, "layerwise_loads"),
    ({"layerwise_loads": 2}, "layerwise_loads"),
    ({"layerwise_loads": None}, "layerwise_loads"),
])
def test_bad_values_raise_config_error_naming_the_key(data, key):
    with pytest.raises(ConfigError, match=rf"(^|\W){key}\W"):
        TieredKVConfig.from_dict(data)


@pytest.mark.parametrize("section", ["disk", "remote"])
@pytest.mark.parametrize("level", [23, -8, 99])
def test_zstd_level_out_of_range_is_refused_at_load(section, level):
    # regression: any level was accepted and only failed later inside BlockCodec, without the key
    with pytest.raises(ConfigError, match=rf"{section}\.level"):
        TieredKVConfig.from_dict({section: {"level": level}})


@pytest.mark.parametrize("value", ["inf", "nan"])
@pytest.mark.parametrize("key", ["host.capacity", "remote.ttl", "remote.timeout"])
def test_toml_inf_and_nan_are_refused(tmp_path, key, value):
    # regression: TOML allows inf/nan; sizes died with OverflowError/ValueError, durations
    # silently became nan
    section, name = key.split(".")
    path = tmp_path / "c.toml"
    path.write_text(f"[{section}]\n{name} = {value}\n")
    with pytest.raises(ConfigError, match=key):
        TieredKVConfig.from_toml(path)


def test_env_value_for_an_unknown_key_is_refused():
    with pytest.raises(ConfigError, match="disk.colour"):
        TieredKVConfig.from_env({"TIERED_KV_DISK_COLOUR": "blue"})


def test_missing_toml_file_is_a_config_error(tmp_path):
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigError, match="nope.toml"):
        TieredKVConfig.from_toml(missing)
    with pytest.raises(ConfigError, match="nope.toml"):
        TieredKVConfig.load(missing, environ={})


def test_malformed_toml_is_a_config_error(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[disk\nurl = lmdb\n")
    with pytest.raises(ConfigError, match="bad.toml"):
        TieredKVConfig.from_toml(bad)
    with pytest.raises(ConfigError, match="bad.toml"):
        TieredKVConfig.load(bad, environ={})


def test_unreadable_config_path_is_a_config_error(tmp_path):
    # regression: a directory (IsADirectoryError) or a binary file (UnicodeDecodeError) escaped
    binary = tmp_path / "binary.toml"
    binary.write_bytes(b"\xff\xfe\x00workers = 2")
    for path in (tmp_path, binary):
        with pytest.raises(ConfigError):
            TieredKVConfig.from_toml(path)
        with pytest.raises(ConfigError):
            TieredKVConfig.load(path, environ={})


# -- immutability ----------------------------------------------------------------------------

def test_configs_are_frozen():
    cfg = TieredKVConfig.from_dict({"disk": {"url": "lmdb:///x"}})
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.workers = 8  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.disk.url = "lmdb:///y"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.remote.ttl = 1.0  # type: ignore[misc]


def test_with_overrides_returns_a_validated_copy():
    cfg = TieredKVConfig()
    more = cfg.with_overrides(workers=8)
    assert more.workers == 8 and cfg.workers == 2
    with pytest.raises(ConfigError, match="workers"):
        cfg.with_overrides(workers=0)


def test_section_objects_are_accepted_as_is():
    disk = DiskConfig(url="lmdb:///x")
    assert TieredKVConfig.from_dict({"disk": disk, "remote": RemoteConfig()}).disk is disk


# -- sizes and durations -------------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    ("8GiB", 8 * GiB),
    ("512MB", 512_000_000),
    (4096, 4096),
    ("4096", 4096),
    ("1.5 GiB", 3 * GiB // 2),
    (" 64 kib ", 64 * 1024),
    ("2T", 2 * 10**12),
    ("1KiB", 1024),
    ("10b", 10),
    ("0", 0),
    (2.0, 2),
    ("1.005KB", 1005),  # regression: float arithmetic gave 1004
    ("2.3GB", 2_300_000_000),
])
def test_parse_size_understands_what_people_write(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("value", ["-1", -1, "lots", "", "1e9", "GiB", "8 GiBs", "5i", "5ib", None,
                                   True, float("inf"), float("nan"), [1]])
def test_parse_size_refuses_anything_else_with_config_error(value):
    # "5i" / "5ib" used to raise KeyError, inf/nan OverflowError/ValueError
    with pytest.raises(ConfigError, match="my.size"):
        parse_size(value, name="my.size")


@pytest.mark.parametrize("value", [1.5, "1.5", "2.5b"])
def test_regression_a_fraction_of_a_byte_was_cut_off_silently(value):
    """``capacity = 1.5`` (meant as GiB) gave a 1-byte capacity: a size in bytes is whole."""
    with pytest.raises(ConfigError, match="whole number"):
        parse_size(value, name="host.capacity")


@pytest.mark.parametrize(("text", "expected"), [("0.1GiB", GiB // 10), ("1.2GiB", int(1.2 * GiB)), ("0.3MiB", 314572)])
def test_a_fraction_of_a_unit_is_rounded_down_to_whole_bytes(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text, seconds", [
    ("250ms", 0.25),
    ("30s", 30.0),
    ("30", 30.0),
    (30, 30.0),
    (1.5, 1.5),
    ("1.5m", 90.0),
    ("2h", 7200.0),
    ("1d", 86400.0),
    (" 10 S ", 10.0),
    ("0", 0.0),
])
def test_parse_duration_understands_what_people_write(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("value", ["-1s", -1, "soon", "", "1w", "1e3s", None, True,
                                   float("inf"), float("nan"), "9" * 400])
def test_parse_duration_refuses_anything_else_with_config_error(value):
    with pytest.raises(ConfigError, match="my.ttl"):
        parse_duration(value, name="my.ttl")


def test_parse_duration_result_is_always_finite():
    assert all(math.isfinite(parse_duration(v)) for v in ("1ms", "99999d", 10**9))


def test_format_size_is_human_readable():
    assert format_size(512) == "512 B"
    assert format_size(1536) == "1.5 KiB"
    assert format_size(8 * GiB) == "8.0 GiB"
    assert format_size(3 << 50) == "3072.0 TiB"
