"""A bf16 MLA model restored from the store gives exactly the tokens of the same prompt computed
without a store: the chunk that resumes a loaded prefix computes its prompt tokens the way a
prefill from token 0 does (K/V rebuilt from the latents), not with ``kv_b_proj`` absorbed, whose
bf16 rounding flipped greedy tokens of about one prompt in seven."""

from __future__ import annotations

import pytest

from tests.engine.conftest import make_engine, random_prompt
from tests.engine.test_group_store import BS, serve
from tiered_kv.engine import ModelConfig, SamplingParams

MLA_BF16 = ModelConfig.tiny_mla(dtype="bfloat16")
GREEDY = SamplingParams(max_tokens=8)


# seeds whose restored tokens differed before the fix: 100 tokens (4 computed after the 96
# loaded) and 97 tokens (a resumed chunk of one prompt token)
@pytest.mark.parametrize("length, seeds", [(100, (1, 15, 21)), (97, (5, 6))], ids=["4-token-tail", "1-token-tail"])
def test_a_restarted_bf16_mla_engine_gives_the_tokens_of_a_run_without_the_store(tmp_path, length, seeds):
    for seed in seeds:
        prompt = random_prompt(length, seed=seed)
        without_store = make_engine(MLA_BF16, block_size=BS).generate([prompt], GREEDY)[0]
        store = tmp_path / f"seed{seed}"
        [first], _, _ = serve(store, MLA_BF16, [prompt], GREEDY)
        [restored], misses, [tiers] = serve(store, MLA_BF16, [prompt], GREEDY)  # a new engine: the restart
        assert (restored.num_external_tokens, tiers, misses) == (96, {"disk": 6}, {})
        assert first.output_token_ids == without_store.output_token_ids
        assert restored.output_token_ids == without_store.output_token_ids, f"seed {seed}"


def test_mla_decode_steps_still_attend_over_the_latents_directly():
    """Decodes keep the absorbed path (no K/V rebuilt per token): the same tokens as the dense
    reference, with every generated token computed after the prompt."""
    engine = make_engine(ModelConfig.tiny_mla(), block_size=BS)
    prompt = random_prompt(40, seed=3)
    calls = []
    attention = engine.model.model.layers[0].self_attn
    absorbed = attention._attend_absorbed

    def spy(q, latent, past):
        calls.append(q.shape[0])
        return absorbed(q, latent, past)

    attention._attend_absorbed = spy
    out = engine.generate([prompt], SamplingParams(max_tokens=4))[0]
    assert calls == [1, 1, 1]  # the three decodes after the prompt's step, one token each
    reference = make_engine(ModelConfig.tiny_mla(), block_size=BS)
    tokens = list(prompt)
    for _ in range(4):
        tokens.append(int(reference.model.forward_dense(tokens)[-1].float().argmax()))
    assert out.output_token_ids == tokens[len(prompt):]
