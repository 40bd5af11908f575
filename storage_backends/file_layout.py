"""On-disk layout of the file medium: the marker and its format, and the names of values, tenant
files and temporary files.

Layout (format 2)::

    DIR/.tiered-kv-file-store          marker (format version); a directory without it is refused
    DIR/<ff>/<key as hex>              a value of no tenant, or a link to the next one
    DIR/<ff>/<key as hex>.<tenant hex> a value of that tenant (the key's name links to it)
    DIR/<ff>/.<name>.<pid>.<token>.<thread>.<n>.tmp   a value or link being written, renamed
                                                      over <name> (token: random per process)

``<ff>`` is the last byte of the key in hex. Reads and presence checks open the key's name
(following the link), so they never need the tenant; listings read the tenant from the link.
Format 1 (no tenants, no links) is a format 2 store whose values all belong to no tenant: it is
read as it is, and its marker says 2 from the first value stored for a tenant.

The marker is written whole, fsync'd, then named (and its directory fsync'd): a crash right
after a store was made used to leave it empty, and the directory could no longer be opened. An
empty or cut marker (all a crash can leave of one a version wrote) is rewritten as it is opened:
the directory's name says it is a store, and every version's values are format 2's.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from pathlib import Path

from storage_backends.file_durable import sync_dir, write_synced
from storage_backends.options import existing_directory
from tiered_kv.errors import ConfigError, InvalidKey

log = logging.getLogger(__name__)

MARKER = ".tiered-kv-file-store"
FORMAT = 2
READS = (1, 2)  # formats this version opens
MAX_KEY = 120  # bytes: 240 hex characters, within every filesystem's 255-byte name limit
MAX_NAME = 255  # bytes of a file name
# in temporary names: replicas on other hosts (containers) may run with the same pid, thread id
# and serial, and two writers of one name would write into one file (a torn value published)
_TOKEN = os.urandom(4).hex()


def as_key(key) -> bytes:
    """``key`` as bytes, or InvalidKey when the file medium cannot name it."""
    if not isinstance(key, (bytes, bytearray, memoryview)):
        raise InvalidKey(f"file keys are bytes, got {type(key).__name__}")
    key = bytes(key)
    if not 0 < len(key) <= MAX_KEY:
        raise InvalidKey(f"file keys must be 1..{MAX_KEY} bytes, got {len(key)}")
    return key


def file_of(root: Path, key: bytes) -> Path:
    """The name of ``key`` under ``root``: its value, or a link to its tenant's file."""
    name = key.hex()
    return root / name[-2:] / name


def tenant_file_of(path: Path, tenant: bytes) -> Path:
    """Where the value of ``tenant`` for the key named ``path`` lives (next to it)."""
    stem = path.name
    if len(stem) + 1 + 2 * len(tenant) > MAX_NAME:  # a long key: a digest names it here
        stem = hashlib.blake2b(stem.encode(), digest_size=16).hexdigest()
    return path.with_name(f"{stem}.{tenant.hex()}")


def tenant_of_link(target: str) -> bytes | None:
    """The tenant a link target names (None: not a tenant file's name)."""
    stem, dot, label = target.partition(".")
    if not dot or not stem or not label or "/" in target:
        return None
    try:
        bytes.fromhex(stem)
        return bytes.fromhex(label)
    except ValueError:
        return None


def is_bucket(name: str) -> bool:
    """Whether ``name`` is one of the store's subdirectories (a key's last byte in hex)."""
    return len(name) == 2 and all(c in "0123456789abcdef" for c in name)


def is_tenant_file(name: str) -> bool:
    return not name.startswith(".") and tenant_of_link(name) is not None


def temp_of(path: Path, serial: int | str) -> Path:
    """A temporary name next to ``path``, unique to this process, thread and ``serial``."""
    return path.parent / f".{path.name[:64]}.{os.getpid()}.{_TOKEN}.{threading.get_ident()}.{serial}.tmp"


def is_marker_temp(name: str) -> bool:
    return name.startswith(f".{MARKER}.") and name.endswith(".tmp")


def key_of(name: str) -> bytes | None:
    """The key a file name stands for; None for temporary, tenant and foreign names."""
    if name.startswith(".") or len(name) % 2:
        return None
    try:
        return bytes.fromhex(name)
    except ValueError:
        return None


def open_store(root: Path, create: bool, repair: bool = True) -> int:
    """Check the marker of the store at ``root`` and return its format; with ``create``, make
    an empty store where there is nothing (its marker and the names leading to it durable before
    this returns); with ``repair``, rewrite an empty or cut marker (a tool's read-only open
    writes nothing: it opens such a store as it is). ConfigError for a foreign, unreadable or
    other-format directory."""
    marker = root / MARKER
    if root.exists() and not root.is_dir():
        raise ConfigError(f"{root} is a file, not a store directory")
    if marker.is_file():
        found = _read_marker(marker)
        if found is None:
            return _repair_marker(root, repair)
        if found not in READS:
            raise ConfigError(f"file store at {root} has format {found}, this version reads {FORMAT}")
        return found
    if not create:
        existing_directory(root)
        raise ConfigError(f"{root} is not a file store (no {MARKER})")
    if root.exists() and any(not is_marker_temp(p.name) for p in root.iterdir()):
        if marker.is_file():  # another process made the store since the look above
            return open_store(root, False, repair)
        raise ConfigError(f"{root} is not empty and not a file store: refusing to write there")
    try:  # (whole when it appears, and the first of several replicas creating it wins)
        made = not root.exists()
        root.mkdir(parents=True, exist_ok=True)
        tmp = temp_of(marker, "new")
        write_synced(tmp, _MARKER_TEXT)
        try:
            os.link(tmp, marker)
        except FileExistsError:  # another process made the store meanwhile
            pass
        finally:
            tmp.unlink()
        sync_dir(root)
        if made:  # (the store's own name)
            sync_dir(root.parent)
    except OSError as exc:
        raise ConfigError(f"cannot create a file store at {root}: {exc}") from None
    return open_store(root, False)


def upgrade_marker(root: Path) -> None:
    """Say FORMAT in the marker (before the first tenant file is written): a process of the
    version before tenants then refuses the store rather than take tenant files for foreign ones."""
    _write_marker(root, "marker")


_MARKER_TEXT = json.dumps({"format": FORMAT}).encode()
_WRITTEN = tuple(json.dumps({"format": n}).encode() for n in READS)  # what versions wrote there


def _read_marker(marker: Path) -> int | None:
    """The format ``marker`` says; None when it is empty or cut short: what a crash right after a
    store was made left behind (before this version the marker was not fsync'd)."""
    try:
        text = marker.read_bytes()
    except OSError as exc:
        raise ConfigError(f"file store at {marker.parent}: cannot read its marker {marker}: {exc}") from None
    cut = text.rstrip(b"\0 \n")  # (an unwritten block reads as zeros)
    if not cut or (cut not in _WRITTEN and any(w.startswith(cut) for w in _WRITTEN)):
        return None
    try:
        return json.loads(text).get("format")
    except (ValueError, AttributeError) as exc:
        raise ConfigError(f"file store at {marker.parent}: its marker {marker} is not one tiered-kv wrote "
                          f"({exc}); if the directory is a file store, write {_MARKER_TEXT.decode()} into it, "
                          f"else point the tier at another directory") from None


def _repair_marker(root: Path, repair: bool) -> int:
    """Rewrite the empty or cut marker of ``root`` (it says FORMAT: every value of format 1 is
    one of format 2), and open the store as FORMAT; a store this process may not write to (a
    read-only mount), or opened without ``repair``, opens as FORMAT, its marker as it was."""
    if not repair:
        log.warning("file store at %s: its marker %s is empty or cut short (a crash as it was made): "
                    "left as it is by this read-only open (an engine's open rewrites it), opened as "
                    "format %d", root, root / MARKER, FORMAT)
        return FORMAT
    try:
        _write_marker(root, "repair")
    except OSError as exc:
        log.warning("file store at %s: its marker %s is empty or cut short (a crash as it was made) "
                    "and cannot be rewritten (%s): opened as format %d", root, root / MARKER, exc, FORMAT)
        return FORMAT
    log.warning("file store at %s: its marker %s was empty or cut short (a crash as it was made): "
                "rewritten (format %d)", root, root / MARKER, FORMAT)
    return FORMAT


def _write_marker(root: Path, tag: str) -> None:
    """The marker of ``root`` replaced, crash-safely, by one saying FORMAT."""
    marker = root / MARKER
    tmp = temp_of(marker, tag)
    write_synced(tmp, _MARKER_TEXT)
    try:
        os.replace(tmp, marker)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    sync_dir(root)
