"""store_kvcache: the Triton kernel (run by Triton's CPU interpreter) writes what the torch fallback writes."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tiered_kv.engine.kv_kernel import select_store_kvcache, store_kvcache_torch

ROOT = Path(__file__).resolve().parents[2]


def test_torch_fallback_writes_rows_at_their_slots_and_skips_minus_one():
    blocks, block_size, heads, dim = 4, 8, 2, 16
    k_cache = torch.zeros(blocks, block_size, heads, dim)
    v_cache = torch.zeros_like(k_cache)
    key, value = torch.randn(3, heads, dim), torch.randn(3, heads, dim)
    slots = torch.tensor([3 * block_size + 5, -1, 0])
    store_kvcache_torch(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache[3, 5], key[0]) and torch.equal(v_cache[3, 5], value[0])
    assert torch.equal(k_cache[0, 0], key[2]) and torch.equal(v_cache[0, 0], value[2])
    assert int((k_cache != 0).any(-1).any(-1).sum()) == 2  # nothing else was written


def test_auto_kernel_on_cpu_is_the_torch_fallback(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert select_store_kvcache("auto", torch.device("cpu")) is store_kvcache_torch


SCRIPT = textwrap.dedent("""
    import os
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from tiered_kv.engine.kv_kernel import (select_store_kvcache, store_kvcache_torch,
                                            store_kvcache_triton)
    assert select_store_kvcache("auto", torch.device("cpu")) is store_kvcache_triton
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for heads, dim in ((2, 16), (3, 24)):  # a row of 48 is not a power of two
            kv = torch.zeros(2, 2, 6, 4, heads, dim, dtype=dtype)  # [2, L, blocks, block, H, D]
            expect = kv.clone()
            slots = torch.tensor([5, 0, 23, -1, 9, 14])
            key = torch.randn(6, heads * 2, dim, dtype=dtype)[:, ::2]  # strided rows
            value = torch.randn(6, heads, dim, dtype=dtype)
            store_kvcache_triton(key, value, kv[0, 1], kv[1, 1], slots)
            store_kvcache_torch(key, value, expect[0, 1], expect[1, 1], slots)
            assert torch.equal(kv, expect), (dtype, heads, dim)
            assert kv.abs().sum() > 0
    from tiered_kv.engine import EngineConfig, LLMEngine, ModelConfig, SamplingParams
    prompt = [(7 * i) % 500 for i in range(21)]
    outs = []
    for kernel in ("triton", "torch"):
        engine = LLMEngine(ModelConfig.tiny(), EngineConfig(num_blocks=16, kv_kernel=kernel), seed=0)
        outs.append(engine.generate([prompt], SamplingParams(max_tokens=3))[0].output_token_ids)
    assert outs[0] == outs[1], outs
    print("OK")
""")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_store_kvcache_under_interpreter_equals_torch_fallback():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True,
                          timeout=240, cwd=ROOT)
    if proc.returncode != 0 and "ModuleNotFoundError: No module named 'triton" in proc.stderr:
        pytest.skip("triton cannot be imported")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "OK" in proc.stdout
