"""bench_cuda: the GPU side of the data path against the machine's own limits, in one run.

Limits, timed with CUDA events over one batch of bytes: a single copy host->device and
device->host from pinned memory (the link's limit as the copy engines see it), the same from
pageable memory (what staging without pinned memory gets), the same in one copy per 2 MiB block
from pinned memory (the per-copy cost of the copy engines), and a device->device copy (the limit
of the gather/scatter kernels).

Ours: the Triton gather/scatter between the reference engine's pool ``[2, L, blocks, bs, H, D]``
and canonical blocks (and torch's fallback), each on the device; the connector worker's save
(gather on a side stream, copies into the pinned host slots, until committed), its load of host
hits into device blocks (copies straight from the pinned slab, scatter, until the copies ended),
its restore of blocks from the LMDB tier into device blocks in a fresh store (decoded into host
slots by the pool, then as above), and the store's own ``save`` / ``load_into`` with device
tensors. Every moved block is checked against its source once, outside the timing.

GB/s are 1e9 bytes of payload per second, medians over the repeats; ratios are ours over the
limit named beside it."""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from .common import GB, log, median

BLOCK_SHAPE = (32, 2, 16, 8, 128)  # Llama-8B-like: 32 layers, K/V, 16 tokens, 8 KV heads, 128 dims
DTYPE_NAME = "bfloat16"


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench_cuda.py", description=__doc__.split("\n")[0])
    p.add_argument("--blocks", type=int, default=256, help="2 MiB blocks per step (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats (default: %(default)s)")
    p.add_argument("--dir", default=None, help="where the LMDB tier lives (default: a temp dir)")
    p.add_argument("--workers", type=int, default=None, help="store workers (default: the config's)")
    p.add_argument("--label", default="", help="a name for this run in the report")
    p.add_argument("--json", default=None, help="also write the report to this file")
    return p.parse_args(argv)


class Run:
    """Figures of one run: name -> list of seconds, and the bytes each figure moved."""

    def __init__(self) -> None:
        self.seconds: dict[str, list[float]] = {}
        self.nbytes: dict[str, int] = {}

    def add(self, name: str, nbytes: int, seconds: float) -> None:
        self.seconds.setdefault(name, []).append(seconds)
        self.nbytes[name] = nbytes

    def gbps(self, name: str) -> float | None:
        s = median(self.seconds.get(name, []))
        return None if not s else self.nbytes[name] / s / GB

    def table(self) -> dict[str, dict]:
        out = {}
        for name, secs in self.seconds.items():
            runs = [self.nbytes[name] / s / GB for s in secs]
            out[name] = {"gbps": round(self.gbps(name), 2), "runs_gbps": [round(x, 2) for x in runs],
                         "bytes": self.nbytes[name]}
        return out


def _events_time(fn: Callable[[], None]) -> float:
    """Seconds ``fn`` takes on the current stream (CUDA events)."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def _wall_time(fn: Callable[[], None]) -> float:
    """Wall seconds of ``fn`` until the device is idle again."""
    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def measure_limits(run: Run, nbytes: int, block_nbytes: int, repeats: int) -> None:
    import torch

    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev2 = torch.empty_like(dev)
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    pageable = torch.empty(nbytes, dtype=torch.uint8)
    pinned.fill_(1)
    pageable.fill_(2)
    dev.fill_(3)
    n = nbytes // block_nbytes
    for _ in range(repeats):
        run.add("limit_h2d_pinned", nbytes, _events_time(lambda: dev.copy_(pinned, non_blocking=True)))
        run.add("limit_d2h_pinned", nbytes, _events_time(lambda: pinned.copy_(dev, non_blocking=True)))

        def per_block_h2d() -> None:
            for i in range(n):
                dev[i * block_nbytes:(i + 1) * block_nbytes].copy_(
                    pinned[i * block_nbytes:(i + 1) * block_nbytes], non_blocking=True)

        def per_block_d2h() -> None:
            for i in range(n):
                pinned[i * block_nbytes:(i + 1) * block_nbytes].copy_(
                    dev[i * block_nbytes:(i + 1) * block_nbytes], non_blocking=True)

        run.add("limit_h2d_pinned_per_block", nbytes, _wall_time(per_block_h2d))
        run.add("limit_d2h_pinned_per_block", nbytes, _wall_time(per_block_d2h))
        run.add("limit_h2d_pageable", nbytes, _wall_time(lambda: dev.copy_(pageable)))
        run.add("limit_d2h_pageable", nbytes, _wall_time(lambda: pageable.copy_(dev)))
        run.add("limit_d2d", nbytes, _events_time(lambda: dev2.copy_(dev)))


def measure_kernels(run: Run, blocks: int, repeats: int) -> dict:
    import torch

    from tiered_kv.connector import block_copy
    from tiered_kv.connector.layout import make_layout

    pool = torch.randn(2, BLOCK_SHAPE[0], 2 * blocks, *BLOCK_SHAPE[2:], device="cuda").to(torch.bfloat16)
    ids = torch.randperm(2 * blocks, device="cuda")[:blocks]
    nbytes = blocks * pool[:, :, 0].numel() * pool.element_size()
    triton = block_copy.use_triton(pool.device)
    if triton:
        assert torch.equal(block_copy.gather_triton(pool, ids), block_copy.gather_torch(pool, ids))
    src = block_copy.gather_torch(pool, ids)
    for _ in range(repeats):
        if triton:
            run.add("gather_triton", nbytes, _events_time(lambda: block_copy.gather_triton(pool, ids)))
            run.add("scatter_triton", nbytes, _events_time(lambda: block_copy.scatter_triton(pool, ids, src)))
        run.add("gather_torch", nbytes, _events_time(lambda: block_copy.gather_torch(pool, ids)))
        run.add("scatter_torch", nbytes, _events_time(lambda: block_copy.scatter_torch(pool, ids, src)))
    # vLLM's GPU layout: one [blocks, K|V, bs, H, D] tensor per layer (torch index ops per layer)
    layers = [torch.randn(2 * blocks, *BLOCK_SHAPE[1:], device="cuda").to(torch.bfloat16)
              for _ in range(BLOCK_SHAPE[0])]
    layout = make_layout(_namespace("kernels"), layers)
    for _ in range(repeats):
        run.add(f"gather_{layout.name}", nbytes, _events_time(lambda: layout.gather(ids)))
        run.add(f"scatter_{layout.name}", nbytes, _events_time(lambda: layout.scatter(ids, src)))
    return {"triton": triton}


def _namespace(tag: str):
    from tiered_kv.keys import Namespace

    layers, _, bs, heads, dim = BLOCK_SHAPE
    return Namespace(model_id=f"bench-cuda/llama-8b-like/{tag}", dtype=DTYPE_NAME, num_layers=layers,
                     num_kv_heads=heads, head_dim=dim, block_size=bs)


def _keys(ns, n: int, seed: int) -> list[bytes]:
    import random

    from tiered_kv.keys import block_keys

    rng = random.Random(seed)
    return block_keys(ns, [rng.randrange(128_000) for _ in range(n * ns.block_size)])


def _store(host_bytes: int, disk_dir: str | None, workers: int | None, ns):
    from tiered_kv.config import TieredKVConfig
    from tiered_kv.store import TieredStore

    cfg: dict = {"host": {"capacity": host_bytes}}
    if workers:
        cfg["workers"] = workers
    if disk_dir is not None:
        cfg["disk"] = {"url": f"lmdb://{disk_dir}", "capacity": 64 << 30}
    return TieredStore(TieredKVConfig.from_dict(cfg), ns)


def measure_connector(run: Run, args: argparse.Namespace, base: str) -> dict:
    """The worker's save, host load and LMDB restore, and the store's API with device tensors."""
    import torch

    from tiered_kv.connector.block_copy import gather_torch
    from tiered_kv.connector.meta import ConnectorMeta, LoadSpec, SaveSpec
    from tiered_kv.connector.worker import ConnectorWorker

    n, repeats = args.blocks, args.repeats
    block_nbytes = torch.Size(BLOCK_SHAPE).numel() * 2
    nbytes = n * block_nbytes
    pool = torch.randn(2, BLOCK_SHAPE[0], 2 * n, *BLOCK_SHAPE[2:], device="cuda").to(torch.bfloat16)
    src_ids = torch.randperm(2 * n).tolist()[:n]
    dst_ids = [b for b in range(2 * n) if b not in set(src_ids)]
    expected = gather_torch(pool, torch.tensor(src_ids, device="cuda"))
    info: dict = {}

    def step(worker: ConnectorWorker, meta: ConnectorMeta) -> None:
        worker.bind_connector_meta(meta)
        worker.start_load_kv()
        worker.wait_for_save()
        worker.clear_connector_metadata()

    def check(got_ids: list[int], what: str) -> None:
        got = gather_torch(pool, torch.tensor(got_ids, device="cuda"))
        if not torch.equal(got, expected):
            raise AssertionError(f"{what}: the device blocks differ from the saved ones")

    disk = os.path.join(base, "lmdb")
    ns = _namespace(args.label or "run")
    key_sets = [_keys(ns, n, seed) for seed in range(repeats)]
    # save (device -> pinned host slots, committed) and host-hit load (pinned slab -> device)
    with _store(n * block_nbytes * 2 + block_nbytes, disk, args.workers, ns) as store:
        info["host_pinned"] = bool(store.host.pinned)
        info["disk_codec"] = store.stats().get("codecs")
        worker = ConnectorWorker(store)
        worker.register_kv_caches(pool)
        for r, keys in enumerate(key_sets):
            save = ConnectorMeta(saves=[SaveSpec(f"s{r}", tuple(keys), tuple(src_ids), 0)])

            def saving() -> None:
                step(worker, save)  # noqa: B023
                worker.flush_copies()

            run.add("worker_save_d2h", nbytes, _wall_time(saving))
            assert store.flush(600), "write-behind did not finish"
            pool[:, :, dst_ids] = 0
            load = ConnectorMeta(loads=[LoadSpec(f"l{r}", tuple(keys), tuple(dst_ids), is_async=False)])
            run.add("worker_load_host_h2d", nbytes, _wall_time(lambda: step(worker, load)))  # noqa: B023
            assert not worker.get_block_ids_with_load_errors()
            check(dst_ids, "host load")
        outs = [torch.empty(BLOCK_SHAPE, dtype=torch.bfloat16, device="cuda") for _ in range(n)]
        ins = list(expected.unbind(0))
        for _ in range(repeats):  # the last saved set: every block is a host hit
            for o in outs:
                o.fill_(0)
            got: list = []
            run.add("store_load_into_host_cuda", nbytes,
                    _wall_time(lambda: got.extend(store.load_into(key_sets[-1], outs))))  # noqa: B023
            assert all(got) and len(got) == n, f"load_into (host): {got.count(False)} blocks not loaded"
            assert all(torch.equal(o, e) for o, e in zip(outs, ins)), "load_into differs"
        api_keys = [_keys(ns, n, 1000 + r) for r in range(repeats)]
        for keys in api_keys:
            run.add("store_save_cuda", nbytes, _wall_time(lambda: store.save(keys, ins)))  # noqa: B023
            assert store.flush(600)
        worker.close()
    # restore from LMDB (page cache warm: just written) into device blocks, in fresh stores
    for r, keys in enumerate(key_sets):
        with _store(n * block_nbytes + block_nbytes, disk, args.workers, ns) as store:
            worker = ConnectorWorker(store)
            worker.register_kv_caches(pool)
            pool[:, :, dst_ids] = 0
            load = ConnectorMeta(loads=[LoadSpec(f"d{r}", tuple(keys), tuple(dst_ids), is_async=False)])
            run.add("worker_restore_lmdb_warm", nbytes, _wall_time(lambda: step(worker, load)))  # noqa: B023
            assert not worker.get_block_ids_with_load_errors()
            check(dst_ids, "LMDB restore")
            worker.close()
        with _store(n * block_nbytes + block_nbytes, disk, args.workers, ns) as store:
            cpu_outs = [torch.zeros(BLOCK_SHAPE, dtype=torch.bfloat16) for _ in range(n)]
            got = []
            run.add("store_load_into_lmdb_cpu", nbytes,
                    _wall_time(lambda: got.extend(store.load_into(keys, cpu_outs))))  # noqa: B023
            hits = store.stats()["tiers"].get("disk", {}).get("hits", 0)
            assert all(got) and len(got) == n and hits == n, \
                f"load_into (LMDB): {got.count(False)} blocks not loaded, {hits} of {n} from disk"
            assert all(torch.equal(o, e.cpu()) for o, e in zip(cpu_outs, ins)), "load_into (LMDB) differs"
    return info


RATIOS = [  # (ours, limit)
    ("gather_triton", "limit_d2d"), ("scatter_triton", "limit_d2d"),
    ("gather_torch", "limit_d2d"), ("scatter_torch", "limit_d2d"),
    ("worker_save_d2h", "limit_d2h_pinned"), ("worker_load_host_h2d", "limit_h2d_pinned"),
    ("worker_restore_lmdb_warm", "limit_h2d_pinned"), ("worker_restore_lmdb_warm", "store_load_into_lmdb_cpu"),
    ("store_load_into_host_cuda", "limit_h2d_pinned"), ("store_save_cuda", "limit_d2h_pinned"),
]


def _machine() -> dict:
    import torch

    props = torch.cuda.get_device_properties(0)
    try:
        import triton

        triton_version = triton.__version__
    except Exception:
        triton_version = None
    return {"gpu": props.name, "gpu_mem_gib": round(props.total_memory / 2**30, 1),
            "cuda": torch.version.cuda, "torch": torch.__version__, "triton": triton_version,
            "cpus": os.cpu_count(), "python": platform.python_version(), "kernel": platform.release()}


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    import torch

    if not torch.cuda.is_available():
        log("no CUDA device here: nothing to measure", "bench_cuda")
        return 0
    run = Run()
    with tempfile.TemporaryDirectory(prefix="bench-cuda-", dir=args.dir) as base:
        block_nbytes = torch.Size(BLOCK_SHAPE).numel() * 2
        settings: dict = {}
        errors: dict[str, str] = {}
        sections = [("limits", lambda: measure_limits(run, args.blocks * block_nbytes, block_nbytes, args.repeats)),
                    ("kernels", lambda: measure_kernels(run, args.blocks, args.repeats)),
                    ("connector", lambda: measure_connector(run, args, base))]
        for name, section in sections:  # one failing section leaves the others' figures
            log(f"{name}: {args.blocks} blocks of {block_nbytes >> 20} MiB per step", "bench_cuda")
            try:
                settings.update(section() or {})
            except Exception as exc:
                log(f"{name} failed: {traceback.format_exc()}", "bench_cuda")
                errors[name] = repr(exc)
            torch.cuda.empty_cache()
    figures = run.table()
    ratios = {f"{a} / {b}": round(run.gbps(a) / run.gbps(b), 3)
              for a, b in RATIOS if run.gbps(a) and run.gbps(b)}
    report = {"bench": "tiered-kv CUDA data path vs this machine's limits", "label": args.label,
              "machine": _machine(), "settings": {"blocks": args.blocks, "block_shape": BLOCK_SHAPE,
                                                  "dtype": DTYPE_NAME, "repeats": args.repeats,
                                                  "workers": args.workers, **settings},
              "figures_gbps": figures, "ratios": ratios, "errors": errors}
    width = max(map(len, figures))
    print(f"# {report['machine']['gpu']}  {args.label}  ({args.blocks} x 2 MiB per step, medians of {args.repeats})")
    for name, fig in figures.items():
        print(f"{name:<{width}}  {fig['gbps']:8.2f} GB/s   runs {fig['runs_gbps']}")
    for name, ratio in ratios.items():
        print(f"ratio {name}: {ratio}")
    for name, error in errors.items():
        print(f"section {name} failed: {error}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 1 if errors else 0
