"""Scenarios of the reference engine's hybrid (Mamba2 + attention) and MLA models over a real
store (host + LMDB) through the grouped connector: an engine saves, a restarted engine loads its
blocks (and, for the hybrid, the recurrent state at the hit's last block) instead of prefilling;
misses, a corrupt block entry and a corrupt state entry are counted misses with the same outputs."""

from __future__ import annotations

import pytest
import torch

from tests.engine.conftest import make_engine, random_prompt
from tests.store.helpers import rewrite_stored_blocks
from tiered_kv.config import TieredKVConfig
from tiered_kv.connector import build_connector
from tiered_kv.engine import EngineConfig, ModelConfig, SamplingParams, engine_namespace, weights_revision
from tiered_kv.keys import block_keys

BS = 16
HYBRID = ModelConfig.tiny_hybrid()
MLA = ModelConfig.tiny_mla()
KINDS = pytest.mark.parametrize("config", [HYBRID, MLA], ids=["hybrid", "mla"])
PROMPT = random_prompt(100, seed=31)  # six full blocks and 4 tokens
PARAMS = SamplingParams(max_tokens=6, return_logits=True)


def namespace(config: ModelConfig):
    return engine_namespace(config, EngineConfig(block_size=BS), weights_revision(config, seed=0))


def connector(tmp_path, config: ModelConfig, **options):
    cfg = TieredKVConfig.load({"host": {"capacity": "16MiB"},
                               "disk": {"url": f"lmdb://{tmp_path}/db", "capacity": "256MiB"}})
    return build_connector(cfg, namespace(config), **options)


def serve(tmp_path, config: ModelConfig, prompts, params=PARAMS, **options):
    """One engine "process" over the store: outputs, store misses by reason, blocks per tier."""
    conn = connector(tmp_path, config, **options)
    try:
        engine = make_engine(config, connector=conn, block_size=BS)
        outs = [engine.generate([p], params)[0] for p in prompts]
        tiers = [dict(conn.worker.load_stats.get(o.request_id, {})) for o in outs]
        misses = {r: n for t in conn.store.stats()["tiers"].values() for r, n in t["misses"].items()}
    finally:
        conn.close()
    return outs, misses, tiers


def recomputed(config: ModelConfig, prompt, params=PARAMS):
    return make_engine(config, block_size=BS).generate([prompt], params)[0]


def same(a, b, config: ModelConfig) -> bool:
    """Same tokens; logits bit-identical for the hybrid (both runs compute the tail in the same
    chunk from the same bytes), within float noise for MLA (a resumed chunk attends over the
    loaded latents in other chunk shapes than a prefill from token 0: the same math, summed
    otherwise; only decodes absorb kv_b_proj)."""
    if a.output_token_ids != b.output_token_ids:
        return False
    if config is MLA:
        return all(torch.allclose(x, y, rtol=1e-4, atol=1e-4) for x, y in zip(a.logits, b.logits))
    return all(torch.equal(x, y) for x, y in zip(a.logits, b.logits))


def flip_entries(tmp_path, keys: set[bytes]) -> int:
    """Flip a byte in the body of the stored entries ``keys`` (storage keys), behind the store."""
    def flip(storage_key, value):
        return value[:-5] + bytes([value[-5] ^ 0x44]) + value[-4:] if storage_key in keys else None

    return rewrite_stored_blocks(tmp_path / "db", flip)


@KINDS
def test_a_restarted_engine_loads_the_prefix_and_gives_the_same_outputs(tmp_path, config):
    [first], _, _ = serve(tmp_path, config, [PROMPT])
    assert (first.num_external_tokens, first.num_prefilled_tokens, first.state_loaded) == (0, 100, False)
    [again], misses, [tiers] = serve(tmp_path, config, [PROMPT])
    assert same(again, first, config)  # the loaded KV (and state) is what was computed
    assert (again.num_external_tokens, again.num_prefilled_tokens) == (96, 4)
    assert again.state_loaded == (config is HYBRID)
    assert tiers == {"disk": 6 + (config is HYBRID)}  # six block entries (+ one state entry)
    assert not misses


def test_hybrid_prefill_ends_a_step_on_the_last_block_boundary_before_the_last_token(tmp_path):
    conn = connector(tmp_path, HYBRID)
    try:
        engine = make_engine(HYBRID, connector=conn, block_size=BS)
        rid = engine.add_request(PROMPT, PARAMS)
        engine.step()
        assert engine.get_request(rid).num_computed_tokens == 96  # state at block 5 is saved here
        engine.step()
        assert engine.get_request(rid).num_computed_tokens == 100
        while engine.has_unfinished_requests():
            engine.step()
        engine.drain(5)
        keys = block_keys(namespace(HYBRID), PROMPT)
        ns = namespace(HYBRID)
        held = conn.store.present([ns.state_key(k) for k in keys])
        assert list(held) == [False] * 5 + [True]
    finally:
        conn.close()
    plain = make_engine(HYBRID, block_size=BS)  # without a connector: one 100-token chunk
    rid = plain.add_request(PROMPT, PARAMS)
    plain.step()
    assert plain.get_request(rid).num_computed_tokens == 100


@KINDS
def test_a_prompt_never_stored_is_a_miss_with_the_recomputed_outputs(tmp_path, config):
    serve(tmp_path, config, [PROMPT])
    other = random_prompt(100, seed=32)
    [out], _, [tiers] = serve(tmp_path, config, [other])
    assert (out.num_external_tokens, out.num_prefilled_tokens, out.state_loaded, tiers) == (0, 100, False, {})
    alone = recomputed(config, other)  # (a hybrid without a connector prefills in one chunk, not 96 + 4)
    assert out.output_token_ids == alone.output_token_ids
    torch.testing.assert_close(out.logits, alone.logits, rtol=1e-4, atol=1e-4)


@KINDS
def test_a_corrupt_block_entry_is_a_counted_miss_with_the_same_outputs(tmp_path, config):
    [first], _, _ = serve(tmp_path, config, [PROMPT])
    ns = namespace(config)
    assert flip_entries(tmp_path, {ns.digest() + block_keys(ns, PROMPT)[3]}) == 1
    [again], misses, _ = serve(tmp_path, config, [PROMPT])
    assert misses.get("corrupt") == 1
    assert same(again, first, config)
    # prefilled counts the 4 tokens computed over the failed load in its step, then the recompute
    if config is HYBRID:  # no state at block 2: the whole load fails, recomputed from token 0
        assert (again.num_external_tokens, again.num_prefilled_tokens, again.state_loaded) == (0, 4 + 100, False)
    else:  # blocks 0..2 loaded, block 3 onwards recomputed
        assert (again.num_external_tokens, again.num_prefilled_tokens) == (48, 4 + 52)


def test_a_corrupt_state_entry_is_a_counted_miss_and_the_hybrid_recomputes_from_token_zero(tmp_path):
    [first], _, _ = serve(tmp_path, HYBRID, [PROMPT])
    ns = namespace(HYBRID)
    assert flip_entries(tmp_path, {ns.digest() + ns.state_key(block_keys(ns, PROMPT)[5])}) == 1
    [again], misses, _ = serve(tmp_path, HYBRID, [PROMPT])
    assert misses.get("corrupt") == 1
    assert same(again, first, HYBRID)
    assert (again.num_external_tokens, again.num_prefilled_tokens, again.state_loaded) == (0, 4 + 100, False)


def test_hybrid_async_loads_resume_from_the_loaded_state(tmp_path):
    [first], _, _ = serve(tmp_path, HYBRID, [PROMPT])
    [again], misses, _ = serve(tmp_path, HYBRID, [PROMPT], load_async=True)
    assert same(again, first, HYBRID) and again.state_loaded and again.num_external_tokens == 96


def test_a_chat_turn_resumes_from_a_state_saved_while_decoding(tmp_path):
    prompt = random_prompt(40, seed=33)  # decoding 30 tokens crosses the boundaries at 48 and 64
    [turn1], _, _ = serve(tmp_path, HYBRID, [prompt], SamplingParams(max_tokens=30))
    follow_up = prompt + turn1.output_token_ids + random_prompt(10, seed=34)  # 80 tokens
    [turn2], _, [tiers] = serve(tmp_path, HYBRID, [follow_up], SamplingParams(max_tokens=6))
    assert turn2.state_loaded and turn2.num_external_tokens == 64 and tiers == {"disk": 5}
    reference = recomputed(HYBRID, follow_up, SamplingParams(max_tokens=6))
    assert turn2.output_token_ids == reference.output_token_ids


def test_an_mla_prefix_is_stored_once_as_latents(tmp_path):
    serve(tmp_path, MLA, [PROMPT])
    conn = connector(tmp_path, MLA)
    try:
        ns = conn.store.namespace
        assert ns.block_shape == (2 * BS * (32 + 8),)  # two layers of 16 latents of 40 values
        assert (ns.tp_rank, ns.tp_size) == (0, 1)
    finally:
        conn.close()


def test_mla_async_loads_give_the_same_outputs(tmp_path):
    [first], _, _ = serve(tmp_path, MLA, [PROMPT])
    [again], _, [tiers] = serve(tmp_path, MLA, [PROMPT], load_async=True)
    assert same(again, first, MLA) and again.num_external_tokens == 96 and tiers == {"disk": 6}


def test_a_loaded_state_is_the_state_a_full_prefill_leaves_at_that_boundary(tmp_path):
    prompt = PROMPT[:97]  # six full blocks and one token: run 2 loads 96 tokens, computes token 96
    serve(tmp_path, HYBRID, [prompt])
    plain = make_engine(HYBRID, block_size=BS, max_num_batched_tokens=96)  # no connector: 96, then 1
    rid = plain.add_request(prompt, PARAMS)
    plain.step()
    plain.step()
    expected = plain.kv_cache_manager.state[:, plain.kv_cache_manager.state_slot(rid)].clone()
    conn = connector(tmp_path, HYBRID)
    try:
        engine = make_engine(HYBRID, connector=conn, block_size=BS)
        rid = engine.add_request(prompt, PARAMS)
        engine.step()  # load 96 tokens and their state, compute token 96
        request = engine.get_request(rid)
        assert request.state_loaded and request.num_computed_tokens == 97
        assert torch.equal(engine.kv_cache_manager.state[:, engine.kv_cache_manager.state_slot(rid)], expected)
    finally:
        conn.close()


def test_a_hybrid_prefill_is_not_held_back_by_decodes_under_a_one_block_budget(tmp_path):
    """Decodes take part of a one-block step budget: the prefill beside them still advances (a
    chunk short of the next boundary, then one ending on it) and every boundary's state is stored."""
    prompt = random_prompt(40, seed=32)
    params = SamplingParams(max_tokens=3, return_logits=True)
    reference = recomputed(HYBRID, prompt, params)
    conn = connector(tmp_path, HYBRID)
    try:
        engine = make_engine(HYBRID, connector=conn, block_size=BS, max_num_batched_tokens=BS)
        engine.add_request(random_prompt(20, seed=33), SamplingParams(max_tokens=30))
        for _ in range(3):  # prefilled, decoding
            engine.step()
        request_id = engine.add_request(prompt, params)
        steps = 0
        while engine.get_request(request_id).is_prefill:
            engine.step()
            steps += 1
        assert steps <= 8 and engine.has_unfinished_requests()  # beside the decode, not after it
        while engine.has_unfinished_requests():
            engine.step()
        assert engine.drain(30.0)
        ns = namespace(HYBRID)
        assert conn.store.lookup([ns.state_key(k) for k in block_keys(ns, prompt)[:2]]) == 2
    finally:
        conn.close()
    [again], _, _ = serve(tmp_path, HYBRID, [prompt], params)
    assert again.output_token_ids == reference.output_token_ids
    assert (again.num_external_tokens, again.state_loaded) == (32, True)
