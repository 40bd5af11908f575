"""Section ``corruption``: byte flips and lying headers in LMDB, Redis and file:// tiers,
loaded back through the store (prepare_load/load/release and load_into) and through the
connector worker (start_load_kv into an engine's KV pool). Every outcome is classified per
block: served intact, served wrong, a counted miss, or lost to an exception."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import torch

from soak.common import (
    NS,
    SHAPE,
    Expected,
    error_text,
    host_slots_held,
    key_of,
    open_store,
    payload_tensor,
    pct,
    store_config,
)
from soak.damage import LIES, flip, self_consistent

BATCH = 8  # keys per load call (damaged and clean mixed)
PATHS = ("plan", "load_into", "worker")
POOL_BLOCKS = 64  # device blocks of the worker path's KV pool


def tier_configs(work: Path, redis_url: str | None) -> dict[str, dict]:
    """One store config per medium: LMDB and file:// as the disk tier, Redis as the remote."""
    # one medium with compressed bodies (flips inside zstd frames), one with the default (auto)
    out = {"lmdb": store_config(disk_url=f"lmdb://{work}/lmdb", disk={"codec": "zstd+shuffle"}),
           "file": store_config(disk_url=f"file://{work}/files")}
    if redis_url:
        out["redis"] = store_config(remote_url=redis_url)
    return out


def _tier_of(store):
    return store.tiers[0]


class Outcomes:
    """Per-block outcomes of one tier, and the exceptions that reached the caller."""

    def __init__(self) -> None:
        self.by_key: dict[bytes, str] = {}  # served_ok | served_wrong | miss | raised
        self.path_of: dict[bytes, str] = {}
        self.exceptions: Counter = Counter()
        self.miss_reasons: Counter = Counter()  # plan path: the reason a miss carries (None: uncounted)

    def raised(self, where: str, exc: BaseException) -> None:
        self.exceptions[f"{where}: {error_text(exc)}"] += 1


def load_plan(store, keys: list[bytes], expected: Expected, out: Outcomes) -> None:
    """prepare_load -> load -> wait, compare leased host slots, release."""
    plan = None
    try:
        plan = store.prepare_load(keys)
        store.load(plan)
        plan.wait(timeout=30)
        for key, slot, reason in zip(keys, plan.slots, plan.reasons):
            if slot is None:
                out.by_key[key] = "miss"
                out.miss_reasons[str(reason)] += 1
                continue
            view = store.host.slot_view(slot, store.block_nbytes).numpy()
            out.by_key[key] = "served_ok" if expected.matches(key, view) else "served_wrong"
    except Exception as exc:
        out.raised("prepare_load/load/wait", exc)
    finally:
        if plan is not None:
            try:
                store.release(plan)
            except Exception as exc:
                out.raised("release", exc)


def load_into(store, keys: list[bytes], expected: Expected, out: Outcomes) -> None:
    outs = [torch.zeros(SHAPE, dtype=torch.bfloat16) for _ in keys]
    try:
        ok = store.load_into(keys, outs)
    except Exception as exc:
        out.raised("load_into", exc)
        return
    for key, good, tensor in zip(keys, ok, outs):
        if not good:
            out.by_key[key] = "miss"
        else:
            data = tensor.view(torch.uint8).numpy()
            out.by_key[key] = "served_ok" if expected.matches(key, data) else "served_wrong"


class WorkerPath:
    """The connector's worker half over the same store, scattering into a block-major KV pool."""

    def __init__(self, store) -> None:
        from tiered_kv.connector import TieredKVConnector

        self.conn = TieredKVConnector(store)
        self.pool = torch.zeros((POOL_BLOCKS, *SHAPE), dtype=torch.bfloat16)
        self.conn.register_kv_caches(self.pool)
        self.requests = 0

    def load(self, keys: list[bytes], expected: Expected, out: Outcomes) -> None:
        from tiered_kv.connector.meta import ConnectorMeta, LoadSpec

        self.requests += 1
        block_ids = list(range(len(keys)))
        self.pool.zero_()
        spec = LoadSpec(f"soak-{self.requests}", tuple(keys), tuple(block_ids), False)
        try:
            self.conn.bind_connector_meta(ConnectorMeta(loads=[spec]))
            self.conn.start_load_kv()
            failed = self.conn.get_block_ids_with_load_errors()
        except Exception as exc:
            out.raised("worker start_load_kv", exc)
            return
        for key, block in zip(keys, block_ids):
            if block in failed:
                out.by_key[key] = "miss"
            else:
                data = self.pool[block].view(torch.uint8).numpy()
                out.by_key[key] = "served_ok" if expected.matches(key, data) else "served_wrong"


def write_blocks(cfg: dict, keys: list[bytes]) -> set[bytes]:
    """Save ``keys`` through a store, flushing after each batch (so write-behind never runs out
    of host slots); the keys the lower tier then holds."""
    with open_store(cfg) as store:
        for start in range(0, len(keys), 32):
            part = keys[start : start + 32]
            store.save(part, [payload_tensor(k) for k in part])
            store.flush(timeout=60)
        return {k for k, there in zip(keys, _tier_of(store).contains(keys)) if there}


def damage(cfg: dict, flips: list[bytes], lies: list[bytes], rng: random.Random) -> dict:
    """Rewrite blocks behind the store's back (through a bare backend of the same medium)."""
    from storage_backends.registry import open_backend

    section = cfg.get("disk") or cfg["remote"]
    backend = open_backend(section["url"], **({"capacity": section["capacity"]} if "capacity" in section else {}))
    made: dict = {"flip_regions": Counter(), "lie_kinds": Counter(), "not_self_consistent": 0, "missing": 0,
                  "damaged": set(), "kind_of": {}}
    try:
        todo = [(k, "flip") for k in flips] + [(k, "lie") for k in lies]
        kinds = list(LIES)
        for n, (key, what) in enumerate(todo):
            (blob,) = backend.get_many([NS.digest() + key])
            if blob is None:
                made["missing"] += 1
                continue
            if what == "flip":
                new, region = flip(bytes(blob), rng)
                made["flip_regions"][region] += 1
            else:
                kind = kinds[n % len(kinds)]
                new = LIES[kind](key, bytes(blob))
                made["lie_kinds"][kind] += 1
                made["kind_of"][key] = kind
                made["not_self_consistent"] += not self_consistent(new)
            if backend.put_many([(NS.digest() + key, new)]) == [True]:
                made["damaged"].add(key)
    finally:
        backend.close()
    return made


def load_all(cfg: dict, keys: list[bytes], rng: random.Random, out: Outcomes) -> dict:
    """Reopen (empty host tier) and load every key, batches alternating between the paths."""
    expected = Expected()
    order = list(keys)
    rng.shuffle(order)
    figures: dict = {}
    store = open_store(cfg)
    try:
        worker = WorkerPath(store)
        for b, start in enumerate(range(0, len(order), BATCH)):
            batch = order[start : start + BATCH]
            path = PATHS[b % len(PATHS)]
            for k in batch:
                out.path_of[k] = path
            if path == "plan":
                load_plan(store, batch, expected, out)
            elif path == "load_into":
                load_into(store, batch, expected, out)
            else:
                worker.load(batch, expected, out)
        held = host_slots_held(store)
        figures["host_slots_leaked"] = held["leased"] + held["reserved"]
        figures["host_slots_held"] = held
        figures["counted_misses"] = {
            reason: n for reason, n in store.metrics.snapshot()["tiers"].get(_tier_of(store).name, {})
            .get("misses", {}).items() if n}
    finally:
        try:
            store.close()
        except Exception as exc:
            out.raised("close", exc)
    return figures


def run_tier(name: str, cfg: dict, flips: int, lies: int, rng: random.Random) -> dict:
    """Write, damage, reload one medium; per-tier figures."""
    clean = max(8, (flips + lies) // 4)
    keys = [key_of(i, f"corruption-{name}") for i in range(flips + lies + clean)]
    flipped, lying = keys[:flips], keys[flips : flips + lies]
    stored = write_blocks(cfg, keys)
    made = damage(cfg, flipped, lying, rng)
    out = Outcomes()
    figures = load_all(cfg, keys, rng, out)
    return _tier_figures(name, keys, flipped, lying, stored, made, out, figures)


def _tier_figures(name, keys, flipped, lying, stored, made, out: Outcomes, figures: dict) -> dict:
    damaged = made["damaged"]  # damaged and written back (a block missing before damage is not)
    outcome = {k: out.by_key.get(k, "raised") for k in keys}
    per_kind: dict = {}
    for key, kind in made["kind_of"].items():
        per_kind.setdefault(kind, Counter())[outcome[key]] += 1
    by_path: dict = {}
    for key in damaged:
        by_path.setdefault(out.path_of.get(key, "?"), Counter())[outcome[key]] += 1
    damaged_outcomes = Counter(outcome[k] for k in damaged)
    clean_outcomes = Counter(outcome[k] for k in keys if k not in damaged and k in stored)
    return {
        "tier": name, "blocks": len(keys), "stored": len(stored), "flips": len(flipped), "lies": len(lying),
        "damaged": len(damaged),
        "flip_regions": dict(made["flip_regions"]), "lies_not_self_consistent": made["not_self_consistent"],
        "damaged_missing": made["missing"],
        "detected": damaged_outcomes["miss"], "damaged_served_ok": damaged_outcomes["served_ok"],
        "damaged_lost_to_exception": damaged_outcomes["raised"],
        "wrong_served": damaged_outcomes["served_wrong"] + clean_outcomes["served_wrong"],
        "clean_served": clean_outcomes["served_ok"], "clean_missed": clean_outcomes["miss"],
        "clean_lost_to_exception": clean_outcomes["raised"],
        "exceptions": sum(out.exceptions.values()), "exception_kinds": dict(out.exceptions.most_common(8)),
        "plan_miss_reasons": dict(out.miss_reasons),
        "lies_by_kind": {k: dict(v) for k, v in per_kind.items()},
        "damaged_by_path": {k: dict(v) for k, v in by_path.items()},
        **figures,
    }


def run(work: Path, redis_url: str | None, flips: int, lies: int, seed: int) -> dict:
    """Spread ``flips`` and ``lies`` over the media; totals plus per-tier figures."""
    rng = random.Random(seed)
    configs = tier_configs(work, redis_url)
    names = list(configs)
    tiers = {}
    for i, name in enumerate(names):
        share_f = flips // len(names) + (i < flips % len(names))
        share_l = lies // len(names) + (i < lies % len(names))
        try:
            tiers[name] = run_tier(name, configs[name], share_f, share_l, rng)
        except Exception as exc:  # the soak's own failure for this medium, reported
            tiers[name] = {"error": error_text(exc)}
    return _totals(tiers, flips, lies)


def _totals(tiers: dict, flips: int, lies: int) -> dict:
    good = [t for t in tiers.values() if "error" not in t]
    damaged = sum(t["damaged"] for t in good)
    total = {name: sum(t[name] for t in good) for name in (
        "detected", "wrong_served", "exceptions", "host_slots_leaked", "damaged_served_ok",
        "damaged_lost_to_exception", "clean_missed", "clean_lost_to_exception")}
    exception_kinds: Counter = Counter()
    for t in good:
        exception_kinds.update(t["exception_kinds"])
    total["exceptions"] += len(tiers) - len(good)  # a medium whose run broke off counts as one
    counted = sum(n for t in good for reason, n in t["counted_misses"].items() if reason != "absent")
    return {
        "flips": flips, "lies": lies, "damaged_loaded": damaged,
        "detected_pct": pct(total["detected"], damaged), **total, "counted_misses": counted,
        "plan_misses_without_reason": sum(t["plan_miss_reasons"].get("None", 0) for t in good),
        "exception_kinds": dict(exception_kinds.most_common(8)),
        "tiers": tiers, "tier_errors": [n for n, t in tiers.items() if "error" in t],
    }
