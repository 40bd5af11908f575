"""Two SGLang servers sharing KV through one Redis: a producer process and a consumer process,
each with SGLang's own radix cache and tiered-kv as its L3, each with its own local disk tier (or
none), and one real ``redis-server`` on a loopback port as the shared remote tier. The consumer
starts with nothing local, so every page it gets came through Redis, and it must be the
producer's KV bit for bit."""

from __future__ import annotations

import shutil

import pytest

from tests.integrations.sglang_real.backends import TIERED_KV, unavailable_reason
from tests.integrations.sglang_real.role_runs import job, ok, run_phase, sequence

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.skipif(shutil.which("redis-server") is None,
                       reason="redis-server is not installed (needed for a real shared Redis)"),
]

CASES = {  # own disk tier per process, layout, interface v1, first token
    "redis_behind_each_process_own_disk": (True, "page_first", True, 1),
    "redis_only": (False, "layer_first", False, 1001),
}


def _tiers(url: str, own_disk: bool) -> dict:
    return {"remote": {"url": url}} if own_disk else {"remote": {"url": url}, "disk": {}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, redis_server):
    """Every case's producer in one process, every consumer in another; all on one Redis."""
    reason = unavailable_reason(TIERED_KV)
    if reason:
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("redis-sharing")
    redis_server.flushall()
    producers, consumers = {}, {}
    for case, (own_disk, layout, v1, first) in CASES.items():
        common = dict(layout=layout, interface_v1=v1, tokens=sequence(first, 6),
                      expected=root / f"{case}.pt", backend_config=_tiers(redis_server.url, own_disk),
                      seed=first)
        producers[case] = job(TIERED_KV, root / f"producer-{case}", **common)
        consumers[case] = job(TIERED_KV, root / f"consumer-{case}", **common)
    # Control: the same consumer on another Redis database of the same server sees nothing.
    other_db = redis_server.url.rsplit("/", 1)[0] + "/1"
    consumers["other_database"] = {**consumers["redis_only"], "storage_dir": str(root / "consumer-other"),
                                   "backend_config": _tiers(other_db, own_disk=False)}
    produced = dict(zip(producers, run_phase("serve", list(producers.values()), root)))
    consumed = dict(zip(consumers, run_phase("consume", list(consumers.values()), root)))
    return produced, consumed


@pytest.mark.parametrize("case", list(CASES))
def test_a_consumer_process_gets_the_producers_kv_through_redis(runs, case):
    produced, consumed = ok(runs[0][case]), ok(runs[1][case])
    assert produced == {"stored_before_trigger": 6, "stored_pages": 6, "pages": 6}
    assert (consumed["device_before"], consumed["host_before"]) == (0, 0)
    assert consumed["host_hit"] == consumed["loaded_tokens"] == 6 * 4
    assert consumed["bit_exact"]


def test_a_consumer_on_another_redis_database_gets_nothing(runs):
    consumed = ok(runs[1]["other_database"])
    assert consumed["host_hit"] == consumed["loaded_tokens"] == 0
