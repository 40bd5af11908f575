"""``tiered-kv verify --fix`` while an engine in another process serves from the same LMDB store:
every entry is judged again right before its own delete, so a block the engine recomputed and
stored while the fix was still judging other entries is kept (real LMDB under tmp_path, the
engine in a process of its own)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from tests.store.helpers import NS, keys_for, load, make_store, payloads, rewrite_stored_blocks
from tiered_kv.admin.catalog import READ_BATCH
from tiered_kv.admin.opening import open_tier
from tiered_kv.admin.verify import verify_tier

ROOT = Path(__file__).resolve().parents[2]
N = READ_BATCH + 2  # every block corrupt: the fix judges them again in two batches

ENGINE_RECOMPUTES = textwrap.dedent("""
    # the engine's step: block N (its load a miss, the corrupt copy being removed) is recomputed
    # and stored again, flushed
    import sys
    from pathlib import Path
    from tests.store.helpers import keys_for, load_staged, make_store, payloads
    n = int(sys.argv[2])
    with make_store(Path(sys.argv[1])) as store:
        key = keys_for(n + 1)[n:]
        assert load_staged(store, key)[0] == [False]
        store.save(key, payloads(store, 1, seed=n))
        assert store.flush(30) and store.tier("disk").contains(key) == [True]
""")


def engine_recomputes(tmp_path: Path, n: int) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", ENGINE_RECOMPUTES, str(tmp_path), str(n)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]


def test_regression_verify_fix_deleted_a_block_the_engine_recomputed_while_it_judged_the_other_entries_again(
        tmp_path):
    # the fix judged every finding again, then deleted them all in one call: a block the engine
    # recomputed and stored meanwhile (acknowledged to it) was deleted with the corrupt ones
    keys = keys_for(N)
    with make_store(tmp_path) as store:
        store.save(keys, payloads(store, N))
        assert store.flush(30)
    assert rewrite_stored_blocks(tmp_path / "lmdb", lambda k, v: v[:-5] + bytes([v[-5] ^ 0xFF]) + v[-4:]) == N
    order = sorted(NS.digest() + k for k in keys)  # the order verify reads and judges them in
    first, later = keys.index(order[0][16:]), order[READ_BATCH]
    tier = open_tier(f"lmdb://{tmp_path}/lmdb")
    read, engines = tier.backend.get_many, []
    scan = {"checked": 0, "over": False}

    def scan_progress(done, total):
        scan["checked"] += done
        scan["over"] = scan["checked"] == total  # every entry checked: the fix comes next

    def read_and_the_engine_steps_while_the_fix_judges_the_second_batch(batch):
        if scan["over"] and later in batch and not engines:
            engines.append(engine_recomputes(tmp_path, first))
        return read(batch)

    tier.backend.get_many = read_and_the_engine_steps_while_the_fix_judges_the_second_batch
    try:
        report = verify_tier(tier, fix=True, progress=scan_progress)
    finally:
        tier.close()
    assert len(engines) == 1 and report["problems"]["corrupt"] == N and report["ok"], report
    with make_store(tmp_path) as store:
        held = store.tier("disk").contains(keys)
        assert held[first], "the block the engine recomputed was deleted"
        assert sum(held) == 1
        ok, outs = load(store, keys[first : first + 1])
    with make_store(None, disk=None) as fresh:
        expected = payloads(fresh, 1, seed=first)[0]
    assert ok == [True] and torch.equal(outs[0], expected)
