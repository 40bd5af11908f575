"""The Triton kernels (block copy, store_kvcache) are handed no fp8 tensor, and launch on their
tensors' GPU.

- Triton refuses to compile for ``float8_e4m3fn`` on GPUs before sm_89, where vLLM still keeps
  fp8 KV: the kernels only move elements, so fp8 goes to them as bytes (same shape, same bits).
  Run under Triton's CPU interpreter, with the kernel launches recorded.
- A Triton kernel launches on the *current* CUDA device whatever its tensors': a pool on another
  GPU was read and written at the current device's addresses. Checked on a second GPU where
  there is one."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tiered_kv.connector.block_copy import gather_torch, gather_triton, on_device

ROOT = Path(__file__).resolve().parents[2]
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

SPY = """
import os
os.environ["TRITON_INTERPRET"] = "1"
import torch
from tiered_kv.connector import block_copy as bc
from tiered_kv.engine import kv_kernel as kk

seen = []

def spy(kernels):
    triton, kernel = kernels()
    class Launches:  # records the dtypes of the tensors each launch is handed, then launches
        def __getitem__(self, grid):
            launch = kernel[grid]
            def run(*args, **kwargs):
                seen.extend(a.dtype for a in args if isinstance(a, torch.Tensor))
                return launch(*args, **kwargs)
            return run
    return lambda: (triton, Launches())

bc._kernels = spy(bc._kernels)
kk._triton_kernel = spy(kk._triton_kernel)
"""


def _run(body: str) -> None:
    script = SPY + textwrap.dedent(body) + "\nassert seen and not any(d.is_floating_point and d.itemsize == 1 " \
        "for d in seen), seen\nprint('ok')\n"
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", (proc.stdout[-2000:], proc.stderr[-3000:])


@needs_triton
def test_regression_the_block_copy_kernel_was_handed_fp8_kv():
    _run("""
        kv = torch.randn(2, 3, 7, 4, 2, 40).to(torch.float8_e4m3fn)
        ids = torch.tensor([6, 0, 3])
        out = bc.gather_triton(kv, ids)
        assert out.dtype == torch.float8_e4m3fn
        assert torch.equal(out.view(torch.uint8), bc.gather_torch(kv.view(torch.uint8), ids))
        a, b = torch.zeros_like(kv), torch.zeros(kv.shape, dtype=torch.uint8)
        bc.scatter_triton(a, ids, out)
        bc.scatter_torch(b, ids, out.view(torch.uint8))
        assert torch.equal(a.view(torch.uint8), b)
    """)


@needs_triton
def test_regression_the_store_kvcache_kernel_was_handed_fp8_caches():
    _run("""
        k, v = (torch.zeros(5, 4, 2, 8, dtype=torch.float8_e4m3fn) for _ in range(2))
        key, value = torch.randn(6, 2, 8), torch.randn(6, 2, 8)
        slots = torch.tensor([0, 3, -1, 7, 19, 12])
        kk.store_kvcache_triton(key, value, k, v, slots)
        # the reference in bytes (CPU torch has no index_copy_ for fp8), the values converted as the kernel's caller does
        kb, vb = torch.zeros(k.shape, dtype=torch.uint8), torch.zeros(v.shape, dtype=torch.uint8)
        as_fp8 = lambda t: t.to(torch.float8_e4m3fn).view(torch.uint8)
        kk.store_kvcache_torch(as_fp8(key), as_fp8(value), kb, vb, slots)
        assert torch.equal(k.view(torch.uint8), kb) and torch.equal(v.view(torch.uint8), vb)
        assert k.view(torch.uint8).any()
    """)


def test_regression_triton_launches_named_no_device_and_ran_on_the_current_one():
    guard = on_device(torch.device("cuda", 1))  # (made without touching CUDA)
    assert isinstance(guard, torch.cuda.device) and guard.idx == 1
    with on_device(torch.device("cpu")):  # the interpreter's CPU tensors: no CUDA at all
        pass


@pytest.mark.skipif(torch.cuda.device_count() < 2 or importlib.util.find_spec("triton") is None,
                    reason="needs two CUDA devices and triton")
def test_a_pool_on_the_second_gpu_is_gathered_there_while_the_first_is_current():
    kv = torch.randn(2, 3, 7, 4, 2, 40, device="cuda:1").to(torch.bfloat16)
    ids = torch.tensor([6, 0, 3], device="cuda:1")
    with torch.cuda.device(0):
        out = gather_triton(kv, ids)
    torch.cuda.synchronize(1)
    assert torch.equal(out, gather_torch(kv, ids))
