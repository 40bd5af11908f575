"""Whole-number settings read one way (``tiered_kv.units.as_int``) wherever they are written: a
config field, a ``TIERED_KV_*`` variable, a tier URL's query, a tier's ``options`` and the media's
own options. A fraction, a bool, another script's digit or a list is a ConfigError naming the
setting: never cut to a whole number, never taken for 1, never a ValueError or TypeError."""

from __future__ import annotations

import pytest

from storage_backends.registry import open_backend
from tiered_kv.config import TieredKVConfig
from tiered_kv.errors import ConfigError
from tiered_kv.units import as_int

DOWN = "redis://127.0.0.1:1/0"  # (a Redis backend connects on first use: none is made here)


@pytest.mark.parametrize(("text", "number"), [(" 64 ", 64), ("+3", 3), ("-2", -2), ("1_000", 1000), ("007", 7),
                                              (5, 5), (2.0, 2), (10**30, 10**30)])
def test_whole_numbers_as_configs_urls_and_variables_write_them(text, number):
    assert as_int(text, "n") == number


@pytest.mark.parametrize("value", ["", " ", "1e3", "0x10", "2.0", "two", "1__0", "_1", "٣", "³", "9" * 5000,
                                   2.5, float("inf"), float("nan"), True, False, None, [1], {"a": 1}])
def test_anything_else_is_a_config_error_naming_the_setting(value):
    with pytest.raises(ConfigError, match="^my.count must be an integer"):
        as_int(value, "my.count")


def test_a_minimum_is_named_in_the_error():
    assert as_int("0", "n", minimum=0) == 0
    with pytest.raises(ConfigError, match="^n must be at least 1, got 0$"):
        as_int("0", "n", minimum=1)


@pytest.mark.parametrize("where", ["url", "options"])
def test_regression_a_superscript_digit_for_remote_retries_raised_value_error(where):
    """``?retries=³``: ``"³".isdigit()`` is true, ``int("³")`` raises ValueError."""
    section = {"url": f"{DOWN}?retries=³"} if where == "url" else {"url": DOWN, "options": {"retries": "³"}}
    with pytest.raises(ConfigError, match="remote.retries"):
        TieredKVConfig.from_dict({"remote": section})


@pytest.mark.parametrize("value", [2.0, "+2", " 2 "])
def test_remote_retries_are_read_alike_as_a_field_and_in_the_url_or_options(value):
    as_field = TieredKVConfig.from_dict({"remote": {"url": DOWN, "retries": value}}).remote.retries
    as_option = TieredKVConfig.from_dict({"remote": {"url": DOWN, "options": {"retries": value}}}).remote.retries
    assert as_field == as_option == 2


@pytest.mark.parametrize("value", ["٣", "³"])
def test_regression_another_scripts_digit_was_a_worker_count(value):
    with pytest.raises(ConfigError, match="workers"):
        TieredKVConfig.from_env({"TIERED_KV_WORKERS": value})


@pytest.mark.parametrize(("option", "value"), [("max_connections", 2.5), ("max_connections", True),
                                               ("node_threads", 2.7), ("node_threads", True),
                                               ("max_connections", [1]), ("max_connections", "٣")])
def test_regression_redis_options_cut_a_fraction_took_true_for_one_or_raised_type_error(option, value):
    """``[remote.options] max_connections = 2.5`` opened a pool of 2 connections, ``= true`` one,
    ``= [1]`` raised TypeError out of the medium's constructor."""
    with pytest.raises(ConfigError, match=f"remote: redis {option} must be an integer"):
        TieredKVConfig.from_dict({"remote": {"url": DOWN, "options": {option: value}}})  # (refused as built)
    with pytest.raises(ConfigError, match=f"redis {option} must be an integer"):
        open_backend(DOWN, **{option: value}).close()


@pytest.mark.parametrize(("option", "value"), [("max_connections", 0), ("node_threads", -1), ("retries", "-1")])
def test_a_redis_option_below_its_floor_is_refused_by_name(option, value):
    with pytest.raises(ConfigError, match=f"redis {option} must be at least"):
        open_backend(DOWN, **{option: value}).close()


@pytest.mark.parametrize("value", [2.5, True])
def test_regression_lmdb_max_readers_cut_a_fraction_and_took_true_for_one(tmp_path, value):
    with pytest.raises(ConfigError, match="disk: lmdb max_readers must be an integer"):  # (refused as built)
        TieredKVConfig.from_dict({"disk": {"url": f"lmdb://{tmp_path}/d", "options": {"max_readers": value}}})
    with pytest.raises(ConfigError, match="lmdb max_readers must be an integer"):
        open_backend(f"lmdb://{tmp_path}/d", max_readers=value).close()


def test_regression_a_redis_timeout_of_centuries_in_a_url_failed_every_call():
    # (a tool's URL, or a medium opened in code: a config's remote sections check it themselves)
    with pytest.raises(ConfigError, match="timeout must be positive and at most 1d"):
        open_backend("redis://127.0.0.1:1/0?timeout=300000d")
