"""bench_e2e's child processes, one fresh process per measurement (``--child ROLE SPEC``, a JSON
result on the last line of stdout): ``serve`` builds an engine and connector on an LMDB store
and serves one prompt cold, warm or after dropping the data file from the page cache, with the
probe's breakdown of the time to the first token; ``decode`` runs the same batch of decode steps
on an engine without a connector and one saving through it, ABBA order, write-behind drained
between runs."""

from __future__ import annotations

import gc
import time

from .e2e_probe import Probe
from .e2e_setup import BLOCK_SIZE, build, prompt_tokens, warm_up
from .machine import e2e_env
from .pagecache import drop_page_cache, store_resident_mib


def _serve_once(spec: dict, store_dir: str, probe: Probe | None) -> dict:
    """New engine + new connector on ``store_dir``; serve the prompt once; close the store."""
    from tiered_kv.engine import SamplingParams

    length, extra = spec["length"], spec.get("extra_tokens", 0)
    # a continuation saves nothing: the next run finds the same store, and its new tokens computed
    engine, connector = build(spec["max_position"], length + extra + spec["gen_tokens"], store_dir,
                              layerwise=spec.get("layerwise", True), save=not extra)
    try:
        warm_up(engine)
        params = SamplingParams(max_tokens=spec["gen_tokens"], temperature=0.0, return_logits=True)
        prompt = prompt_tokens(length, seed=length) + prompt_tokens(extra, seed=length + 1)
        # what the store's open (its index warm-up) and the engine's warm-up read back before
        # the request: a "dropped" run's index pages may be warm again, its block values not
        at_request = store_resident_mib(store_dir) if spec["variant"] == "dropped" else None
        request_id = engine.add_request(prompt, params)
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
        "store_resident_mib_at_request": at_request,
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
    the data file's pages from the page cache; ``extra_tokens``: the stored prompt followed by
    that many new tokens (a continuation: the restore of the prefix beside their compute)."""
    probe = Probe().install()
    drop = drop_page_cache(spec["dir"]) if spec["variant"] == "dropped" else None
    run = _serve_once(spec, spec["dir"], probe)
    if drop is not None:
        run["page_cache"] = drop
    if spec["variant"] == "cold":
        run["env"] = e2e_env()
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
    batch, prompt_len, steps = spec["batch"], spec["prompt_len"], spec["steps"]
    per_request = prompt_len + steps + 1
    engines = {"off": build(spec["max_position"], per_request, None, batch),
               "saving": build(spec["max_position"], per_request, spec["dir"], batch)}
    for engine, _ in engines.values():  # same shapes, a block boundary crossed: saves too
        warm_up(engine)
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


CHILDREN = {"serve": child_serve, "decode": child_decode}
