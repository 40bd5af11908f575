"""The cached-sequence interface's compatibility rules (AutoDeploy-style) and the engine's
one-line refusals of a connector that could not store a model's cache."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from tests.engine.conftest import make_engine
from tests.engine.memory_connector import MemoryConnector
from tiered_kv.engine import EngineConfig, ModelConfig, SamplingParams, engine_namespace, weights_revision
from tiered_kv.engine.batch import ScheduledBatch
from tiered_kv.engine.cache_resources import (
    CausalConvHandler,
    GenericStateHandler,
    LatentHandler,
    PagedKVHandler,
    SSMStateHandler,
)
from tiered_kv.engine.cached_sequence import CachedSequenceInterface
from tiered_kv.engine.kv_cache_manager import KVCacheManager
from tiered_kv.engine.sequence import Sequence
from tiered_kv.engine.state_cache_manager import HybridCacheManager
from tiered_kv.errors import ConfigError
from tiered_kv.keys import KeyChain

SSM = SSMStateHandler("float32", num_heads=4, head_dim=8, d_state=6, n_groups=2)  # conv_dim 4*8 + 2*2*6 = 56
CONV = CausalConvHandler("float32", conv_dim=56, kernel_size=4)
KV = PagedKVHandler("float32", num_kv_heads=2, head_dim=16)
ENGINE = EngineConfig(num_blocks=8, block_size=4, max_num_seqs=3)


class Layer(nn.Module):
    """A layer that declares handlers and records the views it is given."""

    def __init__(self, **handlers) -> None:
        super().__init__()
        self.handlers = handlers
        self.views: dict[str, torch.Tensor] = {}

    def cache_resources(self):
        return dict(self.handlers)

    def bind_cache(self, name: str, view: torch.Tensor) -> None:
        self.views[name] = view


def interface(*layers: Layer) -> CachedSequenceInterface:
    cache = CachedSequenceInterface.from_model(nn.ModuleList(layers), ModelConfig.tiny(), ENGINE,
                                               torch.device("cpu"))
    cache.bind()
    return cache


def inside(view: torch.Tensor, buffer: torch.Tensor) -> bool:
    start, size = buffer.data_ptr(), buffer.numel() * buffer.element_size()
    return start <= view.data_ptr() < start + size


def test_compatible_handlers_share_one_hybrid_manager():
    m0, a1, m2, a3 = Layer(conv=CONV, ssm=SSM), Layer(kv=KV), Layer(conv=CONV, ssm=SSM), Layer(kv=KV)
    cache = interface(m0, a1, m2, a3)
    manager = cache.manager
    assert isinstance(manager, HybridCacheManager) and not cache.local_reasons
    assert manager.kv_cache.shape == (2, 2, 8, 4, 2, 16)
    assert manager.state.shape == (2, 3, 56 * 3 + 4 * 8 * 6)  # [state layers, slots, conv + ssm]
    assert m2.views["ssm"].shape == (3, 4, 8, 6) and m2.views["conv"].shape == (3, 56, 3)
    assert m2.views["conv"].data_ptr() == manager.state[1].data_ptr()
    assert all(inside(v, manager.state) for m in (m0, m2) for v in m.views.values())
    assert a3.views["kv"].data_ptr() == manager.kv_cache[0, 1].data_ptr()
    assert [g.kind for g in cache.kv_groups()] == ["full", "state"]
    cache.check_storable()


def test_attention_alone_gets_a_kv_only_manager():
    cache = interface(Layer(kv=KV), Layer(kv=KV))
    assert type(cache.manager) is KVCacheManager and not cache.has_state
    assert cache.kv_groups() == ()  # the classic namespace
    latent = interface(Layer(c=LatentHandler("float32", latent_dim=24)))
    assert latent.manager.kv_cache.shape == (1, 8, 4, 24)
    assert [g.kind for g in latent.kv_groups()] == ["mla"]


def test_a_conv_breaking_the_n_groups_constraint_is_allocated_locally(caplog):
    bad = CausalConvHandler("float32", conv_dim=56 + 4, kernel_size=4)  # n_groups 3 would need 68; none fits 60
    m0, m1 = Layer(conv=CONV, ssm=SSM), Layer(conv=bad, ssm=SSM)
    with caplog.at_level(logging.WARNING, logger="tiered_kv.engine.cached_sequence"):
        cache = interface(m0, Layer(kv=KV), m1)
    reason = cache.local_reasons["2.conv"]
    assert reason == "conv_dim 60 != head_dim*num_heads + 2*n_groups*d_state = 8*4 + 2*2*6 = 56"
    assert "2.conv is allocated locally" in caplog.text
    manager = cache.manager
    assert isinstance(manager, HybridCacheManager)  # the SSM states and the good conv are managed
    assert inside(m1.views["ssm"], manager.state) and inside(m0.views["conv"], manager.state)
    local = m1.views["conv"]
    assert local.shape == (3, 60, 3) and not inside(local, manager.state)
    local.fill_(1.0)
    manager.prepare_resources(_admitted("r"))  # a new request gets slot 0, zeroed, local state too
    assert manager.state_slot("r") == 0 and local[0].abs().sum() == 0 and bool((local[1:] == 1).all())
    with pytest.raises(ConfigError, match=r"^cannot store this model's state: 2\.conv is allocated locally \(conv_dim 60"):
        cache.check_storable()


def _admitted(request_id: str) -> ScheduledBatch:
    ns = engine_namespace(ModelConfig.tiny(), ENGINE, "test")
    request = Sequence(request_id, [1, 2, 3], SamplingParams(max_tokens=2), KeyChain(ns), 0)
    return ScheduledBatch(new_requests=[request], cached_blocks={request_id: []})


def test_unequal_ssm_and_generic_state_are_local_and_unequal_pages_too():
    other_ssm = SSMStateHandler("float32", num_heads=2, head_dim=8, d_state=6, n_groups=1)
    cache = interface(Layer(ssm=SSM, conv=CONV), Layer(ssm=other_ssm, conv=CONV), Layer(kv=KV),
                      Layer(kv=PagedKVHandler("float32", num_kv_heads=1, head_dim=16)),
                      Layer(extra=GenericStateHandler("float32", dims=(5,))))
    assert set(cache.local_reasons) == {"1.ssm", "1.conv", "3.kv", "4.extra"}
    assert cache.local_reasons["1.conv"] == "its layer has no managed SSM state"
    assert cache.local_reasons["4.extra"] == "generic state is not managed"
    assert cache.local["3.kv"].shape == (2, 8, 4, 1, 16)  # a pool of its own, same blocks
    with pytest.raises(ConfigError, match="cannot store"):
        cache.check_storable()


def test_generic_state_without_a_managed_ssm_has_no_slots():
    with pytest.raises(ConfigError, match="needs a managed SSM state"):
        interface(Layer(kv=KV), Layer(extra=GenericStateHandler("float32", dims=(5,))))


def test_bad_handler_sizes_are_refused():
    with pytest.raises(ConfigError, match="0.kv"):
        interface(Layer(kv=PagedKVHandler("float32", num_kv_heads=0, head_dim=16)))


# ---- the engine's refusals ---------------------------------------------------------------------
HYBRID = ModelConfig.tiny_hybrid()


def _namespace(config: ModelConfig, **engine):
    return engine_namespace(config, EngineConfig(**engine), weights_revision(config, seed=0))


def test_a_state_model_with_a_connector_needs_a_block_per_step():
    connector = MemoryConnector(_namespace(HYBRID, block_size=16))
    with pytest.raises(ConfigError, match=r"^engine.max_num_batched_tokens \(8\) must hold a block \(16\)"):
        make_engine(HYBRID, connector=connector, block_size=16, max_num_batched_tokens=8)


@pytest.mark.parametrize("config", [HYBRID, ModelConfig.tiny_mla()], ids=["hybrid", "mla"])
def test_a_connector_without_the_models_groups_is_refused(config):
    llama_ns = _namespace(ModelConfig.tiny())
    with pytest.raises(ConfigError) as err:
        make_engine(config, connector=MemoryConnector(llama_ns))
    assert "\n" not in str(err.value) and "KV groups none" in str(err.value) and config.kind in str(err.value)


def test_a_llama_connector_with_groups_is_refused():
    with pytest.raises(ConfigError, match="needs none"):
        make_engine(connector=MemoryConnector(_namespace(HYBRID)))


def test_a_hybrid_model_dir_is_refused(tmp_path):
    from tiered_kv.engine import LLMEngine
    from tiered_kv.engine.weights import save_pretrained, seeded_model

    save_pretrained(seeded_model(ModelConfig.tiny()), tmp_path)
    with pytest.raises(ConfigError, match="does not match"):
        LLMEngine(HYBRID, EngineConfig(num_blocks=16), model_dir=tmp_path)
