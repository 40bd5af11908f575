"""The Triton block copy (under Triton's CPU interpreter) moves the same bytes as torch."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tiered_kv.connector.block_copy import gather_torch, scatter_torch, use_triton

ROOT = Path(__file__).resolve().parents[2]


def test_torch_gather_is_the_canonical_layout():
    kv = torch.randn(2, 3, 5, 4, 2, 8)
    out = gather_torch(kv, torch.tensor([4, 1]))
    assert out.shape == (2, 3, 2, 4, 2, 8)
    assert torch.equal(out[0, 2, 1], kv[1, 2, 4]) and torch.equal(out[1, 0, 0], kv[0, 0, 1])
    fresh = torch.zeros_like(kv)
    scatter_torch(fresh, torch.tensor([4, 1]), out)
    assert torch.equal(fresh[:, :, [4, 1]], kv[:, :, [4, 1]])


def test_cpu_without_the_interpreter_uses_torch(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert use_triton(torch.device("cpu")) is False


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_gather_and_scatter_equal_torch_under_the_interpreter():
    script = textwrap.dedent("""
        import os
        os.environ["TRITON_INTERPRET"] = "1"
        import torch
        from tiered_kv.connector import block_copy as bc
        assert bc.use_triton(torch.device("cpu"))
        for dtype in (torch.float32, torch.bfloat16):
            kv = torch.randn(2, 3, 7, 4, 2, 40).to(dtype)   # chunk 320 < TILE and > 0
            ids = torch.tensor([6, 0, 3])
            assert torch.equal(bc.gather_triton(kv, ids), bc.gather_torch(kv, ids))
            a, b = torch.zeros_like(kv), torch.zeros_like(kv)
            src = torch.randn(3, 3, 2, 4, 2, 40).to(dtype)
            bc.scatter_triton(a, ids, src)
            bc.scatter_torch(b, ids, src)
            assert torch.equal(a, b)
        big = torch.randn(2, 2, 3, 16, 2, 64)  # chunk 2048: two tiles
        assert torch.equal(bc.gather_triton(big, torch.tensor([2, 1])), bc.gather_torch(big, torch.tensor([2, 1])))
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_regression_triton_read_a_strided_column_of_group_rows_as_contiguous_block_ids():
    """A KV group's block ids are a column of the rows ``[n, groups]`` (``rows[:, g]``, strided):
    the kernel read id ``i`` at ``ids + i`` and saved (and loaded) other blocks than named."""
    script = textwrap.dedent("""
        import os
        os.environ["TRITON_INTERPRET"] = "1"
        import torch
        from tiered_kv.connector import block_copy as bc
        kv = torch.randn(2, 3, 7, 4, 2, 8)
        rows = torch.tensor([[6, 1], [0, 2], [3, 5]])
        ids = rows[:, 0]
        assert not ids.is_contiguous()
        assert torch.equal(bc.gather_triton(kv, ids), bc.gather_torch(kv, ids))
        a, b = torch.zeros_like(kv), torch.zeros_like(kv)
        src = torch.randn(3, 3, 2, 4, 2, 8)
        bc.scatter_triton(a, ids, src)
        bc.scatter_torch(b, ids, src)
        assert torch.equal(a, b)
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
