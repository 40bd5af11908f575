"""KV dtypes by name: the names a namespace may use, their sizes, how engines spell them, and
the torch dtype of each (torch is imported only when that is asked for: scheduler-side code
uses the rest)."""

from __future__ import annotations

from typing import Any

from tiered_kv.errors import ConfigError

# dtype name (torch's, without "torch.") -> bytes per element
ITEMSIZE: dict[str, int] = {
    "uint8": 1, "int8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "float16": 2, "bfloat16": 2,
    "float32": 4, "int32": 4, "float64": 8,
}
_ALIASES = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2",
            "half": "float16", "float": "float32", "bf16": "bfloat16", "fp16": "float16"}


def itemsize(name: str) -> int:
    """Bytes per element of the KV dtype ``name``; ConfigError for one we do not store."""
    try:
        return ITEMSIZE[name]
    except KeyError:
        raise ConfigError(f"unsupported KV dtype {name!r}; known: {sorted(ITEMSIZE)}") from None


def dtype_name(dtype: Any) -> str:
    """``torch.bfloat16`` / ``"bfloat16"`` / ``"fp8"`` / ``"bf16"`` -> the name a namespace uses."""
    name = str(dtype).removeprefix("torch.")
    return _ALIASES.get(name, name)


def torch_dtype(name: str):
    """The ``torch.dtype`` of ``name`` (any spelling :func:`dtype_name` knows)."""
    import torch

    dtype = getattr(torch, dtype_name(name), None)
    if not isinstance(dtype, torch.dtype):
        raise ConfigError(f"torch has no dtype {name!r}")
    return dtype


def byte_view(t):
    """``t`` itself, or its bytes when it holds a 1-byte float (fp8): copy kernels only move
    elements, and Triton refuses to compile for fp8 types on GPUs before sm_89 (where vLLM still
    keeps fp8 KV)."""
    import torch

    return t.view(torch.uint8) if t.dtype.itemsize == 1 and t.dtype.is_floating_point else t
