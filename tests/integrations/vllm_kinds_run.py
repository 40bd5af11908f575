"""One vLLM engine process on one tiny seeded checkpoint of a model kind (``test_vllm_kinds.py``).

    python tests/integrations/vllm_kinds_run.py --kind gemma3 --ckpt /tmp/ckpt/gemma3 \\
        --connector tiered --store lmdb:///tmp/s

``--connector``: ``none`` (the reference), ``tiered`` (``TieredKVConnector`` from
``tiered_kv.integrations.vllm``) or ``probe`` (``tests/integrations/vllm_probe.py``, records only).
Prints one line ``RESULT {...}``: generated token ids, vLLM's ``num_cached_tokens`` per prompt,
prompt lengths, and the engine's block size per KV cache group as the probe saw it (if any).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

ENV = {"VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
       "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "ERROR"}
PREFIX = 320  # shared "system prompt"; tails make one prompt end exactly on a 64-token edge
TAILS = (45, 64, 7)


def prompts(vocab: int = 4096) -> list[list[int]]:
    rng = random.Random(13)
    prefix = [rng.randrange(3, vocab) for _ in range(PREFIX)]
    return [prefix + [rng.randrange(3, vocab) for _ in range(n)] for n in TAILS]


def engine_args(kind: str, chunk: int | None, max_seqs: int | None = None) -> dict:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))
    from vllm_checkpoints import ENGINE_ARGS

    args = {"block_size": 32, "enable_prefix_caching": False, **ENGINE_ARGS[kind]}
    if chunk:  # prefill in chunks of `chunk` tokens (the hybrid model's state at block edges)
        args.update(enable_chunked_prefill=True, max_num_batched_tokens=chunk)
    if max_seqs:
        args["max_num_seqs"] = max_seqs
    return args


def transfer(connector: str, store: str, extra: dict):
    from vllm.config import KVTransferConfig

    if connector == "probe":
        return KVTransferConfig(kv_connector="ProbeConnector",
                                kv_connector_module_path="tests.integrations.vllm_probe",
                                kv_role="kv_both", kv_connector_extra_config=extra,
                                kv_load_failure_policy="recompute")
    settings = {"disk": {"url": store, "capacity": "1GiB"}, "host": {"capacity": "256MiB"}, **extra}
    return KVTransferConfig(kv_connector="TieredKVConnector",
                            kv_connector_module_path="tiered_kv.integrations.vllm",
                            kv_role="kv_both", kv_connector_extra_config=settings,
                            kv_load_failure_policy="recompute")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kind", required=True)
    ap.add_argument("--ckpt", required=True, help="checkpoint directory (tools/vllm_checkpoints.py)")
    ap.add_argument("--connector", choices=("none", "tiered", "probe"), default="none")
    ap.add_argument("--store", default="")
    ap.add_argument("--extra", default="{}", help="kv_connector_extra_config, as JSON")
    ap.add_argument("--chunk", type=int, default=0, help="max_num_batched_tokens, chunked prefill")
    ap.add_argument("--max-seqs", type=int, default=0, help="max_num_seqs (1: one request at a time)")
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--sequential", action="store_true", help="one prompt per generate() call")
    ap.add_argument("--logprobs", type=int, default=0, help="also report the top logprobs per token")
    args = ap.parse_args(argv)
    for name, value in ENV.items():
        os.environ.setdefault(name, value)
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw = engine_args(args.kind, args.chunk, args.max_seqs)
    if args.connector != "none":
        kw["kv_transfer_config"] = transfer(args.connector, args.store, json.loads(args.extra))
    llm = LLM(model=args.ckpt, skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
              max_model_len=1024, seed=0, **kw)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True,
                            detokenize=False, logprobs=args.logprobs or None)
    ps = prompts()
    batches = [[p] for p in ps] if args.sequential else [ps]
    outs = [o for batch in batches
            for o in llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], params,
                                  use_tqdm=False)]
    result = {"outputs": [list(o.outputs[0].token_ids) for o in outs],
              "cached_tokens": [o.num_cached_tokens for o in outs],
              "prompt_tokens": [len(p) for p in ps]}
    if args.logprobs:  # per prompt, per token: the top candidates {token: logprob}
        result["logprobs"] = [[{t: round(lp.logprob, 5) for t, lp in step.items()}
                               for step in o.outputs[0].logprobs] for o in outs]
    print("RESULT " + json.dumps(result), flush=True)
    del llm
    return 0


if __name__ == "__main__":
    sys.exit(main())
