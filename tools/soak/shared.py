"""Section ``shared``: (a) two processes on one LMDB directory, each writing its own blocks,
acknowledging what each flush made durable, and reading the other's acknowledged blocks back;
(b) two reference-engine processes on one Redis serving shared and own prompts over several
rounds (fresh connectors, so hits come from Redis, often from the other engine's saves)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from soak.common import (
    Ack,
    Expected,
    child_setup,
    context,
    error_text,
    join_or_kill,
    key_of,
    keys_in,
    load_checked,
    open_store,
    payload_tensor,
    store_config,
)

BLOCKS_PER_ROUND = 8
CHILD_TIMEOUT_S = 180.0


# -- (a) two processes, one LMDB directory ---------------------------------------------------------
def _lmdb_config(lmdb_dir: Path) -> dict:
    return store_config(host="512KiB", disk_url=f"lmdb://{lmdb_dir}")


def lmdb_child(spec: dict) -> None:
    """Write own blocks round by round, acknowledge durable ones, read the other's back while
    both write; at the end (once the other is done) read every block it acknowledged."""
    child_setup()
    me, other = Ack(spec["ack"]), Ack(spec["other_ack"])
    expected, checked = Expected(), set()
    counts = {"read": 0, "wrong": 0, "missed": 0, "errors": 0}

    def read_theirs(store, limit: int) -> None:
        theirs = [k for k in keys_in(other.lines(), "durable") if k not in checked][:limit]
        got = load_checked(store, theirs, expected)
        checked.update(theirs)
        for name, n in (("read", len(theirs)), ("wrong", len(got["wrong"])),
                        ("missed", len(got["missed"])), ("errors", len(got["errors"]))):
            counts[name] += n

    with open_store(_lmdb_config(Path(spec["dir"]))) as store:
        me.write("ready")
        counts["other_ready"] = other.wait_for("ready", 60)
        for r in range(spec["rounds"]):
            keys = [key_of(r * BLOCKS_PER_ROUND + j, f"shared-{spec['name']}") for j in range(BLOCKS_PER_ROUND)]
            store.save(keys, [payload_tensor(k) for k in keys])
            store.flush(timeout=30)
            me.write("durable", *(k.hex() for k, p in zip(keys, store.tier("disk").contains(keys)) if p))
            read_theirs(store, 64)
        me.write("done")
        counts["other_done"] = other.wait_for("done", 120)
        read_theirs(store, 1 << 20)
    me.write("result", json.dumps(counts, separators=(",", ":")))


def run_lmdb(workdir: Path, rounds: int) -> dict:
    lmdb_dir = workdir / "lmdb"
    acks = {n: Ack(workdir / f"lmdb-{n}.log") for n in ("a", "b")}
    procs = {}
    for name, other in (("a", "b"), ("b", "a")):
        spec = {"name": name, "dir": str(lmdb_dir), "ack": str(acks[name].path),
                "other_ack": str(acks[other].path), "rounds": rounds}
        procs[name] = context().Process(target=lmdb_child, args=(spec,), daemon=True)
        procs[name].start()
    finished = all([join_or_kill(p, CHILD_TIMEOUT_S) for p in procs.values()])
    results, durable = {}, []
    for name, ack in acks.items():
        lines = ack.lines()
        durable += keys_in(lines, "durable")
        found = [line for line in lines if line and line[0] == "result"]
        results[name] = json.loads(found[-1][1]) if found else {"error": "no result"}
    with open_store(_lmdb_config(lmdb_dir)) as store:
        got = load_checked(store, durable, Expected())
    right = set(got["served"]) - set(got["wrong"])
    cross_wrong = sum(r.get("wrong", 0) for r in results.values())
    cross_missed = sum(r.get("missed", 0) for r in results.values())
    return {
        "children_finished": finished, "durable": len(durable),
        "cross_read": sum(r.get("read", 0) for r in results.values()), "cross_wrong": cross_wrong,
        "overlapped": all(r.get("other_ready") and r.get("other_done") for r in results.values()),
        "cross_missed": cross_missed, "cross_errors": sum(r.get("errors", 0) for r in results.values()),
        "final_wrong": len(got["wrong"]), "committed_lost": sum(1 for k in durable if k not in right),
        "inconsistent": cross_wrong + cross_missed + len(got["wrong"]), "children": results,
    }


# -- (b) two engines, one Redis --------------------------------------------------------------------
def engine_child(spec: dict) -> None:
    """Serve shared + own prompts ``rounds`` times, each on a fresh connector; compare with an
    engine without connector; report which block keys the remote tier holds at the end."""
    child_setup()
    from soak.engines import connector_config, prompts, serve
    from tiered_kv.keys import block_keys

    batch = prompts(spec["seed"]) + prompts(spec["seed"] + 1 + spec["index"], n=2)
    out: dict = {"rounds": [], "errors": []}
    reference = serve(None, batch)
    out["errors"] += reference["errors"]
    cfg = connector_config(spec["redis_url"])
    for _ in range(spec["rounds"]):
        res = serve(cfg, batch)
        out["errors"] += res["errors"]
        out["rounds"].append({"identical": res.get("outputs") == reference.get("outputs"),
                              "external_tokens": res.get("external_tokens", 0),
                              "remote_hits": res.get("remote_hits", 0), "seconds": res["seconds"]})
    out["reference"] = reference.get("outputs")
    try:
        from soak.engines import connector

        conn = connector(cfg)
        try:
            keys = [k for p, o in zip(batch, reference.get("outputs") or [[]] * len(batch))
                    for k in block_keys(conn.store.namespace, p + o[:-1])]
            present = conn.store.tier("remote").contains(keys)
            out["present"] = [k.hex() for k, p in zip(keys, present) if p]
            out["namespace"] = conn.store.namespace.digest().hex()
        finally:
            conn.close()
    except Exception as exc:
        out["errors"].append(f"present: {error_text(exc)}")
    Path(spec["out"]).write_text(json.dumps(out))


def check_remote(redis_url: str, namespace_hex: str, keys: list[bytes]) -> dict:
    """Read the blocks the engines reported stored: present and decoding under their keys?"""
    from storage_backends.registry import open_backend
    from tiered_kv.errors import CorruptBlock
    from tiered_kv.store.codec import BlockCodec

    digest = bytes.fromhex(namespace_hex)
    backend = open_backend(redis_url, timeout=2.0, retries=1)
    missing = corrupt = 0
    try:
        for start in range(0, len(keys), 64):
            part = keys[start : start + 64]
            for key, blob in zip(part, backend.get_many([digest + k for k in part])):
                if blob is None:
                    missing += 1
                    continue
                try:
                    BlockCodec().decode(blob, namespace=digest, key=key)
                except CorruptBlock:
                    corrupt += 1
    finally:
        backend.close()
    return {"checked": len(keys), "missing": missing, "corrupt": corrupt}


def run_engines(workdir: Path, redis_url: str, rounds: int, seed: int) -> dict:
    outs = [workdir / f"engine-{i}.json" for i in range(2)]
    procs = []
    for i in range(2):
        spec = {"index": i, "redis_url": redis_url, "rounds": rounds, "seed": seed, "out": str(outs[i])}
        procs.append(context().Process(target=engine_child, args=(spec,), daemon=True))
        procs[-1].start()
    finished = all([join_or_kill(p, CHILD_TIMEOUT_S) for p in procs])
    results = [json.loads(o.read_text()) if o.exists() else {"errors": ["no result"], "rounds": []} for o in outs]
    present = sorted({bytes.fromhex(h) for r in results for h in r.get("present", [])})
    namespaces = {r.get("namespace") for r in results if r.get("namespace")}
    check = check_remote(redis_url, namespaces.pop(), present) if len(namespaces) == 1 else \
        {"checked": 0, "missing": 0, "corrupt": 0, "error": f"namespaces reported: {len(namespaces)}"}
    differing = sum(1 for r in results for rd in r["rounds"] if not rd["identical"])
    shared_ref_differs = int(results[0].get("reference", [])[:4] != results[1].get("reference", [])[:4])
    return {
        "children_finished": finished, "rounds_differing": differing,
        "shared_prompt_references_differ": shared_ref_differs,
        "engine_errors": sum(len(r["errors"]) for r in results),
        "external_tokens": [sum(rd["external_tokens"] for rd in r["rounds"]) for r in results],
        "remote_hits": [sum(rd["remote_hits"] for rd in r["rounds"]) for r in results],
        "blocks_reported_stored": len(present), "remote_check": check,
        "committed_lost": check["missing"] + check["corrupt"],
        "inconsistent": differing + shared_ref_differs,
        "errors": [e for r in results for e in r["errors"]][:5],
    }


def run(workdir: Path, redis_url: str | None, lmdb_rounds: int, engine_rounds: int, seed: int) -> dict:
    t0 = time.monotonic()
    lmdb = run_lmdb(workdir / "lmdb-pair", lmdb_rounds)
    lmdb["seconds"] = round(time.monotonic() - t0, 2)
    out = {"lmdb": lmdb}
    if redis_url:
        t0 = time.monotonic()
        out["redis_engines"] = run_engines(workdir, redis_url, engine_rounds, seed)
        out["redis_engines"]["seconds"] = round(time.monotonic() - t0, 2)
    parts = list(out.values())
    return {"inconsistent": sum(p["inconsistent"] for p in parts),
            "committed_lost": sum(p["committed_lost"] for p in parts), **out}
