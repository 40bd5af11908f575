"""A tier URL's password is never shown by a config: not in its repr (configs are logged and
printed), not in a ConfigError about a URL written where it does not belong."""

from __future__ import annotations

import pytest

from tiered_kv.config import DiskConfig, RemoteConfig, TierConfig, TieredKVConfig
from tiered_kv.errors import ConfigError

URL = "redis://cache:hunter2pw@cache.internal:6379/0"


def test_regression_the_repr_of_a_config_showed_the_redis_password():
    config = TieredKVConfig.from_dict({"remote": {"url": URL},
                                       "tiers": [{"name": "shared", "url": f"{URL}?password=hunter2pw"}]})
    for shown in (repr(config), str(config), repr(config.remote), f"{config.tiers[0]}"):
        assert "hunter2pw" not in shown
        assert "cache.internal:6379" in shown  # the rest of the URL is still there to read


def test_each_tier_class_keeps_its_own_fields_in_its_repr():
    assert repr(DiskConfig(url="lmdb:///x")).startswith("DiskConfig(name='disk', url='lmdb:///x',")
    assert "retries=2" in repr(RemoteConfig(url=URL))
    assert repr(TierConfig(name="a")).startswith("TierConfig(name='a', url=None,")


@pytest.mark.parametrize("data", [
    {"remote": URL},  # the URL written as the section
    {"tiers": URL},
    {"tiers": [URL]},
    {"remote": {"url": [URL]}},
    {"remote": {"url": "redis://h/0", "ttl": URL}},
    {"disk": {"codec": URL}},
])
def test_regression_an_error_about_a_misplaced_url_quoted_its_password(data):
    with pytest.raises(ConfigError) as caught:
        TieredKVConfig.from_dict(data)
    assert "hunter2pw" not in str(caught.value)
    assert "cache:***@cache.internal" in str(caught.value)  # what was written where, less the password


def test_regression_a_variable_naming_a_section_quoted_its_password():
    """``TIERED_KV_REMOTE=redis://...`` (the ``_URL`` left out)."""
    with pytest.raises(ConfigError, match="TIERED_KV_REMOTE names the section remote") as caught:
        TieredKVConfig.load({}, environ={"TIERED_KV_REMOTE": URL})
    assert "hunter2pw" not in str(caught.value)


def test_regression_a_section_written_as_a_url_under_variables_quoted_its_password():
    with pytest.raises(ConfigError, match="remote must be a table") as caught:
        TieredKVConfig.load({"remote": URL}, environ={"TIERED_KV_REMOTE_TTL": "1h"})
    assert "hunter2pw" not in str(caught.value)
