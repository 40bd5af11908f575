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


@pytest.fixture(autouse=True)
def _each_test_is_a_new_trtllm_process(monkeypatch):
    """TensorRT-LLM binds a LoRA task id to the adapter it first loaded for the life of the
    process, and the adapter keeps that memo per process: tests that reuse a task id with other
    adapter files are other processes, not one process refusing the second adapter."""
    import sys

    module = sys.modules.get("tiered_kv.integrations.trtllm_requests")
    if module is None:  # (imported afresh by the test that needs it)
        return
    for name in ("_lora_files", "_lora_refused"):
        monkeypatch.setattr(module, name, type(getattr(module, name))())
    monkeypatch.setattr(module, "_forgotten", bytearray(len(module._forgotten)))


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
