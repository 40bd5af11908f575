"""Section ``sigkill``: a child writes blocks through a TieredStore (LMDB disk tier,
write-behind, periodic ``flush()``), acknowledging after each flush the keys it now holds
durable, and reading earlier children's blocks back; it is SIGKILLed at a random moment. After
each kill the parent reopens the same LMDB directory (damage may accumulate across kills):
the CLI's ``verify`` decodes every stored block (read-only), then a fresh TieredStore loads every
stored block and compares it with what was written."""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

from soak.common import (
    NS,
    Ack,
    Expected,
    child_setup,
    context,
    error_text,
    key_of,
    keys_in,
    load_checked,
    open_store,
    payload_tensor,
    pct,
    store_config,
    stored_block_keys,
)

BLOCKS_PER_ROUND = 8
ROUNDS = 48  # per child at most (then it idles until killed)
FLUSH_EVERY = 2  # rounds between flushes
READ_BACK = 8  # earlier durable blocks a child reads back per flush
CHILD_LIFE_S = 30.0  # a child that is never killed exits on its own
KEY_RANGE = 1_000_000  # child k writes keys k*KEY_RANGE ...


def _config(lmdb_dir: Path) -> dict:
    return store_config(host="512KiB", disk_url=f"lmdb://{lmdb_dir}")


def writer_child(spec: dict) -> None:
    """Save rounds of blocks, flush every FLUSH_EVERY rounds and acknowledge what is durable;
    read earlier children's durable blocks back and report any that differ ("torn")."""
    child_setup()
    ack = Ack(spec["ack"])
    expected = Expected()
    store = open_store(_config(Path(spec["dir"])))
    ack.write("ready")
    t0 = time.monotonic()
    earlier = [bytes.fromhex(h) for h in spec["read_back"]]
    pending: list[bytes] = []
    for r in range(ROUNDS):
        keys = [key_of(spec["first"] + r * BLOCKS_PER_ROUND + j, "sigkill") for j in range(BLOCKS_PER_ROUND)]
        store.save(keys, [payload_tensor(k) for k in keys])
        pending += keys
        if r % FLUSH_EVERY == FLUSH_EVERY - 1:
            store.flush(timeout=20)
            present = store.tier("disk").contains(pending)
            ack.write("durable", *(k.hex() for k, p in zip(pending, present) if p))
            pending = [k for k, p in zip(pending, present) if not p]
            _read_back(store, earlier[:READ_BACK], expected, ack)
            earlier = earlier[READ_BACK:]
    ack.write("done", f"{time.monotonic() - t0:.3f}")
    time.sleep(CHILD_LIFE_S)  # wait to be killed; bounded
    os._exit(0)


def _read_back(store, keys: list[bytes], expected: Expected, ack: Ack) -> None:
    if not keys:
        return
    got = load_checked(store, keys, expected)
    ack.write("read", str(len(got["served"])), str(len(got["missed"])))
    if got["wrong"]:
        ack.write("torn", *(k.hex() for k in got["wrong"]))
    if got["errors"]:
        ack.write("error", str(len(got["errors"])))


def reopen_check(lmdb_dir: Path, durable: set[bytes], expected: Expected) -> dict:
    """Reopen the store after a kill: CLI verify of every stored block (read-only), then load
    every stored block through a fresh TieredStore and compare bytes."""
    from tiered_kv.admin.opening import open_tier
    from tiered_kv.admin.verify import verify_tier

    out: dict = {"ok": False}
    try:
        tier = open_tier(f"lmdb://{lmdb_dir}")
        try:
            report = verify_tier(tier)
        finally:
            tier.close()
        out["verify_problems"] = sum(report["problems"].values())
        out["verify_kinds"] = {k: n for k, n in report["problems"].items() if n}
        out["verify_checked"] = report["checked"]
        with open_store(_config(lmdb_dir)) as store:
            stored = stored_block_keys(store.tier("disk").backend)
            got = load_checked(store, stored, expected)
            lost = [k for k in durable if k not in set(got["served"]) - set(got["wrong"])]
            out.update(stored=len(stored), torn_served=len(got["wrong"]), load_errors=len(got["errors"]),
                       stored_not_served=len(got["missed"]), durable_lost=len(lost), lost=lost)
        out["ok"] = True
    except Exception as exc:  # a store that does not reopen is the finding
        out["error"] = error_text(exc)
    return out


def _prune(lmdb_dir: Path, keep: set[bytes]) -> int:
    """Delete every stored block outside ``keep`` (through the medium's own API) so the store
    stays small: every check reads all of it. Returns how many were deleted."""
    from storage_backends.registry import open_backend

    backend = open_backend(f"lmdb://{lmdb_dir}", capacity="1GiB")
    try:
        doomed = [k for k in stored_block_keys(backend) if k not in keep]
        return backend.delete_many([NS.digest() + k for k in doomed]) if doomed else 0
    finally:
        backend.close()


def run(workdir: Path, kills: int, window_s: float, budget_s: float, seed: int, keep: int) -> dict:
    """SIGKILL ``kills`` writer children at random moments; figures over all reopens."""
    rng = random.Random(seed)
    ctx = context()
    lmdb_dir = workdir / "lmdb"
    expected = Expected()
    durable: list[bytes] = []  # acknowledged durable and not pruned, oldest first
    figures = {"kills": 0, "killed_mid_write": 0, "child_start_failures": 0, "reopens": 0, "reopen_ok": 0,
               "torn_served": 0, "durable_lost": 0, "durable_acknowledged": 0, "verify_problems": 0,
               "load_errors": 0, "stored_not_served": 0, "read_back": 0, "pruned": 0,
               "max_stored_blocks": 0, "verify_kinds": {}, "errors": []}
    durations: list[float] = []
    deadline = time.monotonic() + budget_s
    for k in range(kills):
        if time.monotonic() > deadline:
            figures["stopped_by_budget"] = True
            break
        # kill within the time a child needs for its writes (measured on children that finished)
        window = 1.1 * max(durations[-5:]) if durations else window_s
        durations += _one_kill(ctx, k, rng, lmdb_dir, workdir, durable, window, figures)
        check = reopen_check(lmdb_dir, set(durable), expected)
        _count_check(check, figures)
        if check.get("lost"):
            lost = set(check["lost"])
            durable[:] = [d for d in durable if d not in lost]  # count each loss once
        if check.get("stored", 0) > keep:
            del durable[: max(0, len(durable) - keep // 2)]
            figures["pruned"] += _prune(lmdb_dir, set(durable))
    figures["reopen_ok_pct"] = pct(figures["reopen_ok"], figures["reopens"])
    figures["errors"] = figures["errors"][:10]
    return figures


def _one_kill(ctx, k: int, rng: random.Random, lmdb_dir: Path, workdir: Path, durable: list[bytes],
              window_s: float, figures: dict) -> list[float]:
    """Start a writer child, SIGKILL it after a random part of ``window_s``, collect its
    acknowledgements. Returns the child's write duration when it finished before the kill."""
    ack = Ack(workdir / f"ack-{k}.log")
    read_back = rng.sample(durable, min(len(durable), READ_BACK * ROUNDS // FLUSH_EVERY))
    spec = {"dir": str(lmdb_dir), "ack": str(ack.path), "first": k * KEY_RANGE,
            "read_back": [x.hex() for x in read_back]}
    proc = ctx.Process(target=writer_child, args=(spec,), daemon=True)
    proc.start()
    try:
        if not ack.wait_for("ready", 60):
            figures["child_start_failures"] += 1
        time.sleep(rng.uniform(0.0, window_s))
    finally:
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
    figures["kills"] += 1
    lines = ack.lines()
    done = [float(line[1]) for line in lines if line and line[0] == "done" and len(line) > 1]
    figures["killed_mid_write"] += not done
    acked = keys_in(lines, "durable")
    durable.extend(acked)
    figures["durable_acknowledged"] += len(acked)
    figures["torn_served"] += len(keys_in(lines, "torn"))
    figures["read_back"] += sum(int(line[1]) for line in lines if line and line[0] == "read")
    figures["load_errors"] += sum(int(line[1]) for line in lines if line and line[0] == "error")
    return done


def _count_check(check: dict, figures: dict) -> None:
    figures["reopens"] += 1
    if not check["ok"]:
        figures["errors"].append(check.get("error"))
        return
    figures["reopen_ok"] += 1
    for name in ("torn_served", "durable_lost", "verify_problems", "load_errors", "stored_not_served"):
        figures[name] += check[name]
    for kind, n in check["verify_kinds"].items():
        figures["verify_kinds"][kind] = figures["verify_kinds"].get(kind, 0) + n
    figures["max_stored_blocks"] = max(figures["max_stored_blocks"], check["stored"])
