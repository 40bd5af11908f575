"""On-disk layout of the file medium: the marker, file names of keys and temporary files, and
the check for files that do not belong.

Layout::

    DIR/.tiered-kv-file-store      marker (format version); a directory without it is refused
    DIR/<ff>/<key as hex>          one value; ``<ff>`` is the last byte of the key in hex
    DIR/<ff>/.<name>.<pid>.<thread>.<n>.tmp   a value being written, renamed over <name>
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

from storage_backends.options import existing_directory
from tiered_kv.errors import ConfigError, InvalidKey

MARKER = ".tiered-kv-file-store"
FORMAT = 1
MAX_KEY = 120  # bytes: 240 hex characters, within every filesystem's 255-byte name limit
STALE_TEMP_S = 600.0  # check(): temporary files older than this were left by a crash


def as_key(key) -> bytes:
    """``key`` as bytes, or InvalidKey when the file medium cannot name it."""
    if not isinstance(key, (bytes, bytearray, memoryview)):
        raise InvalidKey(f"file keys are bytes, got {type(key).__name__}")
    key = bytes(key)
    if not 0 < len(key) <= MAX_KEY:
        raise InvalidKey(f"file keys must be 1..{MAX_KEY} bytes, got {len(key)}")
    return key


def file_of(root: Path, key: bytes) -> Path:
    """Where the value of ``key`` lives under ``root``."""
    name = key.hex()
    return root / name[-2:] / name


def temp_of(path: Path, serial: int) -> Path:
    """A temporary name next to ``path``, unique to this process, thread and ``serial``."""
    return path.parent / f".{path.name}.{os.getpid()}.{threading.get_ident()}.{serial}.tmp"


def key_of(name: str) -> bytes | None:
    """The key a file name stands for; None for temporary and foreign names."""
    if name.startswith(".") or len(name) % 2:
        return None
    try:
        return bytes.fromhex(name)
    except ValueError:
        return None


def open_store(root: Path, create: bool) -> None:
    """Check the marker of the store at ``root``; with ``create``, make an empty store where
    there is nothing. ConfigError for a foreign, unreadable or other-format directory."""
    marker = root / MARKER
    if root.exists() and not root.is_dir():
        raise ConfigError(f"{root} is a file, not a store directory")
    if marker.is_file():
        try:
            found = json.loads(marker.read_text()).get("format")
        except (OSError, ValueError, AttributeError) as exc:
            raise ConfigError(f"file store at {root}: unreadable marker: {exc}") from None
        if found != FORMAT:
            raise ConfigError(f"file store at {root} has format {found}, this version reads {FORMAT}")
        return
    if not create:
        existing_directory(root)
        raise ConfigError(f"{root} is not a file store (no {MARKER})")
    if root.exists() and any(root.iterdir()):
        raise ConfigError(f"{root} is not empty and not a file store: refusing to write there")
    try:
        root.mkdir(parents=True, exist_ok=True)
        marker.write_text(json.dumps({"format": FORMAT}))
    except OSError as exc:
        raise ConfigError(f"cannot create a file store at {root}: {exc}") from None


def stored_files(root: Path) -> list[tuple[bytes, os.stat_result]]:
    """(key, stat) of every stored value under ``root``; temporary and foreign files are
    skipped. OSError when the directory cannot be read."""
    out = []
    for sub in os.scandir(root):
        if not sub.is_dir() or len(sub.name) != 2:
            continue
        for entry in os.scandir(sub.path):
            key = key_of(entry.name)
            if key is not None and entry.name.endswith(sub.name):
                try:
                    out.append((key, entry.stat()))
                except FileNotFoundError:  # deleted meanwhile
                    continue
    return out


def check_dir(root: Path, fix: bool = False) -> list[str]:
    """Leftover temporary files (older than STALE_TEMP_S) and foreign files under ``root``;
    removed with ``fix``."""
    problems, doomed = [], []
    now = time.time()
    for sub in os.scandir(root):
        if not sub.is_dir():
            if sub.name != MARKER:
                problems.append(f"foreign file: {sub.name}")
            continue
        for entry in os.scandir(sub.path):
            key = key_of(entry.name)
            if key is not None and entry.name.endswith(sub.name) and len(sub.name) == 2:
                continue
            if entry.name.endswith(".tmp"):
                if now - entry.stat().st_mtime < STALE_TEMP_S:
                    continue  # maybe being written right now
                problems.append(f"leftover temporary file: {sub.name}/{entry.name}")
            else:
                problems.append(f"foreign file: {sub.name}/{entry.name}")
            doomed.append(entry.path)
    if fix:
        for path in doomed:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
    return problems
