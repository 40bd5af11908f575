"""A config says what the store runs with: a medium setting written in a tier's URL or ``options``
is the one the medium gets (and the one the config shows), a setting written twice with
different values is refused, a blank encryption secret is refused rather than taken for "off",
and a malformed URL or section is one ConfigError, never a ValueError or a traceback."""

from __future__ import annotations

import pytest

from storage_backends.registry import open_backend
from tests.cli.conftest import cli
from tiered_kv.config import DiskConfig, TieredKVConfig
from tiered_kv.errors import ConfigError
from tiered_kv.store.lower_tiers import open_media

GiB = 1 << 30


def opened_disk(config: TieredKVConfig):
    [(_, backend)] = open_media(config)
    return backend


def test_regression_a_disk_url_asking_for_fsync_opened_without_it(tmp_path):
    """``[disk] url = "lmdb:///d?sync=true&capacity=1GiB"`` opened with sync off and 8 GiB: the
    fields' defaults were passed to the medium over the URL's query."""
    config = TieredKVConfig.from_dict({"disk": {"url": f"lmdb://{tmp_path}/d?sync=true&capacity=1GiB"}})
    backend = opened_disk(config)
    try:
        assert (backend.sync, backend.capacity) == (True, GiB)
    finally:
        backend.close()
    assert (config.disk.sync, config.disk.capacity) == (True, GiB), "the config says what the medium got"


def test_regression_disk_options_asking_for_fsync_were_ignored(tmp_path):
    config = TieredKVConfig.from_dict({"disk": {"url": f"lmdb://{tmp_path}/d", "options": {"sync": True}}})
    backend = opened_disk(config)
    try:
        assert backend.sync is True
    finally:
        backend.close()


def test_regression_the_remote_timeout_and_retries_of_the_url_and_options_were_the_defaults():
    config = TieredKVConfig.from_dict({"remote": {"url": "redis://127.0.0.1:1/0?timeout=5s",
                                                  "options": {"retries": 5}}})
    backend = open_backend(config.remote.url, **config.remote.medium_options())  # (connects on first use)
    try:
        assert (backend.timeout, backend.retries) == (5.0, 5)
    finally:
        backend.close()
    assert (config.remote.timeout, config.remote.retries) == (5.0, 5)


def test_options_win_over_the_urls_query_as_the_medium_reads_them(tmp_path):
    config = TieredKVConfig.from_dict({"disk": {"url": f"lmdb://{tmp_path}/d?sync=false",
                                                "options": {"sync": "yes"}}})
    assert config.disk.sync is True


@pytest.mark.parametrize("section", [
    {"url": "lmdb:///d?capacity=1GiB", "capacity": "2GiB"},
    {"url": "lmdb:///d", "sync": True, "options": {"sync": False}},
])
def test_a_setting_written_twice_with_different_values_is_refused(section):
    with pytest.raises(ConfigError, match="set it in one place"):
        TieredKVConfig.from_dict({"disk": section})


def test_a_setting_written_twice_alike_is_taken():
    config = TieredKVConfig.from_dict({"disk": {"url": "lmdb:///d?capacity=2GiB", "capacity": "2GiB"}})
    assert config.disk.capacity == 2 * GiB


def test_a_bad_setting_in_the_url_is_named_by_its_field():
    with pytest.raises(ConfigError, match="remote.retries"):
        TieredKVConfig.from_dict({"remote": {"url": "redis://h:6379/0?retries=many"}})


@pytest.mark.parametrize("value", ["", "none", "None", "null", "  "])
def test_regression_a_blank_encryption_secret_turned_encryption_off(value):
    """``TIERED_KV_ENCRYPTION_SECRET=$UNSET`` expands to "": it meant no secret, so blocks were
    written in plain text while ``env:UNSET`` and a short secret were refused."""
    with pytest.raises(ConfigError, match="encryption_secret is empty"):
        TieredKVConfig.load({}, environ={"TIERED_KV_ENCRYPTION_SECRET": value})
    with pytest.raises(ConfigError, match="encryption_secret is empty"):
        TieredKVConfig.from_dict({"encryption_secret": value})


def test_a_config_without_a_secret_stores_plain_blocks():
    assert TieredKVConfig.from_dict({"encryption_secret": None}).encryption_secret is None
    assert TieredKVConfig.load({}, environ={}).encryption_secret is None


def test_regression_variables_over_a_section_that_is_no_table_raised_value_error():
    with pytest.raises(ConfigError, match="disk must be a table"):
        TieredKVConfig.load({"disk": "lmdb:///x"}, environ={"TIERED_KV_DISK_CAPACITY": "1GiB"})


def test_regression_variables_over_a_section_given_as_its_dataclass_raised_type_error():
    config = TieredKVConfig.load({"disk": DiskConfig(url="lmdb:///x")}, environ={"TIERED_KV_DISK_CAPACITY": "1GiB"})
    assert (config.disk.url, config.disk.capacity) == ("lmdb:///x", GiB)


@pytest.mark.parametrize("url", ["redis://[::1/0", "lmdb://[x"])
def test_regression_a_malformed_url_raised_value_error(url):
    with pytest.raises(ConfigError, match="disk.url"):
        TieredKVConfig.from_dict({"disk": {"url": url}})


@pytest.mark.parametrize("url", ["redis://[::1/0", "lmdb://[x", "rediss://127.0.0.1:1/0?ssl_cert_reqs=bogus"])
def test_regression_the_cli_printed_a_traceback_for_a_malformed_url(url):
    result = cli("inspect", url)
    assert result.code == 2 and "Traceback" not in result.err, result.err
    assert len(result.err.strip().splitlines()) == 1


def test_a_variable_and_the_url_saying_otherwise_is_refused_not_decided_by_a_default():
    """``TIERED_KV_DISK_SYNC=false`` over a URL's ``?sync=true``: both were written."""
    with pytest.raises(ConfigError, match="set it in one place"):
        TieredKVConfig.load({"disk": {"url": "lmdb:///x?sync=true"}}, environ={"TIERED_KV_DISK_SYNC": "false"})


def test_a_field_written_at_its_default_value_and_the_url_saying_otherwise_is_refused():
    with pytest.raises(ConfigError, match="set it in one place"):
        TieredKVConfig.from_dict({"disk": {"url": "lmdb:///x?capacity=16GiB", "capacity": "8GiB"}})


def test_settings_written_nowhere_are_the_documented_defaults():
    config = TieredKVConfig.from_dict({"disk": {"url": "lmdb:///x"}, "remote": {"url": "redis://h:6379/0"}})
    assert (config.disk.capacity, config.disk.sync) == (8 * GiB, False)
    assert (config.remote.timeout, config.remote.retries, config.remote.ttl) == (2.0, 2, None)
