"""One vLLM engine (the real one, on CPU) with tiered-kv attached: run as a script in its own
process by ``test_vllm_engine.py`` (and by hand). Prints one JSON line: the generated token ids
and per-request cached tokens.

    python tests/integrations/vllm_run.py MODEL_DIR STORE_DIR PROMPTS.json [--extra JSON]

The model directory holds only a config.json: weights are vLLM's seeded dummy weights, the same
in every process, so two engines agree token for token.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

for name, value in {"VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1",
                    "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}.items():
    os.environ.setdefault(name, value)

BLOCK_SIZE = 32
MODEL_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
    "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
    "num_hidden_layers": 2, "vocab_size": 2048, "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
    "bos_token_id": 1, "eos_token_id": 2,
}


def write_model_dir(path: str) -> None:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(MODEL_CONFIG, fh)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("store_dir")
    ap.add_argument("prompts", help="JSON file: a list of token id lists")
    ap.add_argument("--extra", default="{}", help="more kv_connector_extra_config (JSON)")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--prefix-caching", action="store_true")
    args = ap.parse_args(argv)

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    write_model_dir(args.model_dir)
    extra = {"disk": {"url": f"lmdb://{args.store_dir}", "capacity": "256MiB"},
             "host": {"capacity": "64MiB"}}
    extra.update(json.loads(args.extra))
    llm = LLM(model=args.model_dir, load_format="dummy", skip_tokenizer_init=True, enforce_eager=True,
              block_size=BLOCK_SIZE, dtype="bfloat16", max_model_len=2048, seed=0,
              enable_prefix_caching=args.prefix_caching, disable_hybrid_kv_cache_manager=True,
              kv_transfer_config=KVTransferConfig(
                  kv_connector="TieredKVConnector", kv_connector_module_path="tiered_kv.integrations.vllm",
                  kv_role="kv_both", kv_connector_extra_config=extra, kv_load_failure_policy="recompute"))
    with open(args.prompts) as fh:
        prompts = json.load(fh)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    result = {"outputs": [list(o.outputs[0].token_ids) for o in outs],
              "cached_tokens": [o.num_cached_tokens for o in outs],
              "prompt_tokens": [len(p) for p in prompts]}
    print("RESULT " + json.dumps(result), flush=True)
    del llm  # engine shut down; the store flushes its write-behind at exit
    return 0


if __name__ == "__main__":
    sys.exit(main())
