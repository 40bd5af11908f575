"""A Redis Cluster URL with options its client refuses is a bad config when the tier is opened,
not a Redis that is "down" on every call (redis-py makes the cluster client, and reads its
options, only when it first connects)."""

from __future__ import annotations

import pytest

from storage_backends.redis_remote import RedisBackend
from tiered_kv.errors import ConfigError

PORT = 1  # nothing is dialled: the check happens before any connection


@pytest.mark.parametrize("query, says", [
    ("db=3", "a Redis Cluster has only db 0"),
    ("ssl_cert_reqs=required", "unexpected keyword argument 'ssl_cert_reqs'"),  # TLS options without rediss
])
def test_regression_a_cluster_url_redis_py_refuses_was_counted_as_redis_down(query, says):
    with pytest.raises(ConfigError, match=says):
        RedisBackend.from_url(f"redis+cluster://127.0.0.1:{PORT}/?{query}", timeout=0.2, retries=0)


@pytest.mark.parametrize("query", ["db=0", "socket_keepalive=true", "health_check_interval=5",
                                   "read_from_replicas=1", "client_name=replica-a"])
def test_a_cluster_url_with_options_its_client_takes_opens(query):
    RedisBackend.from_url(f"redis+cluster://127.0.0.1:{PORT}/?{query}", timeout=0.2, retries=0).close()


def test_a_tls_cluster_url_takes_its_tls_options():
    RedisBackend.from_url(f"rediss://127.0.0.1:{PORT}/?cluster=true&ssl_cert_reqs=none&ssl_check_hostname=false",
                          timeout=0.2, retries=0).close()
