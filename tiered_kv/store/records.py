"""Reserved entries stored next to the blocks: one namespace record per namespace.

A tier holds stored blocks under ``namespace digest (16 bytes) || block key (16 bytes)``. The
digest cannot be turned back into a model id, so the store also writes, once per process and
tier, the namespace's :meth:`~tiered_kv.keys.Namespace.describe` JSON under
``b"tkv-ns:" + digest``. Tools (the CLI) read it to report model id, dtype and shape per
namespace. Reserved keys never have the length of a block key, so code that scans a tier tells
them apart with :func:`is_block_key` / :func:`is_reserved`.
"""

from __future__ import annotations

import json
import logging
import time

from tiered_kv.errors import BackendError, CorruptBlock
from tiered_kv.keys import KEY_BYTES, Namespace

log = logging.getLogger(__name__)

DIGEST_BYTES = 16
STORAGE_KEY_BYTES = DIGEST_BYTES + KEY_BYTES  # what a tier stores a block under
RESERVED_PREFIX = b"tkv-"
NAMESPACE_PREFIX = b"tkv-ns:"
RECORD_CHECK_S = 60.0  # how often the write path re-checks a tier's namespace record


def namespace_key(digest: bytes) -> bytes:
    """The reserved key of the record of the namespace with ``digest``."""
    return NAMESPACE_PREFIX + bytes(digest)


def encode_namespace(namespace: Namespace) -> bytes:
    """The record value: the namespace's fields as compact, sorted JSON."""
    return json.dumps(namespace.describe(), sort_keys=True, separators=(",", ":")).encode()


def decode_namespace(key: bytes, value: bytes) -> Namespace:
    """The namespace a record describes; CorruptBlock when it is not valid or its digest
    differs from the one in its key."""
    try:
        data = json.loads(bytes(value).decode())
        namespace = Namespace.from_dict(data, strict=False)
    except (ValueError, TypeError, AttributeError) as exc:  # ConfigError is a ValueError
        raise CorruptBlock(f"unreadable namespace record: {exc}") from None
    if namespace.digest() != key[len(NAMESPACE_PREFIX):]:
        raise CorruptBlock("namespace record does not hash to the digest in its key",
                           reason="namespace_mismatch")
    return namespace


def is_block_key(key: bytes) -> bool:
    """Whether ``key`` has the shape of a stored block's key (digest || block key)."""
    return len(key) == STORAGE_KEY_BYTES


def is_namespace_key(key: bytes) -> bool:
    return key.startswith(NAMESPACE_PREFIX) and len(key) == len(NAMESPACE_PREFIX) + DIGEST_BYTES


def is_reserved(key: bytes) -> bool:
    """Whether ``key`` is one of tiered-kv's reserved entries (not a block)."""
    return not is_block_key(key) and key.startswith(RESERVED_PREFIX)


def split_key(key: bytes) -> tuple[bytes, bytes]:
    """(namespace digest, block key) of a stored block's key."""
    return key[:DIGEST_BYTES], key[DIGEST_BYTES:]


class RecordKeeper:
    """Keeps the namespace record next to the blocks of each lower tier. Checked on the write
    path (never on open: no Redis round trip there), at most every ``every`` seconds per tier,
    so a record that LRU, a TTL or an operator removed comes back."""

    def __init__(self, namespace: Namespace, every: float = RECORD_CHECK_S) -> None:
        self.namespace = namespace
        self.every = every
        self._due: dict[str, float] = {}  # tier name -> when to check its record again

    def keep(self, tier) -> None:
        """Write ``tier``'s record when it is missing (an EncodedTier: ``name``, ``ns``, ``backend``)."""
        now = time.monotonic()
        if now < self._due.get(tier.name, 0.0):
            return
        self._due[tier.name] = now + self.every
        key = namespace_key(tier.ns)
        try:
            if not tier.backend.contains_many([key])[0]:
                tier.backend.put_many([(key, encode_namespace(self.namespace))])
        except BackendError as exc:  # the blocks' own put reports the outage
            self._due[tier.name] = now
            log.debug("%s tier: namespace record not written: %s", tier.name, exc)
