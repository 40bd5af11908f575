"""Reference engines with and without a tiered-kv connector, for connector scenarios."""

from __future__ import annotations

from pathlib import Path

from tiered_kv.config import TieredKVConfig
from tiered_kv.connector import TieredKVConnector, build_connector
from tiered_kv.engine import (
    EngineConfig,
    LLMEngine,
    ModelConfig,
    SamplingParams,
    engine_namespace,
    weights_revision,
)

MODEL = ModelConfig.tiny()
ENGINE = EngineConfig(num_blocks=256, max_num_batched_tokens=512)
GREEDY = SamplingParams(max_tokens=6, temperature=0.0)


def connector(path: Path | None, *, host: str = "8MiB", load_async: bool = False, disk_url: str | None = None,
              **cfg) -> TieredKVConnector:
    ns = engine_namespace(MODEL, ENGINE, weights_revision(MODEL, seed=0))
    config = {"host": {"capacity": host}, **cfg}
    if path is not None or disk_url is not None:
        config["disk"] = {"url": disk_url or f"lmdb://{path}", "capacity": "256MiB"}
    return build_connector(TieredKVConfig.from_dict(config), ns, load_async=load_async)


def engine(conn: TieredKVConnector | None = None, engine_config: EngineConfig = ENGINE) -> LLMEngine:
    return LLMEngine(MODEL, engine_config, conn, seed=0)


def prompt(n: int, seed: int = 1) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(1, MODEL.vocab_size) for _ in range(n)]


def reference(prompts: list[list[int]]) -> list[list[int]]:
    """Greedy outputs without any connector."""
    return [o.output_token_ids for o in engine().generate(prompts, GREEDY)]
