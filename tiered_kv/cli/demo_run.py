"""The restart-and-resume demo.

Run 1 (a child process) serves prompts that share long prefixes — a system prompt, a document
asked about twice, a chat — with the connector saving their KV to the store (by default LMDB in
the directory the demo names). The process exits. Run 2 (a new process, same store) serves the
same prompts and a follow-up chat turn that extends run 1's conversation, loading every stored
full block instead of prefilling it. The report compares TTFT and outputs of both runs.
"""

from __future__ import annotations

import json
import logging
import random
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from storage_backends.redaction import redact_text, redact_url
from tiered_kv.cli.render import EXIT_UNAVAILABLE, EXIT_USAGE, error_exit
from tiered_kv.errors import BackendUnavailable, ConfigError, TieredKVError

log = logging.getLogger(__name__)

SYSTEM_TOKENS = 512  # shared system prompt
DOCUMENT_TOKENS = 3400  # a RAG document asked about twice
MAX_TOKENS = 16  # generated per prompt


@dataclass(frozen=True)
class DemoOptions:
    workdir: Path  # where the demo keeps its store and run files
    store_url: str | None = None  # store URL; None = LMDB under workdir
    model_dir: str | None = None  # local safetensors model; None = seeded demo weights
    prompt_tokens: int = 4000  # length of the main RAG prompt
    corrupt: int = 0  # stored blocks to corrupt between the runs
    seed: int = 0  # weights seed and prompt seed
    model_size: str = "demo"  # seeded model size when no model_dir: "demo" or "tiny" (tests)
    model_kind: str = "llama"  # seeded model kind: llama | hybrid (Mamba2 + attention) | mla

    @property
    def disk_url(self) -> str:
        return f"lmdb://{(self.workdir / 'store').resolve()}"


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(1, vocab) for _ in range(n)]


def base_prompts(opts: DemoOptions, vocab: int) -> dict[str, list[int]]:
    rng = random.Random(opts.seed)
    system = _tokens(rng, SYSTEM_TOKENS, vocab)
    doc_len = max(16, opts.prompt_tokens - SYSTEM_TOKENS - 88)
    document = _tokens(rng, doc_len, vocab)
    return {
        "rag-question-1": system + document + _tokens(rng, opts.prompt_tokens - SYSTEM_TOKENS - doc_len, vocab),
        "rag-question-2": system + document + _tokens(rng, 70, vocab),
        "chat-turn-1": system + _tokens(rng, 600, vocab),
    }


def _model_config(opts: DemoOptions):
    from tiered_kv.engine import ModelConfig
    from tiered_kv.engine.weights import read_config

    if opts.model_dir:
        return read_config(opts.model_dir)
    if opts.model_size == "tiny":
        return {"hybrid": ModelConfig.tiny_hybrid, "mla": ModelConfig.tiny_mla}.get(opts.model_kind, ModelConfig.tiny)()
    return ModelConfig.demo_kind(opts.model_kind)


def _build_engine(opts: DemoOptions, with_connector: bool):
    from tiered_kv.config import TieredKVConfig
    from tiered_kv.connector import build_connector
    from tiered_kv.engine import EngineConfig, LLMEngine, engine_namespace, weights_revision

    model_config = _model_config(opts)
    named = {} if model_config.kind == "llama" else {"model_id": f"tiered-kv/reference-{model_config.kind}"}
    engine_config = EngineConfig(num_blocks=1024, max_num_batched_tokens=8192, **named)
    connector = None
    if with_connector:
        ns = engine_namespace(model_config, engine_config,
                              weights_revision(model_config, seed=opts.seed, model_dir=opts.model_dir))
        cfg: dict[str, Any] = {"host": {"capacity": "256MiB"}}
        if opts.store_url is None or opts.store_url.startswith("lmdb"):
            cfg["disk"] = {"url": opts.store_url or opts.disk_url, "capacity": "4GiB"}
        else:
            cfg["remote"] = {"url": opts.store_url}
        connector = build_connector(TieredKVConfig.load(cfg), ns)
    engine = LLMEngine(model_config, engine_config, connector, seed=opts.seed, model_dir=opts.model_dir)
    return engine, connector


def serve(opts: DemoOptions, prompts: dict[str, list[int]], with_connector: bool = True) -> dict:
    """Serve ``prompts`` one after another (clean TTFTs); per-prompt figures and outputs."""
    from tiered_kv.engine import SamplingParams

    engine, connector = _build_engine(opts, with_connector)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    per_prompt = {}
    try:
        # warm-up: first-call costs (allocator, kernels) would otherwise land on one prompt's
        # TTFT; 8 tokens fill no block, so nothing is looked up or saved
        engine.generate([list(range(1, 9))], SamplingParams(max_tokens=2, temperature=0.0))
        saved = opts.workdir / "prompts"  # token ids, for `tiered-kv explain --tokens FILE`
        saved.mkdir(parents=True, exist_ok=True)
        for name, tokens in prompts.items():
            (saved / f"{name}.json").write_text(json.dumps(tokens))
            [out] = engine.generate([tokens], params)
            tiers = dict(connector.worker.load_stats.get(out.request_id, {})) if connector else {}
            full_block_tokens = (len(tokens) // engine.engine_config.block_size) * engine.engine_config.block_size
            per_prompt[name] = {
                "prompt_tokens": len(tokens),
                "full_block_tokens": full_block_tokens,
                "device_cached_tokens": out.num_cached_tokens,
                "matched_tokens": out.num_external_tokens,
                "prefilled_tokens": out.num_prefilled_tokens,
                "tier_blocks": tiers,  # entries served per tier (a hybrid's state entry included)
                "state_loaded": out.state_loaded,
                "ttft_s": round(out.ttft_s, 4),
                "output": out.output_token_ids,
            }
    finally:
        if connector is not None:
            connector.store.flush()  # (close writes nothing more: its figures are final here)
            store_stats = connector.store.stats()
            connector.close()
        else:
            store_stats = {}
    return {"prompts": per_prompt, "store": store_stats}


def _summary(run: dict) -> dict:
    prompts = run["prompts"].values()
    hits: dict[str, int] = {}
    for p in prompts:
        for tier, n in p["tier_blocks"].items():
            hits[tier] = hits.get(tier, 0) + n
    return {
        "ttft_s": round(sum(p["ttft_s"] for p in prompts), 4),
        "prompt_tokens": sum(p["prompt_tokens"] for p in prompts),
        "full_block_tokens": sum(p["full_block_tokens"] for p in prompts),
        "matched_tokens": sum(p["matched_tokens"] for p in prompts),
        "device_cached_tokens": sum(p["device_cached_tokens"] for p in prompts),
        "prefilled_tokens": sum(p["prefilled_tokens"] for p in prompts),
        "tier_hits_blocks": hits,
        "state_entries_loaded": sum(1 for p in prompts if p.get("state_loaded")),
        "misses": {r: n for t in run["store"].get("tiers", {}).values() for r, n in t["misses"].items()},
        "prompts": run["prompts"],
    }


def corrupt_store(url: str, count: int) -> list[str]:
    """Flip one byte in the body of ``count`` stored blocks, behind the store's back."""
    from storage_backends.registry import open_backend
    from tiered_kv.store.records import is_block_key

    backend = open_backend(url)
    try:
        keys = sorted(k for k in backend.scan() if is_block_key(k))[:count]  # not the ns record
        damaged = []
        for key, value in zip(keys, backend.get_many(keys)):
            if value is None:
                continue
            blob = bytearray(value)
            blob[len(blob) // 2] ^= 0xFF
            backend.put_many([(key, bytes(blob))])
            damaged.append(key.hex())
        backend.flush()
        return damaged
    finally:
        backend.close()


def _child(opts: DemoOptions, phase: str, out_file: Path) -> dict:
    """Run ``phase`` in a new process. Its options (the store URL, which may carry a password)
    go through stdin: a child's argv is visible to every user of the machine (``ps``)."""
    cmd = [sys.executable, "-m", "tiered_kv.cli.demo_run", phase, str(opts.workdir), str(out_file)]
    options = json.dumps({"store_url": opts.store_url, "model_dir": opts.model_dir,
                          "prompt_tokens": opts.prompt_tokens, "seed": opts.seed,
                          "model_size": opts.model_size, "model_kind": opts.model_kind})
    started = time.perf_counter()
    proc = subprocess.run(cmd, input=options, capture_output=True, text=True)
    if proc.returncode != 0:
        raise _failure(opts, phase, proc.returncode, proc.stderr)
    result = json.loads(out_file.read_text())
    result["process_s"] = round(time.perf_counter() - started, 2)
    return result


def _failure(opts: DemoOptions, phase: str, code: int, stderr: str) -> BaseException:
    """The error of a phase whose process exited with ``code``: its own one-line error (exit 2:
    configuration, 3: the store unreachable) as ours; any other failure (a crash, a signal) as one
    line, its last line of stderr; the whole stderr (redacted) is logged, shown with ``-v``."""
    text = redact_text(stderr, opts.store_url) if opts.store_url else stderr
    if code in (130, -signal.SIGINT):
        return KeyboardInterrupt()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    last = lines[-1] if lines else f"demo {phase} exited with {code} and no message"
    if code == EXIT_USAGE:
        return ConfigError(last)
    if code == EXIT_UNAVAILABLE:
        return BackendUnavailable(last)
    log.info("demo %s exited with %s; its stderr:\n%s", phase, code, text[-8000:])
    how = f"failed (exit {code})"
    if code < 0:  # a signal (the OOM killer's SIGKILL, ...)
        try:
            how = f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            how = f"was killed by signal {-code}"
    detail = f": {lines[-1]}" if lines else ""
    hint = "" if log.isEnabledFor(logging.INFO) or not lines else " (-v shows its output)"
    return TieredKVError(f"demo {phase} {how}{detail}{hint}")


def run_demo(opts: DemoOptions) -> dict:
    """Both runs in fresh child processes; returns the report."""
    store_dir = opts.workdir / "store"
    if opts.store_url is None and store_dir.exists():
        shutil.rmtree(store_dir)  # the demo's own store: start cold every time
    opts.workdir.mkdir(parents=True, exist_ok=True)
    run1 = _child(opts, "run1", opts.workdir / "run1.json")
    damaged = corrupt_store(opts.store_url or opts.disk_url, opts.corrupt) if opts.corrupt else []
    run2 = _child(opts, "run2", opts.workdir / "run2.json")
    same = [n for n in run1["prompts"] if run1["prompts"][n]["output"] == run2["prompts"][n]["output"]]
    follow_up_ok = run2.get("follow_up_matches_recompute", True)
    r1, r2 = _summary(run1), _summary(run2)
    main = "rag-question-1"
    ratio = r2["prompts"][main]["ttft_s"] / max(1e-9, r1["prompts"][main]["ttft_s"])
    repeated = [n for n in run1["prompts"]]
    matchable = sum(r2["prompts"][n]["full_block_tokens"] for n in repeated)
    matched = sum(r2["prompts"][n]["matched_tokens"] + r2["prompts"][n]["device_cached_tokens"] for n in repeated)
    return {
        "model": opts.model_kind,
        "store": redact_url(opts.store_url or opts.disk_url),
        "run1": r1,
        "run2": r2,
        "corrupted_blocks": damaged,
        "outputs_identical": len(same) == len(run1["prompts"]) and follow_up_ok,
        "repeated_prompt_match_fraction": round(matched / max(1, matchable), 4),
        "ttft_ratio_main_prompt": round(ratio, 4),
        "main_prompt_tokens": r1["prompts"][main]["prompt_tokens"],
    }


def _phase(phase: str, workdir: str, out_file: str, extra: str) -> None:
    logging.basicConfig(level=logging.WARNING)
    opts = DemoOptions(Path(workdir), **json.loads(extra))
    vocab = _model_config(opts).vocab_size
    prompts = base_prompts(opts, vocab)
    if phase == "run1":
        result = serve(opts, prompts)
        _check_reached(result["store"])
    else:
        run1 = json.loads((Path(workdir) / "run1.json").read_text())
        chat = prompts["chat-turn-1"] + run1["prompts"]["chat-turn-1"]["output"]
        # after the restart the user first continues the chat (its history, run 1's answer
        # included, comes from the store), then the earlier prompts come back
        prompts = {"chat-turn-2": chat + _tokens(random.Random(opts.seed + 1), 120, vocab), **prompts}
        result = serve(opts, prompts)
        _check_reached(result["store"])
        # the follow-up turn was never served before: check it against a plain recompute
        reference = serve(opts, {"chat-turn-2": prompts["chat-turn-2"]}, with_connector=False)
        result["follow_up_matches_recompute"] = (
            reference["prompts"]["chat-turn-2"]["output"] == result["prompts"]["chat-turn-2"]["output"])
    Path(out_file).write_text(json.dumps(result))


def _check_reached(store_stats: dict) -> None:
    """BackendUnavailable when a lower tier of the demo's store refused this run's saves as
    unreachable: a tier that is down (Redis refused, a wrong password) costs an engine misses and
    failed saves, never an error, so the demo restored nothing and still said "outputs identical",
    exit 0, where the README promises exit 3."""
    events = store_stats.get("events", {})
    for name, backend in store_stats.get("backends", {}).items():
        failed = events.get(f"{name}_save_failed", 0)
        if name != "host" and failed:
            why = backend.get("extra", {}).get("unavailable") or "its medium was unavailable"
            raise BackendUnavailable(f"the demo's store ({name}) refused {failed} saves: {why}")


def _phase_main(argv: list[str], extra: str) -> int:
    """A phase as a process: its typed errors (a missing model directory, a bad store URL) are
    one line on stderr and the CLI's exit code, which :func:`_failure` reads back."""
    try:
        _phase(*argv[:3], extra)
    except (TieredKVError, OSError) as exc:  # (OSError: e.g. a work directory it cannot write)
        message, code = error_exit(exc)
        print(message, file=sys.stderr)
        return code
    return 0


if __name__ == "__main__":
    sys.exit(_phase_main(sys.argv[1:4], sys.stdin.read()))
