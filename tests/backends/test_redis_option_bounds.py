"""Counts of a Redis tier with a ceiling (no server needed: nothing connects)."""

from __future__ import annotations

import pytest

from storage_backends.redis_remote import RedisBackend
from storage_backends.registry import open_backend
from tiered_kv.errors import ConfigError

URL = "redis://127.0.0.1:1/0"
MAX_NODE_THREADS, MAX_RETRIES, MAX_CONNECTIONS = 64, 10, 10_000  # (storage_backends.redis_options)


@pytest.mark.parametrize("name, limit", [("node_threads", MAX_NODE_THREADS), ("retries", MAX_RETRIES),
                                         ("max_connections", MAX_CONNECTIONS)])
def test_a_huge_count_is_a_config_error_not_threads_slots_or_retries_without_end(name, limit):
    # unbounded before: node_threads=10**6 started a thread per cluster node, max_connections=10**9
    # filled a pool of a billion slots as the tier opened (minutes, gigabytes), retries=10**6 kept a
    # call against a refusing Redis going for days
    for huge in (limit + 1, 10**9):
        with pytest.raises(ConfigError, match=name):
            open_backend(f"{URL}?{name}={huge}")
        with pytest.raises(ConfigError, match=name):
            open_backend(URL, **{name: str(huge)})
        with pytest.raises(ConfigError, match=name):
            RedisBackend(URL, **{name: huge})
    open_backend(f"{URL}?{name}={limit}").close()  # the limit itself is fine
