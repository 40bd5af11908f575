"""Hybrid (Mamba2 + attention) and MLA models: the paged engine gives what the dense, cache-free
references give, chunked prefill continues the recurrent state exactly, every cached value
reaches the output, and the classic Llama's identity is untouched."""

from __future__ import annotations

import pytest
import torch

from tests.engine.conftest import dense_greedy, make_engine, random_prompt
from tiered_kv.engine import EngineConfig, ModelConfig, SamplingParams, engine_namespace, weights_revision
from tiered_kv.engine.attention import AttentionMetadata
from tiered_kv.engine.mamba import Mamba2Mixer, ssd_reference, ssd_scan
from tiered_kv.errors import ConfigError

GREEDY = SamplingParams(max_tokens=8)
HYBRID = ModelConfig.tiny_hybrid()
MLA = ModelConfig.tiny_mla()


def test_chunked_scan_equals_the_token_by_token_recurrence():
    gen = torch.Generator().manual_seed(0)
    n, heads, dim, state = 150, 4, 8, 5
    x, B, C = (torch.randn(n, heads, k, generator=gen) for k in (dim, state, state))
    dt, A = torch.rand(n, heads, generator=gen) * 0.3, -5 * torch.rand(heads, generator=gen)
    h0 = torch.randn(heads, dim, state, generator=gen)
    y_ref, h_ref = ssd_reference(x, dt, A, B, C, h0)
    for chunk in (1, 7, 64, 200):
        y, h = ssd_scan(x, dt, A, B, C, h0, chunk=chunk)
        torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(h, h_ref, rtol=1e-4, atol=1e-4)


def _mixer() -> Mamba2Mixer:
    torch.manual_seed(3)
    mixer = Mamba2Mixer(0, 32, num_heads=4, head_dim=8, d_state=6, n_groups=2, conv_kernel=4, eps=1e-5,
                        dtype="float32")
    with torch.no_grad():
        mixer.A_log.uniform_(0, 2)
        mixer.dt_bias.uniform_(-3, 0)
    mixer.bind_cache("conv_state", torch.zeros(3, mixer.conv_dim, 3))
    mixer.bind_cache("ssm_state", torch.zeros(3, 4, 8, 6))
    return mixer


def test_mamba_steps_continue_from_their_slot_as_one_pass_from_zero():
    mixer = _mixer()
    hidden = torch.randn(50, 32)
    dense = mixer(hidden)
    pieces, outs = (0, 17, 18, 40, 50), []
    with torch.no_grad():
        for first, last in zip(pieces, pieces[1:]):  # slot 1, in uneven chunks (one of a single token)
            meta = AttentionMetadata(torch.empty(0), [0, last - first], [], [], state_slots=[1])
            outs.append(mixer(hidden[first:last], meta))
    torch.testing.assert_close(torch.cat(outs), dense, rtol=1e-4, atol=1e-4)
    assert mixer.ssm_state[0].abs().sum() == 0 and mixer.conv_state[2].abs().sum() == 0  # other slots untouched
    torch.testing.assert_close(mixer.conv_state[1], mixer.in_proj(hidden[-3:])[:, 32:32 + mixer.conv_dim].T)


@pytest.mark.parametrize("config", [HYBRID, MLA], ids=["hybrid", "mla"])
@pytest.mark.parametrize("budget", [2048, 40])
def test_paged_engine_matches_the_dense_reference(config, budget):
    engine = make_engine(config, max_num_batched_tokens=budget, block_size=16)
    prompts = [random_prompt(n, seed=n) for n in (70, 33, 5)]
    outs = engine.generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outs):
        assert out.output_token_ids == dense_greedy(engine, prompt, GREEDY.max_tokens)


def test_paged_logits_match_dense_logits_closely():
    for config in (HYBRID, MLA):
        engine = make_engine(config, max_num_batched_tokens=24)
        prompt = random_prompt(60, seed=5)
        [out] = engine.generate([prompt], SamplingParams(max_tokens=1, return_logits=True))
        torch.testing.assert_close(out.logits[0], engine.model.forward_dense(prompt)[-1], rtol=1e-4, atol=1e-4)


def test_mla_reuses_device_prefix_blocks_and_the_hybrid_does_not():
    prompt = random_prompt(80, seed=8)
    mla = make_engine(MLA)
    first, second = mla.generate([prompt, prompt], GREEDY)
    assert second.output_token_ids == first.output_token_ids
    assert mla.generate([prompt], GREEDY)[0].num_cached_tokens == 64
    hybrid = make_engine(HYBRID)
    hybrid.generate([prompt], GREEDY)
    assert hybrid.generate([prompt], GREEDY)[0].num_cached_tokens == 0  # no state kept per block


def _state_parts(engine, request):
    slot = engine.kv_cache_manager.state_slot(request.request_id)
    mixer = engine.model.model.layers[0].mixer
    return mixer.conv_state[slot], mixer.ssm_state[slot]


@pytest.mark.parametrize("part", ["conv", "ssm", "kv", "c_kv", "k_rope"])
def test_every_cached_value_reaches_the_output(part):
    config = MLA if part in ("c_kv", "k_rope") else HYBRID
    prompt = random_prompt(40, seed=2)

    def run(tamper):
        engine = make_engine(config)
        rid = engine.add_request(prompt, SamplingParams(max_tokens=3, return_logits=True))
        engine.step()  # the prompt, one token sampled
        if tamper:
            request = engine.get_request(rid)
            if part in ("conv", "ssm"):
                conv, ssm = _state_parts(engine, request)
                (conv if part == "conv" else ssm)[0, 0] += 0.5  # oldest conv input / one SSM entry
            elif part == "kv":
                engine.kv_cache_manager.kv_cache[1, 0, request.block_ids[0], 3, 1] += 0.5  # V of token 3
            else:
                rank = config.kv_lora_rank
                cols = slice(0, rank) if part == "c_kv" else slice(rank, None)
                engine.kv_cache_manager.kv_cache[0, request.block_ids[0], 3, cols] += 0.5
        while engine.has_unfinished_requests():
            out = engine.step()
        return out[0].logits[1]

    assert not torch.allclose(run(False), run(True), rtol=0, atol=1e-6)


def test_state_slots_are_returned_and_zeroed_for_the_next_request():
    engine = make_engine(HYBRID, max_num_seqs=2)
    outs = engine.generate([random_prompt(30, seed=i) for i in range(5)], GREEDY)
    assert engine.kv_cache_manager.get_num_free_slots() == 2
    again = make_engine(HYBRID).generate([random_prompt(30, seed=4)], GREEDY)
    assert again[0].output_token_ids == outs[4].output_token_ids


def test_hybrid_namespace_groups_and_buffers():
    engine = make_engine(HYBRID, num_blocks=64, block_size=16, max_num_seqs=3)
    full, state = engine.namespace.groups
    conv_dim = 4 * 16 + 2 * 2 * 8
    assert (full.kind, full.num_layers, full.shape) == ("full", 2, (2, 2, 16))
    assert (state.kind, state.num_layers, state.shape) == ("state", 2, (conv_dim * 3 + 4 * 16 * 8,))
    kv, states = engine.cache.connector_caches()
    assert kv.shape == (2, 2, 64, 16, 2, 16) and states.shape == (2, 3, conv_dim * 3 + 4 * 16 * 8)
    mixer = engine.model.model.layers[2].mixer  # the second Mamba2 layer: state row 1
    assert mixer.conv_state.data_ptr() == states[1].data_ptr()
    assert mixer.ssm_state.data_ptr() == states[1, 0, conv_dim * 3:].data_ptr()
    assert engine.model.model.layers[3].self_attn.k_cache.data_ptr() == kv[0, 1].data_ptr()


def test_mla_namespace_stores_one_latent_per_token():
    engine = make_engine(MLA, num_blocks=32)
    [group] = engine.namespace.groups
    assert (group.kind, group.num_layers, group.shape) == ("mla", 2, (32 + 8,))
    assert (engine.namespace.tp_rank, engine.namespace.tp_size, engine.namespace.num_kv_heads) == (0, 1, 1)
    [latents] = engine.cache.connector_caches()
    assert latents.shape == (2, 32, 16, 40)
    assert engine.model.model.layers[1].self_attn.latent_cache.data_ptr() == latents[1].data_ptr()


def test_llama_identity_is_unchanged_by_model_kinds():
    config = ModelConfig()
    assert weights_revision(config, seed=0) == "seed0-a5aaae7f3bbbf5ca"  # as before kinds existed
    assert weights_revision(ModelConfig.tiny(), seed=0) == "seed0-32342430fce524de"
    ns = engine_namespace(config, EngineConfig(), weights_revision(config, seed=0))
    assert ns.groups == () and "groups" not in ns.describe()


@pytest.mark.parametrize("bad, field", [
    (dict(kind="rwkv"), "kind"),
    (dict(kind="hybrid", layer_pattern="M*"), "layer_pattern"),  # 2 characters, 4 layers
    (dict(kind="hybrid", layer_pattern="MMMM"), "layer_pattern"),  # no attention
    (dict(kind="hybrid", layer_pattern="M*x*"), "layer_pattern"),
    (dict(kind="hybrid", layer_pattern="M*M*", mamba_num_heads=3, mamba_n_groups=2), "mamba_n_groups"),
    (dict(kind="hybrid", layer_pattern="M*M*", conv_kernel=1), "conv_kernel"),
    (dict(layer_pattern="M*M*"), "layer_pattern"),  # a Llama has no pattern
    (dict(kind="mla", qk_rope_head_dim=7), "qk_rope_head_dim"),
    (dict(kind="mla", kv_lora_rank=0), "kv_lora_rank"),
])
def test_model_kind_config_rejects(bad, field):
    with pytest.raises(ConfigError, match=field):
        ModelConfig.tiny(num_layers=4, **bad)


def test_only_llama_models_have_a_hugging_face_config():
    with pytest.raises(ConfigError, match="llama"):
        HYBRID.to_hf_config()
