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
import logging
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from tiered_kv.config import TieredKVConfig
from tiered_kv.errors import ConfigError
from tiered_kv.keys import Namespace
from tiered_kv.settings.loading import ENV_PREFIX
from tiered_kv.units import as_bool

log = logging.getLogger(__name__)

ADAPTER_KEYS = ("config_file", "load_async", "save", "kv_layout")
LAYOUTS = ("engine", "block_major", "layers_nb2", "layers_2nb", "layers_head_major")


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
    # plan no save for it in this step (its tokens still count as the step's work): the engine
    # cannot yet tell this request's finish from a previous one's under the same id; the saves
    # go out with the next plan (tiered_kv.connector.held_saves)
    no_save: bool = False


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
