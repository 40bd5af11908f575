from __future__ import annotations

import pytest

from tests.redis_server import RedisServer


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """One real redis-server for the session; tests that kill it must restart it."""
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server) -> str:
    """URL of a running, empty Redis."""
    if redis_server.proc is None or redis_server.proc.poll() is not None:
        redis_server.start()
    redis_server.flushall()
    return redis_server.url


@pytest.fixture
def own_redis(tmp_path):
    """A redis-server of this test's own, which the test may kill and restart."""
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.stop()
