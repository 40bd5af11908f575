"""End-to-end benchmark on the reference engine: cold vs warm-restart TTFT, and decode overhead.

    python tools/bench_e2e.py [--json] [--lengths 512,2048,8192] [--repeats R] [--decode-steps N]
                              [--dir DIR] [--quick]

Everything runs on the demo model (``ModelConfig.demo()``, fp32) with one engine configuration:
block 16, ``max_num_batched_tokens`` 8192 (a prompt of up to 8192 tokens is prefilled in one
step, no chunking), ``max_position`` = longest prompt + 256, a KV pool sized for the longest
prompt, a connector with sync loads (``load_async=False``) over a host tier and an LMDB disk
tier (zstd+shuffle level 1, ``write_through``).

1. TTFT, per prompt length. A *cold* child process (empty LMDB store) prefills the prompt; the
   connector saves every full block; the store is flushed and closed. Then, ``--repeats`` times,
   a *warm-restart* child process (new engine, new connector on the same LMDB path, so the host
   tier is empty and every block comes from LMDB) serves the same prompt twice with a fresh engine
   and connector each time: once with the LMDB data file in the page cache, once after
   ``fsync`` + ``posix_fadvise(DONTNEED)`` dropped its pages (residency checked with mincore).
   The two variants alternate which goes first. Reported: TTFT medians and every run, matched /
   prefilled tokens, blocks per serving tier, where the time went (lookup, lease, LMDB read +
   decode in the transfer pool, scatter, forward, save gather), the warm/cold ratio (target
   <= 0.2 from 4096 tokens on) and whether the greedy outputs equal the cold run's.
2. Decode-step time, connector off vs saving: one child process builds two identical engines
   (same seeded weights and config), one without a connector and one with the LMDB write-through
   connector, warms both up, then runs a batch (default 4 requests x 512-token prompts) for N
   decode steps on each, alternating off/on order per repeat (ABBA), new prompts per repeat (the
   same for both engines), and the write-behind drained between runs so no run pays for another.
   Per-step wall time of ``engine.step()`` is taken only for steps where every request decodes.
   Reported: median per-step time per mode, overhead % (median of the per-pair ratios; target
   <= 5%), mean and p90 too, and steps that complete a block (and save it) apart from the rest.
3. Machine, torch, model size, block bytes and stored (compressed) block bytes.

A benchmark, not a test: the figures depend on the machine. Compare ratios taken in one run.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

BLOCK_SIZE = 16
MAX_BATCHED_TOKENS = 8192  # one-step prefill up to 8192 tokens
GEN_TOKENS = 8  # generated per TTFT request (greedy); their equality is checked
TARGET_RATIO = 0.2  # warm/cold TTFT, from TARGET_FROM tokens on
TARGET_FROM = 4096
TARGET_OVERHEAD_PCT = 5.0
CHILD_TIMEOUT_S = 900


# ---- set-up shared by every child ---------------------------------------------------------------
def _model_config(max_position: int):
    from tiered_kv.engine import ModelConfig

    return ModelConfig.demo(max_position=max_position)


def _engine_config(max_tokens_per_request: int, batch: int = 1):
    from tiered_kv.engine import EngineConfig

    blocks = batch * (-(-max_tokens_per_request // BLOCK_SIZE)) + 64
    return EngineConfig(block_size=BLOCK_SIZE, num_blocks=max(256, blocks),
                        max_num_batched_tokens=MAX_BATCHED_TOKENS)


def _block_bytes(model) -> int:
    import torch

    itemsize = getattr(torch, model.dtype).itemsize
    return model.num_layers * 2 * BLOCK_SIZE * model.num_kv_heads * model.head_dim * itemsize


def _store_config(store_dir: str, host_bytes: int) -> dict:
    return {"host": {"capacity": host_bytes},
            "disk": {"url": f"lmdb://{store_dir}", "capacity": "4GiB", "policy": "write_through"}}


def build(max_position: int, max_tokens_per_request: int, store_dir: str | None, batch: int = 1):
    """(engine, connector or None): the benchmark's one engine configuration."""
    from tiered_kv.config import TieredKVConfig
    from tiered_kv.connector import build_connector
    from tiered_kv.engine import LLMEngine, engine_namespace, weights_revision

    model = _model_config(max_position)
    engine_cfg = _engine_config(max_tokens_per_request, batch)
    connector = None
    if store_dir is not None:
        ns = engine_namespace(model, engine_cfg, weights_revision(model, seed=0))
        # room for twice the blocks of one run (loads promote into it, saves stage through it)
        host = max(64 << 20, 2 * engine_cfg.num_blocks * _block_bytes(model))
        connector = build_connector(TieredKVConfig.from_dict(_store_config(store_dir, host)), ns,
                                    load_async=False)
    return LLMEngine(model, engine_cfg, connector, seed=0), connector


def prompt_tokens(n: int, seed: int, vocab: int = 4096) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, vocab) for _ in range(n)]


def _warm_up(engine) -> None:
    """First-call costs (allocator, kernels) off the measured request; 8 tokens fill no block,
    so nothing is looked up, loaded or saved."""
    from tiered_kv.engine import SamplingParams

    engine.generate([list(range(1, 9))], SamplingParams(max_tokens=2, temperature=0.0))


# ---- where the time goes (TTFT children only) ---------------------------------------------------
class Probe:
    """Wall time per wrapped method, summed over calls (and over transfer-pool threads)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.active = False
        self.missing: list[str] = []

    def wrap(self, owner: Any, name: str, label: str) -> None:
        original = getattr(owner, name, None)
        if original is None:
            self.missing.append(f"{owner.__name__}.{name}")
            return
        probe = self

        @functools.wraps(original)
        def timed(*args, **kwargs):
            if not probe.active:
                return original(*args, **kwargs)
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                with probe.lock:
                    probe.seconds[label] += elapsed
                    probe.calls[label] += 1

        setattr(owner, name, timed)

    def install(self) -> Probe:
        from storage_backends.lmdb_disk import LmdbBackend
        from tiered_kv.codec import BlockCodec
        from tiered_kv.connector.worker import ConnectorWorker
        from tiered_kv.engine.llm_engine import LLMEngine
        from tiered_kv.engine.model_runner import ModelRunner
        from tiered_kv.engine.scheduler import Scheduler
        from tiered_kv.store import LoadPlan, TieredStore
        from tiered_kv.tier import EncodedTier

        for owner, name, label in (
            (LLMEngine, "step", "step"),
            (Scheduler, "schedule", "schedule"),  # includes lookup and lease
            (TieredStore, "lookup", "lookup"),
            (LmdbBackend, "contains_many", "lmdb_contains"),
            (TieredStore, "lease", "lease"),
            (ConnectorWorker, "start_load_kv", "load"),  # submit + wait + scatter
            (LoadPlan, "wait", "load_wait"),
            (TieredStore, "_load_job", "pool_load_jobs"),  # per transfer thread, summed
            (EncodedTier, "read_into", "pool_tier_read"),  # LMDB visit incl. decode
            (BlockCodec, "decode", "pool_decode"),  # header+checksums+zstd+unshuffle
            (ConnectorWorker, "_scatter", "scatter"),
            (ModelRunner, "run", "forward"),
            (ConnectorWorker, "wait_for_save", "save_gather"),
        ):
            self.wrap(owner, name, label)
        return self

    def start(self) -> None:
        with self.lock:
            self.seconds.clear()
            self.calls.clear()
        self.active = True

    def stop(self) -> dict:
        self.active = False
        with self.lock:
            out = {k: round(v * 1e3, 2) for k, v in sorted(self.seconds.items())}
            calls = dict(self.calls)
        if "pool_tier_read" in out and "pool_decode" in out:
            out["pool_lmdb_read_excl_decode"] = round(out["pool_tier_read"] - out["pool_decode"], 2)
        out["calls"] = {k: calls[k] for k in ("pool_load_jobs", "pool_decode", "step") if k in calls}
        return out


# ---- page cache ---------------------------------------------------------------------------------
def resident_bytes(path: Path) -> int | None:
    """Bytes of ``path`` in the page cache (mincore over a fresh mapping); None if unknown."""
    import ctypes
    import mmap

    try:
        size = path.stat().st_size
        if size == 0:
            return 0
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                              ctypes.c_int, ctypes.c_long]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        page = mmap.PAGESIZE
        fd = os.open(path, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr is None or addr == ctypes.c_void_p(-1).value:
                return None
            try:
                vec = (ctypes.c_ubyte * ((size + page - 1) // page))()
                if libc.mincore(addr, size, vec) != 0:
                    return None
                raw = bytes(vec)
                return (len(raw) - raw.count(0)) * page
            finally:
                libc.munmap(addr, size)
        finally:
            os.close(fd)
    except (OSError, AttributeError):
        return None


def drop_page_cache(store_dir: str) -> dict:
    """fsync + POSIX_FADV_DONTNEED on the LMDB data file; residency before and after."""
    data = Path(store_dir) / "data.mdb"
    before = resident_bytes(data)
    fd = os.open(data, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    after = resident_bytes(data)
    st = data.stat()
    return {"data_mdb_allocated_mib": round(st.st_blocks * 512 / 2**20, 1),
            "resident_mib_before": None if before is None else round(before / 2**20, 1),
            "resident_mib_after": None if after is None else round(after / 2**20, 1)}


# ---- children -------------------------------------------------------------------------------------
def _serve_once(spec: dict, store_dir: str, probe: Probe | None) -> dict:
    """New engine + new connector on ``store_dir``; serve the prompt once; close the store."""
    from tiered_kv.engine import SamplingParams

    length = spec["length"]
    engine, connector = build(spec["max_position"], length + spec["gen_tokens"], store_dir)
    try:
        _warm_up(engine)
        params = SamplingParams(max_tokens=spec["gen_tokens"], temperature=0.0, return_logits=True)
        request_id = engine.add_request(prompt_tokens(length, seed=length), params)
        request = engine.get_request(request_id)
        if probe is not None:
            probe.start()
        outputs = []
        while request.num_output_tokens == 0:  # the breakdown covers the steps up to the first token
            outputs += engine.step()
        breakdown = probe.stop() if probe is not None else {}
        while engine.has_unfinished_requests():
            outputs += engine.step()
        engine.drain(30.0)
        [out] = [o for o in outputs if o.request_id == request_id]
        tiers = dict(connector.worker.load_stats.get(out.request_id, {}))
        start = time.perf_counter()
        connector.store.flush()  # cold: the write-behind of the prompt, made durable
        flush_s = time.perf_counter() - start
        snap = connector.store.metrics.snapshot()
    finally:
        connector.close()
    disk = snap["tiers"].get("disk", {})
    first_logits = out.logits[0] if out.logits else None
    return {
        "ttft_s": round(out.ttft_s, 4),
        "matched_tokens": out.num_external_tokens,
        "device_cached_tokens": out.num_cached_tokens,
        "prefilled_tokens": out.num_prefilled_tokens,
        "tier_blocks": tiers,
        "breakdown_ms": breakdown,
        "flush_after_s": round(flush_s, 3),
        "disk_blocks_written": disk.get("blocks_in", 0),
        "disk_stored_bytes": disk.get("stored_bytes_in", 0),
        "disk_payload_bytes": disk.get("bytes_in", 0),
        "misses": {r: n for t in snap["tiers"].values() for r, n in t["misses"].items()},
        "events": snap["events"],
        "output": out.output_token_ids,
        "first_logits": None if first_logits is None else [round(float(x), 6) for x in first_logits],
    }


def child_serve(spec: dict) -> dict:
    """One measurement in this fresh process: ``cold`` on an empty store, ``warm`` on the store
    a cold run left (host tier empty, page cache as it is), ``dropped`` the same after dropping
    the data file's pages from the page cache."""
    probe = Probe().install()
    drop = drop_page_cache(spec["dir"]) if spec["variant"] == "dropped" else None
    run = _serve_once(spec, spec["dir"], probe)
    if drop is not None:
        run["page_cache"] = drop
    if spec["variant"] == "cold":
        run["env"] = _env_info()
    run["probe_missing"] = probe.missing
    return run


def _decode_run(engine, prompts: list[list[int]], steps: int) -> dict:
    """Step a batch to completion; per-step wall time of the steps where every request decodes."""
    from tiered_kv.engine import SamplingParams

    params = SamplingParams(max_tokens=steps + 1, temperature=0.0)  # +1: sampled at prefill
    ids = [engine.add_request(p, params) for p in prompts]
    times, saving, cpu = [], [], 0.0
    while engine.has_unfinished_requests():
        requests = [engine.get_request(i) for i in ids]
        decoding = all(r is not None and r.num_output_tokens > 0 and r.finish_reason is None
                       for r in requests)
        # a step completes a block (and the connector saves it) when a request's computed
        # tokens reach a multiple of the block size
        completes = decoding and any((r.num_computed_tokens + 1) % BLOCK_SIZE == 0 for r in requests)
        cpu_start, start = time.process_time(), time.perf_counter()
        engine.step()
        elapsed, cpu_step = time.perf_counter() - start, time.process_time() - cpu_start
        if decoding:
            times.append(elapsed)
            saving.append(completes)
            cpu += cpu_step  # all threads of this process: the transfer pool's included
    engine.drain(30.0)
    return {"step_s": times, "block_step": saving, "cpu_s": cpu}


def child_decode(spec: dict) -> dict:
    import gc

    batch, prompt_len, steps = spec["batch"], spec["prompt_len"], spec["steps"]
    per_request = prompt_len + steps + 1
    engines = {"off": build(spec["max_position"], per_request, None, batch),
               "saving": build(spec["max_position"], per_request, spec["dir"], batch)}
    for engine, _ in engines.values():  # same shapes, a block boundary crossed: saves too
        _warm_up(engine)
        _decode_run(engine, [prompt_tokens(prompt_len, seed=10_000 + i) for i in range(batch)],
                    min(steps, 2 * BLOCK_SIZE + 2))
    connector = engines["saving"][1]
    connector.store.flush()
    runs = []
    for rep in range(spec["repeats"]):
        prompts = [prompt_tokens(prompt_len, seed=1000 * (rep + 1) + i) for i in range(batch)]
        for mode in (("off", "saving") if rep % 2 == 0 else ("saving", "off")):
            engine, conn = engines[mode]
            before = conn.store.metrics.snapshot() if conn else None
            gc.collect()
            result = _decode_run(engine, prompts, steps)
            if conn is not None:
                # write-behind still queued after the last step is this run's work too
                cpu_start, start = time.process_time(), time.perf_counter()
                conn.store.pool.drain()
                result["write_behind_drain_s"] = round(time.perf_counter() - start, 3)
                result["cpu_s"] += time.process_time() - cpu_start
                after = conn.store.metrics.snapshot()
                conn.store.flush()  # durable before the next run starts (fsync outside the timing)
                result["saved"] = _delta(before, after)
            runs.append({"rep": rep, "mode": mode, **result})
    info = {"threads": {"torch_intra_op": _torch_threads(),
                        "transfer_workers": connector.store.config.workers}}
    for _engine, conn in engines.values():
        if conn is not None:
            conn.close()
    return {"runs": runs, "info": info}


def _delta(before: dict, after: dict) -> dict:
    def tier(snap, name, field):
        return snap["tiers"].get(name, {}).get(field, 0)

    return {
        "host_blocks": tier(after, "host", "blocks_in") - tier(before, "host", "blocks_in"),
        "disk_blocks": tier(after, "disk", "blocks_in") - tier(before, "disk", "blocks_in"),
        "disk_write_s": round(tier(after, "disk", "seconds_in") - tier(before, "disk", "seconds_in"), 4),
        "saves_dropped": after["events"].get("saves_dropped", 0) - before["events"].get("saves_dropped", 0),
    }


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def _env_info() -> dict:
    import torch

    info = {"torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "cuda": torch.cuda.is_available()}
    for mod in ("lmdb", "zstandard", "xxhash", "numpy"):
        try:
            module = __import__(mod)
            info[mod] = getattr(module, "__version__", None) or ".".join(map(str, module.version()))
        except Exception:
            info[mod] = None
    return info


def _model_info(max_position: int) -> dict:
    model = _model_config(max_position)
    h, i, L = model.hidden_size, model.intermediate_size, model.num_layers
    q, kv = model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim
    params = model.vocab_size * h * 2 + L * (h * (2 * q + 2 * kv) + 3 * h * i + 2 * h) + h
    itemsize = 4 if model.dtype == "float32" else 2
    return {"config": model.to_dict(), "params_m": round(params / 1e6, 2),
            "weights_mib": round(params * itemsize / 2**20, 1),
            "block_shape": [L, 2, BLOCK_SIZE, model.num_kv_heads, model.head_dim],
            "block_bytes": _block_bytes(model),
            "kv_bytes_per_token": _block_bytes(model) // BLOCK_SIZE}


# ---- parent ---------------------------------------------------------------------------------------
def run_child(role: str, spec: dict) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", role, json.dumps(spec)]
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, env=env, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"{role} child failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _log(msg: str) -> None:
    print(f"[bench_e2e {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _summ(runs: list[dict]) -> dict:
    """Median TTFT and the figures of the median run (every run's TTFT listed)."""
    ttfts = [r["ttft_s"] for r in runs]
    mid = sorted(runs, key=lambda r: r["ttft_s"])[(len(runs) - 1) // 2]
    keep = {k: v for k, v in mid.items() if k not in ("output", "first_logits", "ttft_s", "probe_missing", "env")}
    return {"ttft_s": round(_median(ttfts), 4), "runs_s": ttfts, **keep}


def _max_abs_diff(a: list[float] | None, b: list[float] | None) -> float | None:
    if a is None or b is None:
        return None
    return round(max(abs(x - y) for x, y in zip(a, b)), 6)


def ttft_section(args, max_position: int, scratch: str) -> tuple[list[dict], dict]:
    """Every measurement in its own fresh process (a restart's first request pays first-call
    costs -- fresh buffers fault their pages in -- and that is part of what is measured)."""
    rows, env = [], {}
    variants = ["warm"] + ([] if args.no_drop else ["dropped"])
    for length in args.lengths:
        cold_repeats = args.cold_repeats or (args.repeats if length < TARGET_FROM else 1)
        base = {"length": length, "max_position": max_position, "gen_tokens": GEN_TOKENS}
        with tempfile.TemporaryDirectory(prefix=f"ttft-{length}-", dir=scratch) as d:
            store = str(Path(d) / "store")
            cold_runs = [run_child("serve", {**base, "variant": "cold", "dir": store})]
            env = env or cold_runs[0].pop("env", {})
            for _ in range(1, cold_repeats):  # more cold runs, each on its own empty store
                with tempfile.TemporaryDirectory(prefix="cold-", dir=d) as other:
                    cold_runs.append(run_child("serve", {**base, "variant": "cold",
                                                         "dir": str(Path(other) / "store")}))
            _log(f"{length} tokens: cold {[r['ttft_s'] for r in cold_runs]} s")
            runs: dict[str, list[dict]] = {v: [] for v in variants}
            for rep in range(args.repeats):  # alternate which variant goes first
                for variant in (variants if rep % 2 == 0 else variants[::-1]):
                    runs[variant].append(run_child("serve", {**base, "variant": variant, "dir": store}))
            _log(f"{length} tokens: " + ", ".join(f"{v} {[r['ttft_s'] for r in rs]} s" for v, rs in runs.items()))
        reference = cold_runs[0]
        row: dict[str, Any] = {"prompt_tokens": length, "full_blocks": length // BLOCK_SIZE,
                               "claimable_blocks": (length - 1) // BLOCK_SIZE,
                               "cold": _summ(cold_runs), "warm_restart": _summ(runs["warm"])}
        row["cold"]["stored_block_bytes_avg"] = (
            round(reference["disk_stored_bytes"] / reference["disk_blocks_written"])
            if reference["disk_blocks_written"] else None)
        row["ratio_warm_over_cold"] = round(row["warm_restart"]["ttft_s"] / row["cold"]["ttft_s"], 4)
        others = cold_runs + runs["warm"]
        if runs.get("dropped"):
            row["warm_restart_page_cache_dropped"] = _summ(runs["dropped"])
            row["ratio_dropped_over_cold"] = round(
                row["warm_restart_page_cache_dropped"]["ttft_s"] / row["cold"]["ttft_s"], 4)
            others += runs["dropped"]
        row["outputs_identical"] = all(r["output"] == reference["output"] for r in others)
        row["first_token_logits_max_abs_diff"] = max(
            (_max_abs_diff(reference["first_logits"], r["first_logits"]) or 0.0) for r in others)
        row["target_ratio"] = TARGET_RATIO if length >= TARGET_FROM else None
        if row["target_ratio"] is not None:
            worst = max(row["ratio_warm_over_cold"], row.get("ratio_dropped_over_cold", 0.0))
            row["pass"] = worst <= TARGET_RATIO
        rows.append(row)
    return rows, env


def decode_section(args, max_position: int, scratch: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="decode-", dir=scratch) as d:
        got = run_child("decode", {"batch": args.batch, "prompt_len": args.prompt_len,
                                   "steps": args.decode_steps, "repeats": args.repeats,
                                   "max_position": max_position, "dir": str(Path(d) / "store")})
    runs = got["runs"]
    by_mode: dict[str, list[dict]] = {"off": [], "saving": []}
    for r in runs:
        by_mode[r["mode"]].append(r)

    def stats(rs: list[dict], which: str | None = None) -> dict:
        per_run_median, all_steps = [], []
        for r in rs:
            steps = [t for t, b in zip(r["step_s"], r["block_step"])
                     if which is None or (b if which == "block" else not b)]
            if steps:
                per_run_median.append(_median(steps))
                all_steps += steps
        all_steps.sort()
        return {"median_ms": round(_median(per_run_median) * 1e3, 3),
                "mean_ms": round(statistics.fmean(all_steps) * 1e3, 3) if all_steps else None,
                "p90_ms": round(all_steps[int(0.9 * (len(all_steps) - 1))] * 1e3, 3) if all_steps else None,
                "per_run_median_ms": [round(x * 1e3, 3) for x in per_run_median]}

    pairs = []
    for rep in range(args.repeats):
        off = next(r for r in runs if r["rep"] == rep and r["mode"] == "off")
        on = next(r for r in runs if r["rep"] == rep and r["mode"] == "saving")
        pairs.append({"median": _median(on["step_s"]) / _median(off["step_s"]),
                      "mean": statistics.fmean(on["step_s"]) / statistics.fmean(off["step_s"]),
                      "cpu": on["cpu_s"] / off["cpu_s"]})
    overhead = (_median([p["median"] for p in pairs]) - 1) * 100
    mean_overhead = (_median([p["mean"] for p in pairs]) - 1) * 100
    cpu_overhead = (_median([p["cpu"] for p in pairs]) - 1) * 100
    out = {
        "batch": args.batch, "prompt_tokens": args.prompt_len, "decode_steps": args.decode_steps,
        "repeats": args.repeats, "order": "ABBA (off/saving alternate which runs first)",
        "off": stats(by_mode["off"]), "saving": stats(by_mode["saving"]),
        "off_block_steps": stats(by_mode["off"], "block"), "saving_block_steps": stats(by_mode["saving"], "block"),
        "off_plain_steps": stats(by_mode["off"], "plain"), "saving_plain_steps": stats(by_mode["saving"], "plain"),
        "overhead_pct": round(overhead, 2),
        "overhead_pct_of_means": round(mean_overhead, 2),
        "cpu_overhead_pct": round(cpu_overhead, 2),
        "cpu_ms_per_step": {m: [round(r["cpu_s"] / len(r["step_s"]) * 1e3, 3) for r in rs]
                            for m, rs in by_mode.items()},
        "pair_overheads_pct": [round((p["median"] - 1) * 100, 2) for p in pairs],
        "target_pct": TARGET_OVERHEAD_PCT, "pass": overhead <= TARGET_OVERHEAD_PCT,
        "saved_per_run": [r["saved"] for r in by_mode["saving"]],
        "write_behind_drain_after_run_s": [r["write_behind_drain_s"] for r in by_mode["saving"]],
        **got["info"],
    }
    return out


def machine_info() -> dict:
    cpu = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        mem = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                   if line.startswith("MemTotal"))
    except (OSError, StopIteration):
        mem = 0
    return {"cpu": cpu, "cpus": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)),
            "mem_gib": round(mem / 2**20, 1), "python": platform.python_version(),
            "platform": platform.platform(), "loadavg_start": [round(x, 2) for x in os.getloadavg()]}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--lengths", default="512,2048,8192", help="prompt lengths (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="warm restarts per length and decode off/on pairs (default: %(default)s)")
    parser.add_argument("--cold-repeats", type=int, default=0,
                        help="cold runs per length (default: --repeats below 4096 tokens, 1 from 4096 on)")
    parser.add_argument("--decode-steps", type=int, default=128, help="decode steps per run (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=4, help="decode batch (default: %(default)s)")
    parser.add_argument("--prompt-len", type=int, default=512, help="decode prompt tokens (default: %(default)s)")
    parser.add_argument("--dir", default=None, help="where temporary stores go (default: the system temp dir)")
    parser.add_argument("--no-drop", action="store_true", help="skip the page-cache-dropped restarts")
    parser.add_argument("--skip-ttft", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--skip-decode", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 512 and 2048 tokens, 1 repeat, 32 decode steps")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.lengths, args.repeats, args.decode_steps, args.cold_repeats = "512,2048", 1, 32, 1
    args.lengths = [int(x) for x in str(args.lengths).split(",") if x.strip()]
    if args.repeats < 1 or args.decode_steps < 1 or not args.lengths:
        parser.error("--repeats and --decode-steps must be positive and --lengths not empty")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child:
        import logging

        logging.basicConfig(level=logging.WARNING)
        role, spec = args.child[0], json.loads(args.child[1])
        result = {"serve": child_serve, "decode": child_decode}[role](spec)
        print(json.dumps(result))
        return
    started = time.perf_counter()
    max_position = max(args.lengths + [args.prompt_len + args.decode_steps]) + 256
    if args.dir:
        Path(args.dir).mkdir(parents=True, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix="bench-e2e-", dir=args.dir)
    try:
        report: dict[str, Any] = {
            "bench": "tiered-kv end to end: reference engine, demo model, host + LMDB store",
            "machine": machine_info(),
            "model": _model_info(max_position),
            "setup": {
                "engine": {"block_size": BLOCK_SIZE, "max_num_batched_tokens": MAX_BATCHED_TOKENS,
                           "prefill": f"one step up to {MAX_BATCHED_TOKENS} tokens (no chunking)",
                           "max_position": max_position, "device": "auto"},
                "store": {"host": "2x the KV pool, >= 64 MiB", "disk": "lmdb, zstd+shuffle level 1, "
                          "write_through, capacity 4 GiB, sync off (flushed before the next process)"},
                "connector": {"load_async": False},
                "ttft_generated_tokens": GEN_TOKENS, "lengths": args.lengths, "repeats": args.repeats,
            },
        }
        if not args.skip_ttft:
            report["ttft"], report["env"] = ttft_section(args, max_position, scratch)
        if not args.skip_decode:
            _log("decode: off vs saving ...")
            report["decode"] = decode_section(args, max_position, scratch)
            d = report["decode"]
            _log(f"decode: off {d['off']['median_ms']} ms, saving {d['saving']['median_ms']} ms, "
                 f"overhead {d['overhead_pct']}% (pairs {d['pair_overheads_pct']})")
        targets = {}
        for row in report.get("ttft", []):
            if row.get("target_ratio") is not None:
                targets[f"ttft_ratio_{row['prompt_tokens']}"] = row["pass"]
        if "decode" in report:
            targets["decode_overhead"] = report["decode"]["pass"]
        report["targets_met"] = targets
        report["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
        report["elapsed_s"] = round(time.perf_counter() - started, 1)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print_table(report)


def print_table(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    m, model = report["machine"], report["model"]
    console.print(f"{m['cpu']} x{m['cpus']}, torch {report.get('env', {}).get('torch')}, model "
                  f"{model['params_m']}M params ({model['config']['dtype']}), block "
                  f"{model['block_bytes'] // 1024} KiB; elapsed {report['elapsed_s']} s")
    if "ttft" in report:
        table = Table(title="cold vs warm-restart TTFT (medians)")
        for col in ("tokens", "cold s", "warm s", "warm/cold", "cache dropped s", "dropped/cold",
                    "matched", "prefilled", "tiers", "same output"):
            table.add_column(col, justify="right")
        for row in report["ttft"]:
            dropped = row.get("warm_restart_page_cache_dropped", {})
            warm = row["warm_restart"]
            table.add_row(str(row["prompt_tokens"]), f"{row['cold']['ttft_s']:.3f}", f"{warm['ttft_s']:.3f}",
                          f"{row['ratio_warm_over_cold']:.3f}", f"{dropped.get('ttft_s', float('nan')):.3f}",
                          f"{row.get('ratio_dropped_over_cold', float('nan')):.3f}",
                          str(warm["matched_tokens"]), str(warm["prefilled_tokens"]),
                          ",".join(f"{k}:{v}" for k, v in warm["tier_blocks"].items()),
                          "yes" if row["outputs_identical"] else "NO")
        console.print(table)
    if "decode" in report:
        d = report["decode"]
        console.print(f"decode step ({d['batch']} x {d['prompt_tokens']}-token prompts, {d['decode_steps']} "
                      f"steps): off {d['off']['median_ms']} ms, saving {d['saving']['median_ms']} ms, "
                      f"overhead {d['overhead_pct']}% (pairs {d['pair_overheads_pct']}; target <= "
                      f"{d['target_pct']}%)")
    console.print(f"targets met: {report['targets_met']}")


if __name__ == "__main__":
    main()
