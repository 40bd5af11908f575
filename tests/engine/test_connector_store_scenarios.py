"""The reference engine's scheduler and block pool driving the tiered-kv connector over a real
store (host tier + LMDB in a temp dir): many requests sharing a stored prefix, blocks that vanish
from disk (or a disk that fails) after the lookup promised them, a matched prefix that ends inside
a prefill chunk, a pool too small for all requests at once, and the grouped model kinds.

Every scenario ends the same way: outputs are the greedy tokens of an engine without a connector,
every device block is back on the free list, no request waits for remote KV, no lease is left."""

from __future__ import annotations

import random

import pytest

from storage_backends import registry
from storage_backends.lmdb_disk import LmdbBackend
from storage_backends.registry import register_backend
from tiered_kv.config import TieredKVConfig
from tiered_kv.connector import build_connector
from tiered_kv.engine import (
    EngineConfig,
    LLMEngine,
    ModelConfig,
    SamplingParams,
    engine_namespace,
    weights_revision,
)
from tiered_kv.errors import ConfigError
from tiered_kv.keys import block_keys

BS = 16
GREEDY = SamplingParams(max_tokens=5, temperature=0.0)
ENGINE = EngineConfig(num_blocks=128, max_num_batched_tokens=512)
LLAMA = ModelConfig.tiny()
ASYNC = pytest.mark.parametrize("load_async", [False, True], ids=["sync", "async"])


def prompt(n: int, seed: int, vocab: int = 512) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, vocab) for _ in range(n)]


def namespace(model: ModelConfig = LLAMA, engine: EngineConfig = ENGINE, seed: int = 0):
    return engine_namespace(model, engine, weights_revision(model, seed=seed))


def connector(tmp_path, *, scheme: str = "lmdb", model: ModelConfig = LLAMA, engine: EngineConfig = ENGINE,
              load_async: bool = False, seed: int = 0):
    """A fresh store (empty host tier) over the LMDB directory ``tmp_path/db``."""
    config = TieredKVConfig.from_dict({"host": {"capacity": "8MiB"},
                                       "disk": {"url": f"{scheme}://{tmp_path}/db", "capacity": "256MiB"}})
    return build_connector(config, namespace(model, engine, seed), load_async=load_async)


def reference(prompts, model: ModelConfig = LLAMA, params=GREEDY) -> list[list[int]]:
    engine = LLMEngine(model, EngineConfig(num_blocks=256, max_num_batched_tokens=512), seed=0)
    return [o.output_token_ids for o in engine.generate(prompts, params)]


def store_prompts(tmp_path, prompts, model: ModelConfig = LLAMA, engine: EngineConfig = ENGINE) -> None:
    """A first engine "process" computes and saves the prompts' blocks, then closes its store."""
    conn = connector(tmp_path, model=model, engine=engine)
    LLMEngine(model, engine, conn, seed=0).generate(prompts, GREEDY)
    conn.close()


def assert_all_returned(engine: LLMEngine, conn) -> None:
    kv = engine.kv_cache_manager
    assert not engine.has_unfinished_requests() and not engine.scheduler.loading
    assert engine.num_held_requests == 0
    assert kv.get_num_free_blocks() == kv.get_max_resource_count()
    assert not any(kv.block_manager.ref_counts)
    assert kv.get_num_available_blocks() == kv.get_max_resource_count()  # no reservation left behind
    if kv.has_state:
        assert kv.get_num_free_slots() == engine.engine_config.max_num_seqs
    assert not conn.store.loader._leases and not conn.worker._async_loads


class VanishingLmdb(LmdbBackend):
    """LMDB whose blocks named in ``gone`` disappear the moment they are read (another process
    evicted them after the lookup promised them), and whose reads all fail while ``failing``."""

    gone: set[bytes] = set()  # storage keys
    failing = False

    @classmethod
    def from_url(cls, url, **options):
        return super().from_url("lmdb" + url[len("vanishing"):], **options)

    def _before_read(self, keys) -> None:
        if VanishingLmdb.failing:
            raise OSError("disk read failed")
        doomed = [k for k in keys if k in VanishingLmdb.gone]
        if doomed:
            self.delete_many(doomed)

    def visit_many(self, keys, *args, **kwargs):
        self._before_read(keys)
        return super().visit_many(keys, *args, **kwargs)

    def visit_ranges(self, keys, *args, **kwargs):
        self._before_read(keys)
        return super().visit_ranges(keys, *args, **kwargs)

    def visit_split(self, keys, *args, **kwargs):
        self._before_read(keys)
        return super().visit_split(keys, *args, **kwargs)

    def get_many(self, keys, *args, **kwargs):
        self._before_read(keys)
        return super().get_many(keys, *args, **kwargs)


@pytest.fixture
def vanishing(monkeypatch):
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    register_backend("vanishing", f"{__name__}:VanishingLmdb")
    monkeypatch.setattr(VanishingLmdb, "gone", set())
    monkeypatch.setattr(VanishingLmdb, "failing", False)
    return VanishingLmdb


@ASYNC
def test_many_requests_sharing_a_stored_prefix_load_it_and_give_every_block_back(tmp_path, load_async):
    shared = prompt(200, seed=7)
    store_prompts(tmp_path, [shared + [5]])
    prompts = [shared + prompt(10 + i, seed=100 + i) for i in range(8)]
    conn = connector(tmp_path, load_async=load_async)
    engine = LLMEngine(LLAMA, ENGINE, conn, seed=0)
    outs = engine.generate(prompts, GREEDY)
    assert [o.output_token_ids for o in outs] == reference(prompts)
    assert [o.num_external_tokens for o in outs] == [192] * 8  # each loads the 12 stored blocks
    assert_all_returned(engine, conn)
    conn.close()


@ASYNC
@pytest.mark.parametrize("how", ["deleted", "disk_fails"])
def test_blocks_gone_after_the_lookup_promised_them_are_recomputed(tmp_path, vanishing, load_async, how):
    prompts = [prompt(200, seed=7), prompt(130, seed=8)]
    store_prompts(tmp_path, prompts)
    ns = namespace()
    third = block_keys(ns, prompts[0])[3]
    vanishing.gone = {ns.digest() + third}
    conn = connector(tmp_path, scheme="vanishing", load_async=load_async)
    engine = LLMEngine(LLAMA, ENGINE, conn, seed=0)
    assert conn.store.lookup(block_keys(ns, prompts[0])[:12]) == 12  # the lookup promises them all
    vanishing.failing = how == "disk_fails"
    outs = engine.generate(prompts, GREEDY)
    vanishing.failing = False
    assert [o.output_token_ids for o in outs] == reference(prompts)
    if how == "deleted":  # blocks 0..2 loaded; the rest recomputed from the vanished block on
        assert [o.num_external_tokens for o in outs] == [3 * BS, 128]
    else:
        assert [o.num_external_tokens for o in outs] == [0, 0]
    assert_all_returned(engine, conn)
    conn.close()
    # what was recomputed was saved again: the next engine loads every block
    conn = connector(tmp_path)
    again = LLMEngine(LLAMA, ENGINE, conn, seed=0).generate(prompts, GREEDY)
    assert [o.num_external_tokens for o in again] == [192, 128]
    assert [o.output_token_ids for o in again] == reference(prompts)
    conn.close()


@ASYNC
def test_a_matched_prefix_ending_inside_a_prefill_chunk(tmp_path, load_async):
    base = prompt(260, seed=3)
    store_prompts(tmp_path, [base[:200]])  # blocks 0..11 stored
    small = EngineConfig(num_blocks=64, max_num_batched_tokens=40)  # chunks of 40: never block-aligned
    warm = base[:70] + prompt(5, seed=4)  # leaves blocks 0..3 on the device
    conn = connector(tmp_path, load_async=load_async, engine=small)
    engine = LLMEngine(LLAMA, small, conn, seed=0)
    first = engine.generate([warm], GREEDY)[0]
    [out] = engine.generate([base], GREEDY)
    assert (out.num_cached_tokens, out.num_external_tokens) == (64, 192 - 64)  # device hit, then loaded
    assert out.num_prefilled_tokens == 260 - 192  # 192..232 and 232..260
    assert [first.output_token_ids, out.output_token_ids] == reference([warm, base])
    assert_all_returned(engine, conn)
    conn.close()


@ASYNC
def test_a_pool_too_small_for_all_requests_admits_them_in_turn_and_gives_every_block_back(tmp_path, load_async):
    shared = prompt(150, seed=11)
    store_prompts(tmp_path, [shared + [9]])
    prompts = [shared[: 100 + 10 * i] + prompt(20, seed=200 + i) for i in range(6)]
    tight = EngineConfig(num_blocks=24, max_num_batched_tokens=64)  # room for about two requests
    conn = connector(tmp_path, load_async=load_async, engine=tight)
    engine = LLMEngine(LLAMA, tight, conn, seed=0)
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    done, queued_behind_a_full_pool = {}, False
    while engine.has_unfinished_requests():
        queued_behind_a_full_pool |= bool(engine.scheduler.waiting) and bool(engine.scheduler.running)
        done.update((o.request_id, o) for o in engine.step())
    assert queued_behind_a_full_pool
    assert [done[i].output_token_ids for i in ids] == reference(prompts)
    assert all(done[i].num_external_tokens > 0 or done[i].num_cached_tokens > 0 for i in ids)
    assert_all_returned(engine, conn)
    conn.close()


GROUPED = pytest.mark.parametrize("model", [ModelConfig.tiny_hybrid(), ModelConfig.tiny_mla()], ids=["hybrid", "mla"])


@GROUPED
@ASYNC
def test_grouped_models_recompute_blocks_gone_after_the_lookup(tmp_path, vanishing, model, load_async):
    prompts = [prompt(100, seed=31, vocab=model.vocab_size), prompt(70, seed=32, vocab=model.vocab_size)]
    store_prompts(tmp_path, prompts, model=model)
    ns = namespace(model)
    vanishing.gone = {ns.digest() + block_keys(ns, prompts[0])[2]}
    conn = connector(tmp_path, scheme="vanishing", model=model, load_async=load_async)
    engine = LLMEngine(model, ENGINE, conn, seed=0)
    outs = engine.generate(prompts, GREEDY)
    assert [o.output_token_ids for o in outs] == reference(prompts, model)
    # the hybrid resumes only where the recurrent state is held: from its first token
    expected = 0 if model.kind == "hybrid" else 2 * BS
    assert [o.num_external_tokens for o in outs] == [expected, 64]
    assert_all_returned(engine, conn)
    conn.close()


@pytest.mark.parametrize("other", ["revision", "cache_salt"])
def test_regression_a_connector_keyed_for_another_namespace_served_its_kv_to_this_engine(tmp_path, other):
    """A connector built for other weights (or another tenant's salt) was accepted when its KV
    groups matched: the engine then loaded KV another model computed (other tokens out)."""
    store_prompts(tmp_path, [prompt(200, seed=3)])  # seed-0 weights, no salt
    conn = connector(tmp_path)
    engine = EngineConfig(num_blocks=128, max_num_batched_tokens=512, cache_salt="tenant-b" if other == "cache_salt" else "")
    with pytest.raises(ConfigError, match=f"namespace differs from this engine's in {other}"):
        LLMEngine(LLAMA, engine, conn, seed=1 if other == "revision" else 0)
    conn.close()
