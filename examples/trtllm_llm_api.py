"""TensorRT-LLM's LLM API (PyTorch backend) with tiered-kv attached as its KV cache connector.

Run it twice with the same store: the first process prefills and saves every full block; the
second (a new process) loads them back and skips their prefill::

    python examples/trtllm_llm_api.py --model TinyLlama/TinyLlama-1.1B-Chat-v1.0 \\
        --store lmdb:///tmp/tiered-kv-trtllm
    python examples/trtllm_llm_api.py --model TinyLlama/TinyLlama-1.1B-Chat-v1.0 \\
        --store lmdb:///tmp/tiered-kv-trtllm

TensorRT-LLM's ``KvCacheConnectorConfig`` names only the module and the two classes, so the store
is configured by ``TIERED_KV_*`` environment variables (or ``TIERED_KV_CONFIG_FILE`` pointing at
a TOML file), which this script sets before the engine starts. Needs a CUDA GPU and
``pip install tensorrt_llm``; the adapter itself is tested here without either
(``tests/integrations/test_trtllm.py`` drives it in the executor's call order).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

SYSTEM_PROMPT = (
    "You are a support assistant for a storage appliance. Answer briefly and cite the manual "
    "section you used. " * 40  # a long shared prefix: many full blocks to keep across restarts
)
QUESTIONS = ["How do I replace a failed disk?", "What does error E42 mean?",
             "How often should the firmware be updated?"]


def connector_environment(store: str, host_capacity: str = "4GiB") -> dict[str, str]:
    """The ``TIERED_KV_*`` settings the adapter reads at engine start-up."""
    return {"TIERED_KV_DISK_URL": store, "TIERED_KV_DISK_CAPACITY": "64GiB",
            "TIERED_KV_HOST_CAPACITY": host_capacity}


def connector_config_kwargs() -> dict[str, str]:
    """What ``KvCacheConnectorConfig`` needs: where our scheduler and worker halves live."""
    return {"connector_module": "tiered_kv.integrations.trtllm",
            "connector_scheduler_class": "TieredKVScheduler",
            "connector_worker_class": "TieredKVWorker"}


def _connector_config_class():
    try:  # newer releases
        from tensorrt_llm.llmapi.llm_args import KvCacheConnectorConfig
    except ImportError:  # the first releases with connectors
        from tensorrt_llm.models.modeling_utils import KvCacheConnectorConfig
    return KvCacheConnectorConfig


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="Hugging Face model id or local directory")
    ap.add_argument("--store", default="lmdb:///tmp/tiered-kv-trtllm", help="disk tier URL")
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args(argv)

    os.environ.update(connector_environment(args.store))
    from tensorrt_llm import LLM, SamplingParams
    from tensorrt_llm.llmapi.llm_args import KvCacheConfig

    llm = LLM(model=args.model, backend="pytorch",
              # TensorRT-LLM's own block reuse off, so the hits shown are tiered-kv's
              kv_cache_config=KvCacheConfig(enable_block_reuse=False),
              kv_connector_config=_connector_config_class()(**connector_config_kwargs()))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    for question in QUESTIONS:
        started = time.perf_counter()
        out = llm.generate([SYSTEM_PROMPT + "\nQuestion: " + question], params)[0]
        print(f"{time.perf_counter() - started:6.3f} s  {question!r} -> {out.outputs[0].text!r}")
    llm.shutdown()  # the store flushes its write-behind before the process exits
    return 0


if __name__ == "__main__":
    sys.exit(main())
