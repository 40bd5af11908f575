"""Engine settings that change the K/V a checkpoint computes for the same tokens without changing
its files (weights quantized as they load, config overrides, a KV dtype of their own, ...), named
as plain data the same in every process: each engine's namespace folds in ``numerics_suffix`` of
the ones its adapter names (``vllm_namespace``, ``sglang_pages``, ``trtllm_model``)."""

from __future__ import annotations

import functools
import json
import types
from collections.abc import Mapping
from typing import Any

import xxhash

UNSET = (None, "", {}, "auto")  # an engine setting left at its default
PLAIN = (bool, int, float, str, bytes, tuple, list, dict, type(None))  # values read by a callable setting
MAX_DEPTH = 16  # levels of nested values named by plain_form (deeper: "<deep>")


def numerics_suffix(fields: Mapping[str, Any]) -> str:
    """``+numerics-<hex>`` over the engine settings in ``fields`` that are set (those that change
    the K/V a checkpoint computes for the same tokens without changing its files: weights
    quantized as they load, config overrides, ...), or "" when none is, so an engine that sets
    none keeps the namespace it had. Each engine's adapter names its own settings."""
    fields = {name: value for name, value in fields.items() if value not in UNSET}
    if not fields:
        return ""
    try:
        text = json.dumps(fields, sort_keys=True, default=stable_value)
    except (TypeError, ValueError, RecursionError):  # a cycle, keys no JSON holds: named by plain_form
        # (such values raised out of the engine's start; values that never did keep their digests)
        text = json.dumps(plain_form(fields), sort_keys=True)
    return "+numerics-" + xxhash.xxh3_64_hexdigest(text.encode())


def quantized_kv(cache_dtype: Any) -> bool:
    """Whether a KV cache dtype setting names a quantized format (fp8, mxfp8, nvfp4, fp4): its
    values depend on the activation dtype they were quantized from, which the stored dtype (or
    the uint8 container an engine keeps them in) does not name."""
    return str(cache_dtype or "").lower().startswith(("fp8", "mxfp", "nvfp", "fp4"))


def dummy_weights(load_format: Any) -> str:
    """The revision's mark of random weights (a profiling run): their KV is nobody's. The load
    format as a string or an enum member (TensorRT-LLM's ``LoadFormat.DUMMY``), any case."""
    return "+dummy-weights" if str(getattr(load_format, "name", load_format) or "").lower().endswith("dummy") else ""


def stable_value(value: Any) -> Any:
    """A JSON-able form of a config value: a dataclass or object by its fields, a function (a
    callable ``hf_overrides``) by its name, code and captured values, a torch dtype by its name."""
    if isinstance(value, (set, frozenset)):  # (str() of a set follows the hash seed)
        return sorted(map(str, value))
    if isinstance(value, types.ModuleType):  # (a module's fields are all of it)
        return value.__name__
    if isinstance(value, functools.partial):  # (its repr holds an address: other in every process)
        return {"partial": value.func, "args": list(value.args), "keywords": value.keywords}
    if isinstance(value, types.MethodType) or (callable(value) and hasattr(value, "__qualname__")):
        return plain_form(value)  # (by its name, code and captured values: see _described)
    fields = getattr(value, "__dict__", None)
    if isinstance(fields, dict) and fields:
        return {k: v for k, v in fields.items() if not k.startswith("_")}
    return str(value)


def plain_form(value: Any, seen: frozenset = frozenset(), depth: int = 0) -> Any:
    """``value`` as JSON data the same in every process, whatever it holds: a value met again
    inside itself is ``"<cycle>"``, keys are text (others by repr), an array or tensor is named by
    a hash of its bytes (its str() elides the middle), anything else as :func:`stable_value` names it."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if id(value) in seen or depth > MAX_DEPTH:
        return "<cycle>" if id(value) in seen else "<deep>"
    seen, depth = seen | {id(value)}, depth + 1
    if isinstance(value, Mapping):
        return {k if isinstance(k, str) else repr(k): plain_form(v, seen, depth) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain_form(v, seen, depth) for v in value]
    if isinstance(value, (bytes, bytearray)):
        return repr(bytes(value))
    if hasattr(value, "shape") and hasattr(value, "dtype") and not isinstance(value, type):
        try:  # (a tensor or an array: no torch import here, the scheduler's side)
            array = value.detach().cpu().numpy() if hasattr(value, "detach") else value
            return {"array": xxhash.xxh3_64_hexdigest(array.tobytes()), "shape": list(value.shape),
                    "dtype": str(value.dtype)}
        except Exception:  # (a meta tensor, an object only shaped like one)
            return str(value)
    named = _described(value)
    if named is None:
        named = stable_value(value)
    return named if isinstance(named, str) else plain_form(named, seen, depth)


def _described(value: Any) -> Any:
    """A function by its name *and* its code and captured values (two lambdas, ``__main__.<lambda>``,
    or one factory's closures setting other RoPE thetas were one name, so one namespace); a bound
    method with its object (``C(1).m`` and ``C(2).m`` differ); a class or builtin by its name; None
    for anything else."""
    if isinstance(value, types.MethodType):
        return {"method": value.__func__, "self": value.__self__}
    if not (callable(value) and hasattr(value, "__qualname__")):
        return None
    name = f"{getattr(value, '__module__', '')}.{value.__qualname__}"
    code = getattr(value, "__code__", None)
    if code is None:
        return name
    known = getattr(value, "__globals__", None) or {}  # (module constants it reads: THETA = 1e6)
    return {"callable": name, "code": _code(code),
            "closure": [_cell(c) for c in getattr(value, "__closure__", None) or ()],
            "globals": {n: known[n] for n in _names(code) if n in known and isinstance(known[n], PLAIN)},
            "defaults": list(getattr(value, "__defaults__", None) or ()),
            "kwdefaults": getattr(value, "__kwdefaults__", None) or {}}


def _code(code: Any) -> dict:
    """A code object's bytecode, constants (nested code objects alike) and names: the same in
    every process of one Python version (a code object's repr holds an address)."""
    consts = [_code(c) if hasattr(c, "co_code") else sorted(map(repr, c)) if isinstance(c, frozenset)
              else repr(c) for c in code.co_consts]  # (a frozenset's repr follows the hash seed)
    return {"bytecode": code.co_code.hex(), "consts": consts, "names": list(code.co_names)}


def _names(code: Any) -> list[str]:
    """The global names a code object and its nested ones read."""
    nested = [n for c in code.co_consts if hasattr(c, "co_code") for n in _names(c)]
    return sorted(set(code.co_names) | set(nested))


def _cell(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # (an empty cell: a closure over a name not yet bound)
        return None
