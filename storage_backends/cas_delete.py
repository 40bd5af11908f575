"""Delete-if-unchanged: remove entries only where a medium still holds exactly the value the
caller read, so that a tool deleting what it judged wrong (``verify --fix``) or took back
(``copy``) never deletes a value a serving process stored since (a good block acknowledged to
its engine). Each medium's way: :mod:`storage_backends.cas_lmdb` (one write transaction),
:mod:`storage_backends.cas_redis` (a Lua compare-and-delete), :mod:`storage_backends.cas_file`
(rename to a tombstone, compare, remove). The host tier lives inside its process, out of tools'
reach: it has none, nor has a medium registered by others unless it offers a
``delete_if_unchanged(pairs) -> list[bool]`` method itself."""

from __future__ import annotations

import importlib
import logging
from collections.abc import Sequence

from tiered_kv.errors import BackendClosed, BackendError, BackendUnavailable

log = logging.getLogger(__name__)

_BY_MEDIUM = {  # Backend.name -> (the medium's class, the module doing it there)
    "lmdb": ("storage_backends.lmdb_disk:LmdbBackend", "storage_backends.cas_lmdb"),
    "redis": ("storage_backends.redis_remote:RedisBackend", "storage_backends.cas_redis"),
    "file": ("storage_backends.file_dir:FileBackend", "storage_backends.cas_file"),
}


def supported(backend) -> bool:
    """Whether ``backend`` offers delete-if-unchanged."""
    return _way(backend) is not None


def delete_if_unchanged(backend, pairs: Sequence[tuple[bytes, bytes]]) -> list[bool] | None:
    """Delete each ``(key, value)`` of ``backend`` whose stored value is exactly ``value`` (one
    changed or gone since is left as it is now); per pair whether it was deleted. None when the
    medium offers no such delete, or refused it (logged: a Redis whose ACL forbids scripts); the
    caller decides what to do instead."""
    way = _way(backend)
    if way is None:
        return None
    try:
        return way(list(pairs))
    except (BackendUnavailable, BackendClosed):
        raise
    except BackendError as exc:  # the medium refused it (a Redis whose ACL forbids scripts: NOPERM)
        log.warning("%s medium refused delete-if-unchanged (%s): entries are deleted by key",
                    getattr(backend, "name", "?"), exc)
        return None


def _way(backend):
    own = getattr(backend, "delete_if_unchanged", None)
    if callable(own):
        return own
    found = _BY_MEDIUM.get(getattr(backend, "name", ""))
    if found is None:
        return None
    module, _, name = found[0].partition(":")
    if not isinstance(backend, getattr(importlib.import_module(module), name)):
        return None  # (another class under a medium's name: its internals are not known here)
    impl = importlib.import_module(found[1]).delete_if_unchanged
    return lambda pairs: impl(backend, pairs)
