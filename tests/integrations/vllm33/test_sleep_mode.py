"""Sleep mode under vLLM 0.33: what its engine core and GPU worker do at ``sleep(level=1)`` and
``wake_up()``, around its own Scheduler, with our connector built by its factory."""

from __future__ import annotations

import pytest

from tests.integrations.vllm33.rig import Engine, vllm_config, write_model
from tests.integrations.vllm33.test_scheduler import PROMPTS, extra

pytestmark = pytest.mark.vllm33


@pytest.fixture
def model(tmp_path, monkeypatch):
    for name in [n for n in __import__("os").environ if n.startswith("TIERED_KV_")]:
        monkeypatch.delenv(name)
    return write_model(tmp_path / "model")


def test_vllm_asks_our_class_whether_it_follows_sleep_mode(model, tmp_path):
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from tiered_kv.integrations.vllm import TieredKVConnector

    cfg = vllm_config(model, extra(tmp_path))
    cls = KVConnectorFactory.get_connector_class(cfg.kv_transfer_config)  # as VllmConfig's check does
    assert "supports_sleep_mode" in TieredKVConnector.__dict__  # ours, not the base's default
    assert cls.supports_sleep_mode(cfg.kv_transfer_config) is True
    # the check itself, on a config that enables sleep mode (vLLM refuses the flag on CPU at
    # construction, so it is set afterwards)
    cfg.model_config.enable_sleep_mode = True
    cfg._verify_kv_transfer_compat()


def sleep(eng: Engine) -> None:
    """EngineCoreProc.sleep(level=1): pause (abort requests, step until idle: held requests are
    released), reset the prefix cache and the connector's, then the worker unregisters and the
    KV pages are released."""
    from vllm.v1.request import RequestStatus

    eng.scheduler.finish_requests(None, RequestStatus.FINISHED_ABORTED)
    while eng.scheduler.has_requests():
        eng.step()
    assert eng.scheduler.reset_prefix_cache(reset_running_requests=True, reset_connector=True)
    eng.worker.unregister_kv_caches()
    for cache in eng.kv.values():
        cache.fill_(float("nan"))  # the contents go with the pages


def wake_up(eng: Engine) -> None:
    eng.worker.restore_kv_caches()  # after the pages are mapped again at the same addresses


def test_after_sleep_and_wake_up_requests_are_served_from_the_store_into_the_same_tensors(model, tmp_path):
    eng = Engine(vllm_config(model, extra(tmp_path)))
    try:
        for rid, p in PROMPTS.items():
            eng.add(rid, p)
        before = eng.run()
        sleep(eng)
        wake_up(eng)
        computed = eng.computed
        for rid, p in PROMPTS.items():
            eng.add(rid + "-again", p)
        after = {rid.removesuffix("-again"): out for rid, out in eng.run().items() if rid.endswith("-again")}
        assert after == before
        # vLLM's prefix cache was reset: the prompts came from the store, no block recomputed
        assert {rid: answers[0][0] for rid, answers in eng.matched.items() if rid.endswith("-again")} == \
            {"a-again": 48, "b-again": 16, "c-again": 32}
        assert eng.computed - computed == (53 - 48) + (49 - 48) + (35 - 32) + 2 * 3
    finally:
        eng.close()


def test_a_request_aborted_by_sleep_saves_its_computed_blocks_before_the_pages_go(model, tmp_path):
    eng = Engine(vllm_config(model, extra(tmp_path), budget=20))
    try:
        eng.add("a", PROMPTS["a"], max_tokens=4)
        eng.step()
        eng.step()  # 40 of its 53 prompt tokens computed: blocks 0 and 1 saved
        sleep(eng)  # aborted mid-prefill
        assert "a" not in eng.scheduler.requests  # released during the pause
        wake_up(eng)
        eng.add("a2", PROMPTS["a"], max_tokens=4)
        eng.run()
        assert eng.matched["a2"][0] == (32, False)
    finally:
        eng.close()
