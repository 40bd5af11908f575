"""The L3 backends the scenarios run against, each built by SGLang's own ``dynamic`` factory path.

A backend spec is what ``--hicache-storage-backend-extra-config`` would carry: ``backend_name``,
``module_path``, ``class_name`` plus the backend's own settings (``config``, merged in at the top
level). ``checks_integrity`` says whether a corrupted stored page must read back as a miss, and
``objects`` / ``damage`` reach the stored objects behind the backend's back (only while no
controller holds the storage open).
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BackendSpec:
    id: str
    backend_name: str
    module_path: str
    class_name: str
    config: Callable[[Path], dict[str, Any]]
    checks_integrity: bool
    has_v1: bool
    objects: Callable[[Path], set[str]] = field(repr=False)
    damage: Callable[[Path, set[str]], None] = field(repr=False)

    def extra_config(self, storage_dir: Path, *, interface_v1: bool = False, **more) -> dict[str, Any]:
        extra = {"backend_name": self.backend_name, "module_path": self.module_path,
                 "class_name": self.class_name, **self.config(storage_dir), **more}
        if interface_v1:
            extra["interface_v1"] = 1
        return extra


def _flip_middle_byte(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(0, os.SEEK_END)
        middle = f.tell() // 2
        f.seek(middle)
        byte = f.read(1)
        f.seek(middle)
        f.write(bytes([byte[0] ^ 0xFF]))


# SGLang's own file backend: one raw file per page, no header, no checks.
def _file_objects(storage_dir: Path) -> set[str]:
    root = storage_dir / "hicache-file"
    return {n for n in os.listdir(root) if n.endswith(".bin")} if root.is_dir() else set()


def _file_damage(storage_dir: Path, names: set[str]) -> None:
    for name in names:
        _flip_middle_byte(str(storage_dir / "hicache-file" / name))


HICACHE_FILE = BackendSpec(
    id="hicache_file",
    backend_name="hicache_file",
    module_path="sglang.srt.mem_cache.hicache_storage",
    class_name="HiCacheFile",
    config=lambda d: {"file_storage_path": str(d / "hicache-file")},
    checks_integrity=False,
    has_v1=False,  # HiCacheFile implements only get/set (v0); batch_get_v1 is the base's no-op
    objects=_file_objects,
    damage=_file_damage,
)


# tiered-kv's adapter over an LMDB store (the default embedded medium).
def _lmdb_url(storage_dir: Path) -> str:
    return f"lmdb://{storage_dir / 'tiered-kv'}"


def _tiered_objects(storage_dir: Path) -> set[str]:
    from storage_backends.registry import open_backend
    from tiered_kv.store.records import is_block_key

    if not (storage_dir / "tiered-kv").exists():
        return set()
    backend = open_backend(_lmdb_url(storage_dir))
    try:
        return {k.hex() for k in backend.scan() if is_block_key(k)}
    finally:
        backend.close()


def _tiered_damage(storage_dir: Path, names: set[str]) -> None:
    from storage_backends.registry import open_backend

    backend = open_backend(_lmdb_url(storage_dir))
    try:
        keys = [bytes.fromhex(n) for n in sorted(names)]
        for key, value in zip(keys, backend.get_many(keys)):
            blob = bytearray(value)
            blob[len(blob) // 2] ^= 0xFF
            backend.put_many([(key, bytes(blob))])
        backend.flush()
    finally:
        backend.close()


def _tiered_unavailable() -> str | None:
    if importlib.util.find_spec("tiered_kv.integrations.sglang") is None:
        return "tiered_kv.integrations.sglang (TieredKVHiCacheStorage) does not exist yet"
    try:
        module = importlib.import_module("tiered_kv.integrations.sglang")
    except Exception as exc:  # the adapter is being written: say why it is left out
        return f"tiered_kv.integrations.sglang cannot be imported: {type(exc).__name__}: {exc}"
    if not hasattr(module, "TieredKVHiCacheStorage"):
        return "tiered_kv.integrations.sglang has no TieredKVHiCacheStorage yet"
    return None


TIERED_KV = BackendSpec(
    id="tiered_kv",
    backend_name="tiered_kv",
    module_path="tiered_kv.integrations.sglang",
    class_name="TieredKVHiCacheStorage",
    config=lambda d: {"disk": {"url": _lmdb_url(d)}},
    checks_integrity=True,
    has_v1=True,
    objects=_tiered_objects,
    damage=_tiered_damage,
)

BACKENDS = (HICACHE_FILE, TIERED_KV)


def unavailable_reason(spec: BackendSpec) -> str | None:
    return _tiered_unavailable() if spec is TIERED_KV else None
