"""Two KV cache groups under vLLM 0.33's hybrid allocator: layer 0 full attention, layer 1 a
sliding window of two blocks. Our connector is a ``SupportsHMA`` connector, so vLLM keeps the
hybrid allocator on and hands it block ids per group (its null block behind the window)."""

from __future__ import annotations

import random

import pytest

from tests.integrations.vllm33.rig import BS, Engine, kv_cache_config, vllm_config, write_model

pytestmark = pytest.mark.vllm33

WINDOW = 2 * BS


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 999) for _ in range(n)]


PROMPTS = {"a": prompt(90, 0), "c": prompt(50, 1)}


@pytest.fixture
def model(tmp_path, monkeypatch):
    for name in [n for n in __import__("os").environ if n.startswith("TIERED_KV_")]:
        monkeypatch.delenv(name)
    return write_model(tmp_path / "model")


def engine(model, extra):
    return Engine(vllm_config(model, extra), kv_cache_config(sliding_window=WINDOW))


def run(model, extra, prompts):
    eng = engine(model, extra)
    try:
        for rid, p in prompts.items():
            eng.add(rid, p)
        return eng.run(), eng
    finally:
        eng.close()


def test_a_second_hybrid_engine_loads_both_groups_and_outputs_match(model, tmp_path):
    extra = {"disk": {"url": f"lmdb://{tmp_path}/db"}}
    reference, _ = run(model, None, PROMPTS)
    first, eng1 = run(model, extra, PROMPTS)
    assert first == reference and eng1.loads() == {}
    assert eng1.connector.__class__.__name__ == "TieredKVConnector" and len(eng1.kvc.kv_cache_groups) == 2
    second, eng2 = run(model, extra, PROMPTS)
    assert second == reference
    # several groups: loads are asynchronous (a failed load fails the request as a whole)
    assert eng2.matched == {"a": [(80, True)], "c": [(48, True)]}
    assert eng2.computed == (90 - 80) + (50 - 48) + 2 * 2


def test_load_rows_follow_vllms_block_tables_and_skip_its_null_blocks(model, tmp_path):
    extra = {"disk": {"url": f"lmdb://{tmp_path}/db"}}
    run(model, extra, {"a": PROMPTS["a"]})
    eng = engine(model, extra)
    try:
        eng.add("a", PROMPTS["a"])
        eng.step()
        [load] = eng.metas[0].meta.loads
        full, sliding = eng.scheduler.kv_cache_manager.get_block_ids("a")
        assert sliding[:3] == [0, 0, 0]  # behind the window: vLLM's null block
        assert load.rows == tuple((full[i], sliding[i] if sliding[i] else -1) for i in range(5))
        assert [row[1] for row in load.rows] == [-1, -1, -1, sliding[3], sliding[4]]
        eng.run()
    finally:
        eng.close()
