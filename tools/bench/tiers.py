"""Timing the store's tiers for bench_tiers (each function adds ``store.*`` figures to the run's
``Figures``): host save / load; LMDB write-behind (until ``save()`` returned, until every block
was committed, until ``flush()`` made it durable) and restore with the page cache warm and
dropped; Redis write-behind and restore. A restore is always a fresh store on the same medium
with a host tier of two load batches, so every block comes from the tier under test."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from tiered_kv.config import TieredKVConfig
from tiered_kv.keys import Namespace
from tiered_kv.store import TieredStore

from .common import MiB, Stopwatch
from .data import SIZES, keys_of, namespace, touched
from .pagecache import files_under, not_cold, resident_fraction

if TYPE_CHECKING:
    from .tiers_main import Bench

WORKERS = 2  # the store's transfer threads (its codec ``auto`` is resolved for this many)


def make_store(b: Bench, size: str, tag: str, host_blocks: int, disk: str | None = None,
               remote: str | None = None) -> TieredStore:
    ns = namespace(size, tag)
    total = len(b.data[size]) * b.data[size][0].numel() * 2
    cfg: dict = {
        "host": {"capacity": host_blocks * b.data[size][0].numel() * 2},
        "workers": WORKERS,
        # the whole run fits: a dropped save would make the figure meaningless
        "max_inflight_save": 2 * total + 64 * MiB,
        "max_inflight_load": 2 * total + 64 * MiB,
    }
    if disk is not None:
        cfg["disk"] = {"url": f"lmdb://{disk}", "capacity": 4 * total + 256 * MiB}
    if remote is not None:
        cfg["remote"] = {"url": remote}
    return TieredStore(TieredKVConfig.from_dict(cfg), ns)


def batches(b: Bench, size: str, keys: list[bytes]):
    n = SIZES[size]["batch"]
    data = b.data[size]
    for lo in range(0, len(keys), n):
        yield keys[lo:lo + n], data[lo:lo + n]


def out_tensors(b: Bench, size: str) -> list[torch.Tensor]:
    n = min(SIZES[size]["batch"], len(b.data[size]))
    return list(touched((n, *b.data[size][0].shape), b.data[size][0].dtype).unbind(0))


def restore(b: Bench, size: str, name: str, tier: str, keys: list[bytes], make: Callable[[], TieredStore],
            before: Callable[[], None] | None = None) -> None:
    """A fresh store (host tier of two batches: load_into stages in halves of it); load every
    key, one batch per load_into; check they all came from ``tier`` and the data is right."""
    data = b.data[size]
    n, nb = len(data), data[0].numel() * 2
    outs = out_tensors(b, size)
    if before is not None:
        before()
    t_open = time.perf_counter()
    store = make()
    opened = time.perf_counter() - t_open
    try:
        failed, wrong, seconds = 0, 0, (0.0, 0.0)
        for lo in range(0, n, len(outs)):
            ks = keys[lo:lo + len(outs)]
            seconds, failed = timed_load(store, ks, outs, seconds, failed)
            wrong += differing(outs, data[lo:lo + len(ks)])  # every batch, outside the timing
        snap = store.stats()
    finally:
        store.close()
    served = {t: v["hits"] for t, v in snap["tiers"].items() if v["hits"]}
    notes = {"open_s": round(opened, 4), "batch": len(outs), "served_by": served}
    if served.get(tier, 0) != n:
        b.fig.fail(size, name, f"expected all {n} blocks from the {tier} tier, got {served}")
    if failed or wrong:
        misses = {t: v["misses"] for t, v in snap["tiers"].items() if v["misses"]}
        b.fig.fail(size, name, f"{failed} blocks not loaded, {wrong} differ; "
                   f"misses {misses}, events {snap['events']}")
    b.fig.add(size, name, seconds, n * nb, n, **notes)


def timed_load(store: TieredStore, ks: list[bytes], outs: list[torch.Tensor], seconds: tuple[float, float],
               failed: int) -> tuple[tuple[float, float], int]:
    """One ``load_into`` of ``ks`` into the first ``outs``: (wall, CPU) seconds and the blocks not
    loaded, each added to the running totals given."""
    sw = Stopwatch()
    ok = store.load_into(ks, outs[:len(ks)])
    wall, cpu = sw.lap()
    return (seconds[0] + wall, seconds[1] + cpu), failed + len(ks) - sum(ok)


def differing(outs: list[torch.Tensor], expected: list[torch.Tensor]) -> int:
    """Blocks of ``outs`` (the first ``len(expected)``) that differ from ``expected``, byte for
    byte; the buffers are then overwritten so the next load cannot pass on stale bytes."""
    wrong = sum(not torch.equal(o.view(torch.uint8), e.view(torch.uint8)) for o, e in zip(outs, expected))
    for o in outs[:len(expected)]:
        o.view(torch.uint8).numpy().fill(0xA5)
    return wrong


def store_host(b: Bench, size: str, rep: int) -> None:
    data = b.data[size]
    n, nb = len(data), data[0].numel() * 2
    ns = namespace(size, f"{b.run_id}-host-{rep}")
    keys = keys_of(ns, n, seed=rep)
    store = make_store(b, size, f"{b.run_id}-host-{rep}", host_blocks=n)
    try:
        sw = Stopwatch()
        for ks, ps in batches(b, size, keys):
            store.save(ks, ps)
        b.fig.add(size, "store.host_save", sw.lap(), n * nb, n,
                  batch=SIZES[size]["batch"])
        outs = out_tensors(b, size)
        failed, wrong, seconds = 0, 0, (0.0, 0.0)
        for lo in range(0, n, len(outs)):
            ks = keys[lo:lo + len(outs)]
            seconds, failed = timed_load(store, ks, outs, seconds, failed)
            wrong += differing(outs, data[lo:lo + len(ks)])  # every batch, outside the timing
        b.fig.add(size, "store.host_load", seconds, n * nb, n,
                  batch=len(outs))
        if failed or wrong:
            b.fig.fail(size, "store.host_load", f"{failed} blocks not loaded, {wrong} differ")
    finally:
        store.close()


def store_lmdb(b: Bench, size: str, rep: int) -> None:
    data = b.data[size]
    n, nb = len(data), data[0].numel() * 2
    tag = f"{b.run_id}-lmdb-{rep}"
    ns = namespace(size, tag)
    keys = keys_of(ns, n, seed=100 + rep)
    d = b.tmpdir("lmdb")
    try:
        store = make_store(b, size, tag, host_blocks=n, disk=d)
        try:
            sw = Stopwatch()
            for ks, ps in batches(b, size, keys):
                store.save(ks, ps)
            visible = sw.lap()
            if not store.pool.drain(timeout=600):
                raise RuntimeError("write-behind timed out")
            seconds = sw.lap()  # every block committed to LMDB: loadable by any process
            if not store.flush(timeout=600):
                raise RuntimeError("flush timed out")
            durable = sw.lap()  # ... and fsync'd
            snap = store.stats()
        finally:
            store.close()
        t = snap["tiers"].get("disk", {})
        stored_in, blocks_in = t.get("stored_bytes_in", 0), t.get("blocks_in", 0)
        dropped = dict(snap.get("events", {}))
        b.fig.add(size, "store.save_visible", visible, n * nb, n,
                  what="until every store.save() returned (LMDB write-behind queued)")
        b.fig.add(size, "store.lmdb_write_behind", seconds, n * nb, n,
                  what="first save() until every block was committed to LMDB (encode + puts)")
        b.fig.add(size, "store.lmdb_durable_save", durable, n * nb, n,
                  what="first save() until flush() returned (encode + LMDB puts + fsync)")
        b.store_info.setdefault(size, {}).update({
            "lmdb_blocks_written": blocks_in, "lmdb_events": dropped,
            "lmdb_stored_ratio": round(n * nb / stored_in, 4) if stored_in else None,
            "lmdb_dir_bytes": sum(os.path.getsize(p) for p in files_under(d)),
        })
        if blocks_in != n:
            b.fig.fail(size, "store.lmdb_write_behind", f"only {blocks_in} of {n} blocks reached LMDB "
                       f"(events {dropped})")

        def make() -> TieredStore:
            return make_store(b, size, tag, host_blocks=2 * SIZES[size]["batch"], disk=d)

        restore(b, size, "store.lmdb_restore_warm", "disk", keys, make)

        def evict() -> None:
            files = files_under(d)
            if not files:
                raise RuntimeError(f"the LMDB tier left no files under {d} to evict")
            b.evictor.evict(files)
            fraction = resident_fraction(files)
            b.residency.setdefault(f"{size}.lmdb_restore_cold", []).append(fraction)
            if not_cold(fraction):
                b.fig.fail(size, "store.lmdb_restore_cold", not_cold(fraction))

        restore(b, size, "store.lmdb_restore_cold", "disk", keys, make, before=evict)
    finally:
        shutil.rmtree(d, ignore_errors=True)


def store_redis(b: Bench, size: str, rep: int) -> None:
    data = b.data[size]
    n, nb = len(data), data[0].numel() * 2
    tag = f"{b.run_id}-redis-{rep}"
    ns = namespace(size, tag)
    keys = keys_of(ns, n, seed=200 + rep)
    store = make_store(b, size, tag, host_blocks=n, remote=b.redis_url)
    try:
        try:
            sw = Stopwatch()
            for ks, ps in batches(b, size, keys):
                store.save(ks, ps)
            if not store.flush(timeout=600):
                raise RuntimeError("flush timed out")
            seconds = sw.lap()
            snap = store.stats()
        finally:
            store.close()
        blocks_in = snap["tiers"].get("remote", {}).get("blocks_in", 0)
        b.fig.add(size, "store.redis_write_behind", seconds, n * nb, n,
                  what="first save() until flush() returned (encode + Redis puts)")
        b.store_info.setdefault(size, {}).update({"redis_blocks_written": blocks_in,
                                                  "redis_events": dict(snap.get("events", {}))})
        if blocks_in != n:
            b.fig.fail(size, "store.redis_write_behind",
                       f"only {blocks_in} of {n} blocks reached Redis")

        def make() -> TieredStore:
            return make_store(b, size, tag, host_blocks=2 * SIZES[size]["batch"],
                              remote=b.redis_url)

        restore(b, size, "store.redis_restore", "remote", keys, make)

        def replica() -> TieredStore:  # another replica: the same Redis, its own empty disk tier
            return make_store(b, size, tag, host_blocks=2 * SIZES[size]["batch"], disk=b.tmpdir("replica"),
                              remote=b.redis_url)

        # the blocks are copied up into that disk as write-behind: the restore does not wait for it
        restore(b, size, "store.redis_restore_disk_above", "remote", keys, replica)
    finally:
        drop_redis_namespace(b, ns)


def drop_redis_namespace(b: Bench, ns: Namespace) -> None:
    """Free the server's memory: FLUSHALL on our own server, else delete this namespace's keys."""
    import redis

    client = redis.Redis.from_url(b.redis_url, socket_timeout=30)
    try:
        if b.redis is not None:
            client.flushall()
            return
        digest = ns.digest()
        batch = []
        for k in client.scan_iter(count=1000):
            if digest in k:
                batch.append(k)
                if len(batch) >= 500:
                    client.delete(*batch)
                    batch = []
        if batch:
            client.delete(*batch)
    finally:
        client.close()
