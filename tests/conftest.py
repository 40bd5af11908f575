from __future__ import annotations

import pytest

from tests.redis_server import RedisServer


@pytest.fixture(autouse=True)
def _loads_never_depend_on_timing(request, monkeypatch):
    """The cost policy decides from restore and prefill times the store measures as tests run: a
    test that expects loads must not depend on this machine's speed. Every policy built from an
    index loads every stored block ("always") unless the test is marked ``restore_cost`` (those
    inject their estimates)."""
    if request.node.get_closest_marker("restore_cost"):
        return
    from tiered_kv.connector.restore_policy import RestorePolicy

    built = RestorePolicy.for_index.__func__

    def always(cls, *args, **kwargs):
        policy = built(cls, *args, **kwargs)
        policy.policy = "always"
        return policy

    monkeypatch.setattr(RestorePolicy, "for_index", classmethod(always))


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
