"""vLLM 0.33's sleep-mode calls on the tiered-kv connector, driven the way vLLM's worker drives
them (``unregister_kv_caches`` before the KV memory is released, ``restore_kv_caches`` after it
is mapped again at the same addresses), over the stand-in engine of ``vllm_engine``."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from tests.integrations.test_vllm_adapter import PROMPTS, Halves, extra
from tests.integrations.vllm_engine import BS, Engine, Request
from tiered_kv.integrations import vllm_lifecycle as lifecycle
from tiered_kv.keys import block_keys


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    for name in [n for n in os.environ if n.startswith("TIERED_KV_")]:
        monkeypatch.delenv(name)


@pytest.fixture
def halves(tmp_path):
    h = Halves(extra(tmp_path))
    yield h
    h.close()


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                 reason="needs a CUDA device"))]


def engine(halves, device: str = "cpu") -> Engine:
    """The stand-in engine, its KV tensors on ``device`` (on CUDA our saves copy on a side stream)."""
    eng = Engine(halves.sched, halves.worker)
    if device != "cpu":
        eng.kv = {name: cache.to(device) for name, cache in eng.kv.items()}
        halves.worker.register_kv_caches(eng.kv)
    return eng


def core(connector):
    """The engine-neutral worker inside a worker-role connector (None on the scheduler role)."""
    side = connector._worker
    return side.core if side is not None else None


def sleep(connector, eng: Engine) -> None:
    """What vLLM's worker does at sleep(level=1): unregister, then the KV pages are released."""
    connector.unregister_kv_caches()
    for cache in eng.kv.values():
        cache.fill_(float("nan"))  # the contents are discarded with the pages


def wake(connector) -> None:
    """wake_up(): the pages are mapped again at the same addresses, then restore."""
    connector.restore_kv_caches()


@pytest.mark.parametrize("device", DEVICES)
def test_after_sleep_and_wake_up_the_store_serves_the_same_tensors_again(halves, device):
    eng = engine(halves, device)
    for rid, p in PROMPTS.items():
        eng.add(rid, p)
    reference = eng.run()
    sleep(halves.worker, eng)
    wake(halves.worker)
    # vLLM's own prefix cache is empty after a sleep; the stand-in has none: every hit is ours
    computed = eng.computed
    for rid, p in PROMPTS.items():
        eng.add(rid + "-again", p)
    outs = eng.run()
    assert {rid.removesuffix("-again"): out for rid, out in outs.items() if rid.endswith("-again")} == reference
    assert {rid: eng.requests[rid + "-again"].external for rid in PROMPTS} == {"a": 28, "b": 24, "c": 20}
    # loaded into the same tensors, not recomputed: only the tails and the generated tokens ran
    assert eng.computed - computed == (31 - 28) + (28 - 24) + (24 - 20) + 3 * 2


def _one_step_meta(halves, rid: str, prompt: list[int], blocks: list[int]):
    """The scheduler half's plan for a new request given ``blocks`` (its external hits loaded)."""
    req = Request(rid, prompt, 1)
    n, _ = halves.sched.get_num_new_matched_tokens(req, 0)
    halves.sched.update_state_after_alloc(req, (blocks,), n)
    so = type("SO", (), {"scheduled_new_reqs": [], "num_scheduled_tokens": {}, "preempted_req_ids": set(),
                         "scheduled_cached_reqs": type("C", (), {"req_ids": [], "resumed_req_ids": set()})()})()
    return n, halves.sched.build_connector_meta(so)


def test_while_unregistered_a_load_is_a_reported_error_and_never_touches_the_released_memory(halves, caplog):
    eng = Engine(halves.sched, halves.worker)
    eng.add("a", PROMPTS["a"])
    eng.run()
    sleep(halves.worker, eng)
    blocks = list(range(40, 48))
    n, meta = _one_step_meta(halves, "x", PROMPTS["a"], blocks)
    assert n == 28 and len(meta.meta.loads) == 1  # the scheduler half still promises the store's blocks
    halves.worker.bind_connector_metadata(meta)
    with caplog.at_level(logging.ERROR):
        halves.worker.start_load_kv(None)
    assert halves.worker.get_block_ids_with_load_errors() == set(blocks[:7])  # vLLM recomputes them
    assert all(torch.isnan(cache).all() for cache in eng.kv.values())
    assert "KV caches are unregistered" in caplog.text
    halves.worker.clear_connector_metadata()


def test_while_unregistered_a_save_is_a_counted_loss_naming_the_reason_not_a_crash(halves, caplog):
    eng = Engine(halves.sched, halves.worker)
    sleep(halves.worker, eng)
    eng.add("a", PROMPTS["a"])
    with caplog.at_level(logging.ERROR):
        eng.step()  # the step goes on; its slots are given back
    store = core(halves.worker).store
    assert store.metrics.snapshot()["events"].get("saves_failed", 0) > 0
    assert "restore_kv_caches" in caplog.text
    assert len(store.host._free) == store.host.num_slots  # no reservation leaked


def test_unregister_and_restore_are_idempotent_and_a_no_op_on_the_scheduler_role(halves):
    Engine(halves.sched, halves.worker)  # registers its KV caches
    worker = core(halves.worker)
    registered = worker.layout
    assert lifecycle.unregister_kv_caches(worker) is True
    assert lifecycle.unregister_kv_caches(worker) is False  # already parked: the same layout kept
    assert lifecycle.is_unregistered(worker) and worker.layout.layout is registered
    assert lifecycle.restore_kv_caches(worker) is True
    assert lifecycle.restore_kv_caches(worker) is False
    assert worker.layout is registered
    assert lifecycle.unregister_kv_caches(core(halves.sched)) is False  # no worker on that role
    assert lifecycle.restore_kv_caches(None) is False


def test_restore_without_unregister_keeps_the_layout_and_a_worker_without_caches_has_nothing_to_park(tmp_path):
    from tiered_kv.connector.worker import ConnectorWorker
    from tiered_kv.integrations.common import acquire_store, release_store

    h = Halves(extra(tmp_path))
    try:
        store = acquire_store(h.worker.settings.config, h.worker.namespace)
        bare = ConnectorWorker(store)  # register_kv_caches never called
        assert lifecycle.unregister_kv_caches(bare) is False and bare.layout is None
        release_store(store)
        Engine(h.sched, h.worker)
        registered = core(h.worker).layout
        assert lifecycle.restore_kv_caches(core(h.worker)) is False and core(h.worker).layout is registered
    finally:
        h.close()


@pytest.mark.parametrize("device", DEVICES)
def test_saves_of_the_last_step_are_in_the_store_when_unregister_returns(halves, device):
    eng = engine(halves, device)
    eng.add("a", PROMPTS["a"], max_tokens=1)
    eng.step()  # prefill: its 7 full blocks are saved in this step
    sleep(halves.worker, eng)
    store = core(halves.worker).store
    keys = block_keys(halves.worker.namespace, PROMPTS["a"])  # no LoRA, salt or images: plain keys
    assert len(keys) == len(PROMPTS["a"]) // BS and store.present(keys) == [True] * len(keys)
    wake(halves.worker)


def test_sleep_mode_is_supported_whatever_the_settings_and_the_scheduler_role_has_nothing_to_do(halves):
    from tiered_kv.integrations.vllm import TieredKVConnector

    read_only = type("KT", (), {"kv_connector_extra_config": {"save": False}})()
    assert TieredKVConnector.supports_sleep_mode(read_only) is True  # a classmethod: read at start-up
    assert lifecycle.supports_sleep_mode(None) is True
    halves.sched.unregister_kv_caches()  # vLLM calls these on workers only; harmless elsewhere
    halves.sched.restore_kv_caches()
