"""Section ``disk_full``: write-behind into LMDB while the filesystem "fills" (RLIMIT_FSIZE in a
child: writes past the limit fail with EFBIG). The child records which blocks each flush
committed; the parent then reopens the store without the limit and loads every block."""

from __future__ import annotations

import json
import resource
import signal
import time
from pathlib import Path

from soak.common import (
    Expected,
    child_setup,
    context,
    error_text,
    join_or_kill,
    key_of,
    load_checked,
    open_store,
    payload_tensor,
    store_config,
)

ROUND = 20  # blocks per save call


def _config(lmdb_dir: Path, codec: str) -> dict:
    return store_config(host="32MiB", disk_url=f"lmdb://{lmdb_dir}", disk={"codec": codec, "capacity": "256MiB"})


def full_child(spec: dict) -> None:
    """Under the file-size limit: save rounds, flush, record committed keys; one JSON file out."""
    child_setup()
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    result: dict = {"save_calls": 0, "save_exceptions": [], "flush_exceptions": [], "save_ms": [],
                    "committed": []}
    limit = spec["limit"]
    out_path = Path(spec["out"])
    out_fd = open(out_path, "w")  # opened before the limit: the report itself must fit
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    store = open_store(_config(Path(spec["dir"]), spec["codec"]))
    keys = [key_of(i, f"disk-full-{spec['codec']}") for i in range(spec["blocks"])]
    pending: list[bytes] = []
    for start in range(0, len(keys), ROUND):
        part = keys[start : start + ROUND]
        _save(store, part, result)
        pending += part
        try:
            store.flush(timeout=30)
        except Exception as exc:
            result["flush_exceptions"].append(error_text(exc))
        present = store.tier("disk").contains(pending)
        result["committed"] += [k.hex() for k, p in zip(pending, present) if p]
        pending = [k for k, p in zip(pending, present) if not p]
    snap = store.stats()
    result["events"] = snap["events"]
    result["disk_blocks_in"] = snap["tiers"].get("disk", {}).get("blocks_in", 0)
    try:
        store.close()
    except Exception as exc:
        result["close_exception"] = error_text(exc)
    out_fd.write(json.dumps(result))
    out_fd.close()


def _save(store, keys: list[bytes], result: dict) -> None:
    result["save_calls"] += 1
    t0 = time.perf_counter()
    try:
        store.save(keys, [payload_tensor(k) for k in keys])
    except Exception as exc:  # saves must keep returning
        result["save_exceptions"].append(error_text(exc))
    result["save_ms"].append((time.perf_counter() - t0) * 1000)


def run_one(workdir: Path, codec: str, blocks: int, limit: int) -> dict:
    """One child under the limit, then the reload; figures for this codec."""
    lmdb_dir = workdir / f"lmdb-{codec.replace('+', '-')}"
    out = workdir / f"disk-full-{codec.replace('+', '-')}.json"
    spec = {"dir": str(lmdb_dir), "out": str(out), "codec": codec, "blocks": blocks, "limit": limit}
    proc = context().Process(target=full_child, args=(spec,), daemon=True)
    proc.start()
    finished = join_or_kill(proc, 120)
    child = json.loads(out.read_text()) if out.exists() and out.stat().st_size else {}
    committed = [bytes.fromhex(h) for h in child.get("committed", [])]
    keys = [key_of(i, f"disk-full-{codec}") for i in range(blocks)]
    with open_store(_config(lmdb_dir, codec)) as store:
        got = load_checked(store, keys, Expected())
    served_right = set(got["served"]) - set(got["wrong"])
    events = child.get("events", {})
    save_ms = sorted(child.get("save_ms", [0.0]))
    return {
        "codec": codec, "blocks": blocks, "fsize_limit_bytes": limit, "child_finished": finished,
        "child_exitcode": proc.exitcode, "save_calls": child.get("save_calls", 0),
        "save_exceptions": len(child.get("save_exceptions", [])),
        "flush_exceptions": len(child.get("flush_exceptions", [])),
        "save_ms_max": round(save_ms[-1], 1), "save_failures_counted": events.get("disk_save_failed", 0),
        "save_rejected_counted": events.get("disk_save_rejected", 0),
        "committed": len(committed), "committed_lost": sum(1 for k in committed if k not in served_right),
        "wrong_served": len(got["wrong"]), "served_after_restart": len(got["served"]),
        "load_errors": len(got["errors"]),
        "exceptions_seen": (child.get("save_exceptions", []) + child.get("flush_exceptions", []))[:3],
    }


def run(workdir: Path, blocks: int, limit: int, codecs: tuple[str, ...]) -> dict:
    runs = [run_one(workdir, codec, blocks, limit) for codec in codecs]
    total = {k: sum(r[k] for r in runs) for k in (
        "committed", "committed_lost", "save_failures_counted", "save_exceptions", "flush_exceptions",
        "wrong_served", "save_calls")}
    return {**total, "children_finished": all(r["child_finished"] for r in runs), "runs": runs}
