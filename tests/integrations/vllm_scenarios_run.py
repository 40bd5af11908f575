"""One vLLM engine process running the request scenarios of ``test_vllm_scenarios.py`` in turn.

    python tests/integrations/vllm_scenarios_run.py --ckpt /tmp/ckpt/llama \\
        --connector tiered --store gated:///tmp/s [--load-async] [--prefix-caching] [--steered]

The model is a dense Llama with seeded normal-scale weights (``tools/vllm_checkpoints.py``'s
recipe, built here when missing), block size 32, fp32. Every scenario has prompts of its own
(no shared prefixes), so a store hit is one the store was given by an earlier engine:

- ``parallel``: n=3 seeded samples (temperature 0.8) of a 200-token prompt;
- ``edge``: a 256-token prompt, an exact multiple of the block size, greedy;
- ``tiny``: a 20-token prompt (shorter than a block) and a 100-token one, one token each;
- ``logprobs``: prompt logprobs (top 3) and sample logprobs of a 150-token prompt;
- ``mixed``: the first 70 tokens of a 200-token prompt, then all of it (beside vLLM's prefix cache
  the second finds two blocks there and the rest in the store);
- ``preempted``: a 180-token prompt; ``--steered``: preempted after its third token (vLLM's
  ``reset_prefix_cache(reset_running_requests=True)``), resumed (matched again) and finished;
- ``aborted``: a 160-token prompt; ``--steered``: aborted while its load is in flight (async
  loads: the store's disk reads held back by a gate; sync: after its first step), then asked
  again;
- ``resumed``: a 160-token prompt; ``--steered``: preempted after its first decode step, resumed with its blocks gone from the host
  tier (as under memory pressure), aborted while that load is in flight, then asked again.

The disk tier's URL may use the ``gated`` scheme: vLLM's LMDB backend whose block reads wait
while :data:`GATE` is cleared. Prints one line ``RESULT {...}``: per scenario the generated
tokens (and logprobs), vLLM's ``num_cached_tokens``, and what the steered ones saw; with the
connector, what is left once the engine is idle (free blocks, requests, leases, loads).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import sys
import threading
import time

ENV = {"VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
       "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "ERROR"}
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
BLOCK = 32
LENGTHS = {"parallel": 200, "edge": 256, "tiny": 20, "one": 100, "logprobs": 150, "mixed": 200,
           "preempted": 180, "aborted": 160, "resumed": 160}
HEAD = 70  # ``mixed``: the first prompt's tokens
GATE = threading.Event()  # cleared: the gated backend's block reads wait (a load stays in flight)
GATE.set()
GATE_LIMIT_S = 120  # a read held longer than this goes on (a test that forgot the gate ends)
DRAIN_LIMIT_S = 120


def prompt(name: str, vocab: int = 4096) -> list[int]:
    rng = random.Random(name)
    return [rng.randrange(3, vocab) for _ in range(LENGTHS[name])]


def llama_checkpoint(directory: str) -> str:
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import vllm_checkpoints as vc

    vc.KINDS.setdefault("llama", {**vc.COMMON, "architectures": ["LlamaForCausalLM"], "model_type": "llama",
                                  "num_hidden_layers": 2, "intermediate_size": 512, "rms_norm_eps": 1e-5,
                                  "rope_theta": 10000.0, "tie_word_embeddings": False})
    return vc.build("llama", directory)


@functools.cache
def gated_backend():
    from storage_backends.lmdb_disk import LmdbBackend

    class GatedLmdb(LmdbBackend):
        """vLLM's disk tier whose block reads wait while :data:`GATE` is cleared."""

        @classmethod
        def from_url(cls, url: str, **options):
            return super().from_url("lmdb" + url[len("gated"):], **options)

        def visit_many(self, keys, visitor):
            GATE.wait(GATE_LIMIT_S)
            return super().visit_many(keys, visitor)

        def visit_ranges(self, keys, visitor):
            GATE.wait(GATE_LIMIT_S)
            return super().visit_ranges(keys, visitor)

        def visit_split(self, keys, outs, visitor):
            GATE.wait(GATE_LIMIT_S)
            return super().visit_split(keys, outs, visitor)

    return GatedLmdb


class Run:
    def __init__(self, llm, connector: bool) -> None:
        self.llm, self.connector = llm, connector
        self.engine = llm.llm_engine
        self.sched = self.engine.engine_core.engine_core.scheduler

    def generate(self, prompts: list[list[int]], params) -> list:
        from vllm.inputs import TokensPrompt

        return self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)

    def drain(self) -> None:
        """Step until vLLM holds no request (held ones included: finished sending or receiving)."""
        deadline = time.monotonic() + DRAIN_LIMIT_S
        while self.sched.has_requests():
            assert time.monotonic() < deadline, f"requests never released: {list(self.sched.requests)}"
            if not self.engine.step():
                time.sleep(0.005)  # an idle step waiting on transfers

    def add(self, name: str, params) -> str:
        from vllm.inputs import TokensPrompt

        return self.engine.add_request(name, TokensPrompt(prompt_token_ids=prompt(name)), params)

    def status(self, rid: str) -> str | None:
        request = self.sched.requests.get(rid)
        return request.status.name if request is not None else None

    def store(self):
        from vllm.distributed.kv_transfer.kv_transfer_state import get_kv_transfer_group

        return get_kv_transfer_group()._worker.store

    def leftovers(self) -> dict:
        """What is left once vLLM is idle: every block free, no request, lease or load."""
        from vllm.distributed.kv_transfer.kv_transfer_state import get_kv_transfer_group

        self.drain()
        pool = self.sched.kv_cache_manager.block_pool
        worker = get_kv_transfer_group()._worker
        core = self.sched.connector._sched.core
        return {"used_blocks": pool.num_gpu_blocks - 1 - pool.get_num_free_blocks(),  # (the null block)
                "requests": len(self.sched.requests),
                "connector_requests": len(core._requests) if core is not None else 0,
                "leases": len(worker.store.loader._leases), "async_loads": len(worker.core._async_loads)}


def outputs(out, logprobs: bool = False) -> dict:
    res = {"outputs": [list(c.token_ids) for c in out.outputs], "cached": out.num_cached_tokens}
    if logprobs:
        res["prompt_logprobs"] = [None if step is None else {str(t): lp.logprob for t, lp in step.items()}
                                  for step in out.prompt_logprobs]
        res["logprobs"] = [{str(t): lp.logprob for t, lp in step.items()} for step in out.outputs[0].logprobs]
    return res


def preempted(run: Run, params) -> dict:
    """Preempt after three tokens; the request is matched again when resumed and finishes."""
    rid, final, preemptions = run.add("preempted", params), None, 0
    deadline = time.monotonic() + DRAIN_LIMIT_S
    while final is None:
        assert time.monotonic() < deadline, "the request never finished"
        request = run.sched.requests[rid]
        if request.num_output_tokens == 3 and not request.num_preemptions:
            run.engine.reset_prefix_cache(reset_running_requests=True)
        preemptions = request.num_preemptions
        final = next((o for o in run.engine.step() if o.finished), None)
    run.drain()
    return {**outputs(final), "preemptions": preemptions}


def aborted(run: Run, params, load_async: bool) -> dict:
    """Abort the request while its load is in flight (async) or after its first step (sync)."""
    seen: dict = {}
    if load_async:
        GATE.clear()  # its disk reads wait: the load stays in flight
    return abort_after_a_step(run, run.add("aborted", params), seen)


def resumed(run: Run, params, load_async: bool) -> dict:
    """Preempt after one decode step, resume with the host tier's copies gone (the load comes from
    the disk: async, held in flight by the gate), abort then."""
    seen: dict = {}
    rid = run.add("resumed", params)
    deadline = time.monotonic() + DRAIN_LIMIT_S
    while run.sched.requests[rid].num_output_tokens < 2:  # its prompt's last block computed and saved
        assert time.monotonic() < deadline, "the request never decoded"
        run.engine.step()
    run.engine.reset_prefix_cache(reset_running_requests=True)
    seen["preempted"] = run.status(rid)
    store = run.store()
    assert store.flush(60), "the disk tier's write-behind did not finish"
    store.host.delete_many(list(store.host.scan()))  # the host tier let every block go
    if load_async:
        GATE.clear()
    return abort_after_a_step(run, rid, seen)


def abort_after_a_step(run: Run, rid: str, seen: dict) -> dict:
    """One step of ``rid`` (its load starts, held at the gate when async), then its abort: its
    status then, and whether vLLM still holds it three steps later (it must while its load is in
    flight); the gate is opened and the engine drained after."""
    try:
        run.engine.step()
        seen["status"] = run.status(rid)
        run.engine.abort_request([rid], internal=True)
        for _ in range(3):
            run.engine.step()
        seen["held"] = rid in run.sched.requests
    finally:
        GATE.set()
    run.drain()
    return seen


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", required=True, help="checkpoint directory (built when missing)")
    ap.add_argument("--connector", choices=("none", "tiered", "probe"), default="none",
                    help="probe: claims every full block but the last token's and loads nothing")
    ap.add_argument("--store", default="", help="disk tier URL (lmdb:// or gated://)")
    ap.add_argument("--load-async", action="store_true")
    ap.add_argument("--prefix-caching", action="store_true", help="vLLM's own prefix cache too")
    ap.add_argument("--steered", action="store_true", help="abort / preempt the last two scenarios")
    args = ap.parse_args(argv)
    for name, value in ENV.items():
        os.environ.setdefault(name, value)
    sys.path.insert(0, ROOT)

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    from storage_backends.registry import register_backend

    register_backend("gated", f"{__name__}:GatedLmdb")
    kw = {}
    if args.connector == "tiered":
        # every stored block is loaded: the cost policy's choice would hang on this machine's speed
        settings = {"disk": {"url": args.store, "capacity": "1GiB"}, "host": {"capacity": "256MiB"},
                    "load_async": args.load_async, "restore_policy": "always"}
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="TieredKVConnector", kv_connector_module_path="tiered_kv.integrations.vllm",
            kv_role="kv_both", kv_connector_extra_config=settings, kv_load_failure_policy="recompute")
    elif args.connector == "probe":
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="ProbeConnector", kv_connector_module_path="tests.integrations.vllm_probe",
            kv_role="kv_both", kv_connector_extra_config={"log": os.devnull, "claim": 10**6, "claim_align": BLOCK})
    llm = LLM(model=llama_checkpoint(args.ckpt), skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
              max_model_len=1024, seed=0, block_size=BLOCK, enable_prefix_caching=args.prefix_caching,
              async_scheduling=True, **kw)
    run = Run(llm, args.connector == "tiered")
    greedy = dict(temperature=0.0, ignore_eos=True, detokenize=False)
    result: dict = {"async_scheduling": bool(llm.llm_engine.vllm_config.scheduler_config.async_scheduling)}
    par = SamplingParams(n=3, temperature=0.8, seed=7, max_tokens=8, ignore_eos=True, detokenize=False)
    result["parallel"] = outputs(run.generate([prompt("parallel")], par)[0])
    result["edge"] = outputs(run.generate([prompt("edge")], SamplingParams(max_tokens=8, **greedy))[0])
    tiny = run.generate([prompt("tiny"), prompt("one")], SamplingParams(max_tokens=1, **greedy))
    result["tiny"] = [outputs(o) for o in tiny]
    lp = SamplingParams(max_tokens=4, prompt_logprobs=3, logprobs=3, **greedy)
    result["logprobs"] = outputs(run.generate([prompt("logprobs")], lp)[0], logprobs=True)
    params = SamplingParams(max_tokens=8, **greedy)
    result["mixed"] = [outputs(run.generate([p], params)[0]) for p in (prompt("mixed")[:HEAD], prompt("mixed"))]
    result["preempted"] = preempted(run, params) if args.steered else \
        outputs(run.generate([prompt("preempted")], params)[0])
    for name in ("aborted", "resumed"):
        if args.steered:
            result[f"{name}_steered"] = aborted(run, params, args.load_async) if name == "aborted" \
                else resumed(run, params, args.load_async)
        result[name] = outputs(run.generate([prompt(name)], params)[0])
    if run.connector:
        result["leftovers"] = run.leftovers()
    print("RESULT " + json.dumps(result), flush=True)
    del llm
    return 0


def __getattr__(name: str):  # the gated backend class, imported by the registry on first use
    if name == "GatedLmdb":
        return gated_backend()
    raise AttributeError(name)


if __name__ == "__main__":
    sys.exit(main())
