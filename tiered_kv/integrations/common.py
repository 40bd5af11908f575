"""What the engine adapters share: settings from an engine's extra-config dict, one store per
process, and the scheduler's view of the store.

Settings are the keys of our TOML file (``host``, ``disk``, ``remote``, ``workers``, …) plus:

- ``config_file``: a TOML file read first; the other keys override it;
- ``load_async`` (bool, default false): loads complete between engine steps (``get_finished``);
- ``save`` (bool, default true): save computed blocks (false: a read-only consumer);
- ``kv_layout``: insist on a KV layout (``layers_head_major``, ``layers_nb2``, ``block_major``, …).

``TIERED_KV_*`` environment variables override both (``TIERED_KV_DISK_URL``, and for the adapter
keys ``TIERED_KV_CONFIG_FILE``, ``TIERED_KV_LOAD_ASYNC``, ``TIERED_KV_SAVE``, ``TIERED_KV_KV_LAYOUT``).
Every mistake is one :class:`ConfigError` line that names the key.
"""

from __future__ import annotations

import atexit
import functools
import json
import logging
import os
import threading
import types
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import xxhash

from tiered_kv.config import TieredKVConfig
from tiered_kv.errors import ConfigError
from tiered_kv.keys import Namespace
from tiered_kv.settings.loading import ENV_PREFIX
from tiered_kv.units import as_bool

log = logging.getLogger(__name__)

ADAPTER_KEYS = ("config_file", "load_async", "save", "kv_layout")
LAYOUTS = ("engine", "block_major", "layers_nb2", "layers_2nb", "layers_head_major")
UNSET = (None, "", {}, "auto")  # an engine setting left at its default
PLAIN = (bool, int, float, str, bytes, tuple, list, dict, type(None))  # values read by a callable setting
MAX_DEPTH = 16  # levels of nested values named by plain_form (deeper: "<deep>")


@dataclass(frozen=True)
class AdapterSettings:
    config: TieredKVConfig
    load_async: bool = False
    save: bool = True
    kv_layout: str | None = None


@dataclass(frozen=True)
class RequestView:
    """What the connector core reads of an engine's request."""

    request_id: Any
    prompt_token_ids: list[int]
    num_prompt_tokens: int
    key_extra: str | None = field(repr=False)  # LoRA, tenant salt, media hashes: folded into the keys
    tenant: str | None = field(default=None, repr=False)  # its cache_salt: quotas and usage per tenant


@dataclass(frozen=True)
class RequestStep:
    """One request's part of a step, as the core reads it (``computed_position`` = the device
    prefix only; the core adds the tokens it matched externally)."""

    request_id: Any
    new_tokens: Sequence[int]
    new_block_ids: Sequence[int]
    computed_position: int
    num_scheduled_tokens: int


@dataclass(frozen=True)
class StepOutput:
    """A scheduler step in the core's terms: requests new to it and requests it already knows."""

    new_requests: list
    cached_requests: list


def parse_settings(extra: Mapping[str, Any] | None, *, source: str,
                   environ: Mapping[str, str] | None = None) -> AdapterSettings:
    """Settings from an engine's extra-config dict (``source`` names it in errors)."""
    environ = dict(os.environ if environ is None else environ)
    if extra is not None and not isinstance(extra, Mapping):
        raise ConfigError(f"{source} must be a table of settings, got a {type(extra).__name__}")
    data = dict(extra or {})
    options = {k: data.pop(k) for k in ADAPTER_KEYS if k in data}
    for key in ADAPTER_KEYS:  # adapter keys from the environment win, like TIERED_KV_* fields
        value = environ.pop(ENV_PREFIX + key.upper(), None)
        if value is not None:
            options[key] = value
    try:
        config_file = options.get("config_file")
        if config_file not in (None, ""):
            base = TieredKVConfig.from_toml(str(config_file))
            data = _merge(base.settings(), data)  # (as written: the new URL decides its settings)
        config = TieredKVConfig.load(data, environ=environ)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    layout = options.get("kv_layout")
    if layout not in (None, "") and layout not in LAYOUTS:
        raise ConfigError(f"{source}: kv_layout must be one of {list(LAYOUTS)}, got {layout!r}")
    return AdapterSettings(config=config, load_async=_flag(source, "load_async", options, False),
                           save=_flag(source, "save", options, True), kv_layout=layout or None)


def _flag(source: str, key: str, options: Mapping[str, Any], default: bool) -> bool:
    return as_bool(options.get(key, default), f"{source}: {key}")


def _merge(base: dict, over: Mapping[str, Any]) -> dict:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = {**out[key], **value}
        else:
            out[key] = value
    return out


# -- what names a checkpoint's K/V beyond its files (folded into a namespace's revision) ---------
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


# -- one store per (config, namespace) in a process ---------------------------------------------
_lock = threading.Lock()
_stores: dict[tuple, list] = {}  # (config, namespace) -> [store, users]


def acquire_store(config: TieredKVConfig, namespace: Namespace):
    """The process's store for ``(config, namespace)``, opened on first use and shared by the
    halves of a connector that live in one process (an LMDB environment must be opened once per
    process). Closed by :func:`release_store` of its last user, or at exit."""
    from tiered_kv.store import TieredStore

    key = (config, namespace)
    with _lock:
        entry = _stores.get(key)
        if entry is None:
            entry = _stores[key] = [TieredStore(config, namespace), 0]
        entry[1] += 1
        return entry[0]


def existing_store(config: TieredKVConfig, namespace: Namespace):
    """The store a worker of this process opened for ``(config, namespace)``, else None."""
    with _lock:
        entry = _stores.get((config, namespace))
        return entry[0] if entry is not None else None


@contextmanager
def released_on_error(store) -> Iterator:
    """Release ``store`` (one use of :func:`acquire_store`) when the block raises: an adapter half
    that failed to start after acquiring it held it open, never closed, for the process's life."""
    try:
        yield store
    except BaseException:
        release_store(store)
        raise


def release_store(store) -> None:
    with _lock:
        for key, entry in list(_stores.items()):
            if entry[0] is store:
                entry[1] -= 1
                if entry[1] > 0:
                    return
                del _stores[key]
                break
        else:
            return
    store.close()


@atexit.register
def _close_all() -> None:
    """Flush write-behind of stores whose engine exited without a shutdown call."""
    with _lock:
        stores = [entry[0] for entry in _stores.values()]
        _stores.clear()
    for store in stores:
        try:
            store.close()
        except Exception:  # exiting: report, never raise
            log.exception("tiered-kv: closing the store at exit failed")


def scheduler_index(config: TieredKVConfig, namespace: Namespace):
    """What a scheduler half looks blocks up in: the store of a worker in this process (host tier
    and leases included), or a lookup-only index of the lower tiers."""
    if existing_store(config, namespace) is not None:
        log.info("tiered-kv scheduler: sharing the worker's store in this process")
        return acquire_store(config, namespace)  # one more user: release it with release_index
    from tiered_kv.store.lower_index import LowerTierIndex

    log.info("tiered-kv scheduler: no worker in this process; looking up the lower tiers")
    return LowerTierIndex(config, namespace)


def release_index(index) -> None:
    """End a :func:`scheduler_index` (release the shared store or close the lookup index)."""
    from tiered_kv.store.lower_index import LowerTierIndex

    if isinstance(index, LowerTierIndex):
        index.close()
    elif index is not None:
        release_store(index)
