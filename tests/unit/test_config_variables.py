"""``TIERED_KV_*`` variables name one setting each: a variable naming a whole section, or two
variables whose names differ only in case saying different things, is a ConfigError naming them,
never a TypeError, a variable silently dropped or a winner picked by the environment's order."""

from __future__ import annotations

import pytest

from tiered_kv.config import TieredKVConfig
from tiered_kv.errors import ConfigError


@pytest.mark.parametrize("environ", [
    {"TIERED_KV_DISK": "on", "TIERED_KV_DISK_URL": "lmdb:///x"},
    {"TIERED_KV_DISK_URL": "lmdb:///x", "TIERED_KV_DISK": "on"},  # the other order
])
def test_regression_a_variable_naming_a_section_raised_type_error_or_dropped_the_sections_url(environ):
    """In one order ``TypeError: 'str' object does not support item assignment``; in the other
    the disk URL was dropped and only "disk must be a table" was said."""
    with pytest.raises(ConfigError, match="TIERED_KV_DISK names the section disk"):
        TieredKVConfig.from_env(environ)


def test_a_variable_naming_a_section_alone_is_refused_by_its_name():
    with pytest.raises(ConfigError, match=r"TIERED_KV_HOST names the section host: set its fields \(TIERED_KV_HOST_<FIELD>\)"):
        TieredKVConfig.from_env({"TIERED_KV_HOST": "4GiB"})


def test_regression_two_spellings_of_one_variable_were_decided_by_the_environments_order():
    with pytest.raises(ConfigError, match="TIERED_KV_DISK_URL and TIERED_KV_disk_url"):
        TieredKVConfig.from_env({"TIERED_KV_disk_url": "lmdb:///b", "TIERED_KV_DISK_URL": "lmdb:///a"})
    with pytest.raises(ConfigError, match="TIERED_KV_WORKERS and TIERED_KV_Workers"):
        TieredKVConfig.from_env({"TIERED_KV_WORKERS": "3", "TIERED_KV_Workers": "4"})


def test_two_spellings_saying_the_same_are_one_setting():
    environ = {"TIERED_KV_DISK_URL": "lmdb:///a", "TIERED_KV_Disk_Url": "lmdb:///a"}
    assert TieredKVConfig.from_env(environ).disk.url == "lmdb:///a"


@pytest.mark.parametrize("data", [{1: 2, "wrokers": 3}, {"disk": {1: 2, "colour": "blue"}}])
def test_regression_a_key_that_is_no_string_beside_one_that_is_raised_type_error(data):
    """Sorting the unknown keys compared an int with a str."""
    with pytest.raises(ConfigError, match="unknown config key"):
        TieredKVConfig.from_dict(data)
