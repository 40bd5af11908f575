"""A small, real paged-attention engine (CPU, CUDA when present) that drives a KV connector.

    from tiered_kv.engine import LLMEngine, ModelConfig, EngineConfig, SamplingParams
    engine = LLMEngine(ModelConfig.demo(), EngineConfig(), seed=0)
    [out] = engine.generate([list(range(100))], SamplingParams(max_tokens=8))
"""

from tiered_kv.engine.config import EngineConfig, ModelConfig
from tiered_kv.engine.connector_api import (
    ConnectorScheduler,
    ConnectorWorker,
    KVConnector,
    RequestData,
    RequestView,
    SchedulerOutput,
)
from tiered_kv.engine.llm_engine import LLMEngine
from tiered_kv.engine.model import LlamaForCausalLM
from tiered_kv.engine.namespace import engine_namespace, weights_revision
from tiered_kv.engine.output import Output
from tiered_kv.engine.sampling_params import SamplingParams

__all__ = [
    "ConnectorScheduler",
    "ConnectorWorker",
    "EngineConfig",
    "KVConnector",
    "LLMEngine",
    "LlamaForCausalLM",
    "ModelConfig",
    "Output",
    "RequestData",
    "RequestView",
    "SamplingParams",
    "SchedulerOutput",
    "engine_namespace",
    "weights_revision",
]
