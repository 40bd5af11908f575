"""``open_read_only(url, options=...)``: a tool's open takes the engine's settings for the medium
as a table (not URL text), and the medium reads and refuses them itself, in its own words; the
settings that make a tool's open read only stay the tool's (real LMDB, file stores, redis-server)."""

from __future__ import annotations

import pytest

from storage_backends.registry import open_backend, open_read_only
from tiered_kv.errors import ConfigError


@pytest.mark.parametrize("scheme", ["lmdb", "file"])
def test_the_medium_refuses_a_bad_option_given_to_a_tools_open_in_its_own_words(tmp_path, scheme):
    url = f"{scheme}://{tmp_path / 'store'}"
    open_backend(url).close()
    for options, said in (({"capacity": 0}, f"{scheme} capacity must be positive"),
                          ({"no_such": 1}, f"unknown {scheme} option 'no_such'"),
                          ({"tenant_quotas": {"zz": "1KiB"}}, "a tenant label written as text is its hex")):
        with pytest.raises(ConfigError, match=said):
            open_read_only(url, options=options)


def test_a_tools_lmdb_open_is_told_the_capacity_but_evicts_to_none_and_records_no_access(tmp_path):
    url = f"lmdb://{tmp_path / 'store'}"
    open_backend(url).close()
    with open_read_only(url, options={"capacity": "64MiB", "record_access": True, "sync": True}) as tool:
        assert (tool.told_capacity, tool.capacity, tool.record_access, tool.sync) == (64 << 20, None, False, True)


def test_a_tools_redis_open_takes_the_engines_ttl_and_prefix_but_its_own_timeout_and_no_retries(redis_url):
    options = {"ttl": 60.0, "prefix": "app1:", "timeout": 30.0, "retries": 5}
    with open_read_only(redis_url, options=options, timeout=0.75) as tool:
        assert (tool.ttl_ms, tool.prefix, tool.timeout, tool.retries) == (60_000, b"app1:", 0.75, 0)
