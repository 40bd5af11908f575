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
from dataclasses import fields

from tiered_kv.errors import CorruptBlock
from tiered_kv.keys import KEY_BYTES, Namespace

DIGEST_BYTES = 16
STORAGE_KEY_BYTES = DIGEST_BYTES + KEY_BYTES  # what a tier stores a block under
RESERVED_PREFIX = b"tkv-"
NAMESPACE_PREFIX = b"tkv-ns:"


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
        known = {f.name for f in fields(Namespace)}
        namespace = Namespace(**{k: v for k, v in data.items() if k in known})
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
