"""Reserved entries stored next to the blocks: one namespace record per namespace (with the
restore estimates).

A tier holds stored blocks under ``namespace digest (16 bytes) || block key (16 bytes)``. The
digest cannot be turned back into a model id, so the store also writes, once per process and
tier, the namespace's fields as JSON under ``b"tkv-ns:" + digest``. Tools (the CLI) read it to
report model id, dtype and shape per namespace. Reserved keys never have the length of a block
key, so code that scans a tier tells them apart with :func:`is_block_key` / :func:`is_reserved`.

A record never holds the ``cache_salt`` (a secret): a salted namespace's record has ``tenant``
(its 8-byte label in hex, :func:`~tiered_kv.keys.tenant_label`) and ``seal`` (a hash of its
other members and the digest in its key) instead. Without the salt no reader can recompute the
digest, so the seal is what binds such a record to its key: a record moved under another key or
altered is ``namespace_mismatch``, as an unsalted one that does not hash to its digest is (a
writer could forge either: anyone who can write a record can write blocks). Records of older
versions hold the salt: they are still read (and checked against their digest), never shown,
and rewritten without it (:func:`scrubbed`) by a store of that namespace, ``copy`` and
``verify --fix``.

The namespace record also carries the store's restore and prefill estimates, as its member
``restore_costs`` (:mod:`tiered_kv.store.cost_records`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Mapping
from dataclasses import fields

from tiered_kv.errors import BackendError, CorruptBlock
from tiered_kv.keys import KEY_BYTES, Namespace

log = logging.getLogger(__name__)

DIGEST_BYTES = 16
STORAGE_KEY_BYTES = DIGEST_BYTES + KEY_BYTES  # what a tier stores a block under
RESERVED_PREFIX = b"tkv-"
NAMESPACE_PREFIX = b"tkv-ns:"
COSTS_MEMBER = "restore_costs"  # the namespace record's member holding the estimates
TENANT_MEMBER = "tenant"  # a salted namespace's tenant label (hex), in place of its salt
SEAL_MEMBER = "seal"  # hash of a salted namespace's record and the digest in its key
SALT_FIELD = "cache_salt"  # never in a record this version writes
RECORD_CHECK_S = 60.0  # how often the write path re-checks a tier's namespace record
MAX_RECORD_DEPTH = 32  # nesting a record may have (the estimates' samples are 6 deep)


def namespace_key(digest: bytes) -> bytes:
    """The reserved key of the record of the namespace with ``digest``."""
    return NAMESPACE_PREFIX + bytes(digest)


def record_doc(namespace: Namespace) -> dict:
    """The record's members for ``namespace``: its fields without the salt (with ``tenant`` and
    ``seal`` when it has one)."""
    doc = namespace.describe()
    del doc[SALT_FIELD]
    if namespace.cache_salt:
        doc[TENANT_MEMBER] = namespace.tenant.hex()
        doc[SEAL_MEMBER] = _seal(doc, namespace.digest())
    return doc


def _seal(doc: Mapping, digest: bytes) -> str:
    members = {k: v for k, v in doc.items() if k not in (SEAL_MEMBER, COSTS_MEMBER)}
    return hashlib.blake2b(bytes(digest) + dump_doc(members), digest_size=16, person=b"tkv-ns-record").hexdigest()


def dump_doc(doc: Mapping) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def parse_doc(value):
    """A stored record's JSON document; ValueError when it is none, also when it nests deeper
    than MAX_RECORD_DEPTH: one past the parser's recursion limit raised RecursionError, and one
    just under it made the seal's ``json.dumps`` raise it, out of every reader of the record (a
    salted namespace's saves failed on it)."""
    try:
        doc = json.loads(bytes(value).decode())
    except RecursionError:
        raise ValueError("record nested too deeply") from None
    level = [doc]
    for _ in range(MAX_RECORD_DEPTH):
        level = [v for d in level if isinstance(d, (dict, list)) for v in (d.values() if isinstance(d, dict) else d)]
        if not level:
            return doc
    raise ValueError(f"record nested more than {MAX_RECORD_DEPTH} deep")


def encode_namespace(namespace: Namespace) -> bytes:
    """The record value: :func:`record_doc` as compact, sorted JSON."""
    return dump_doc(record_doc(namespace))


def decode_namespace(key: bytes, value: bytes) -> Namespace:
    """The namespace a record describes (a salted one: :meth:`Namespace.recorded`); CorruptBlock
    when it is not valid, or does not match the digest in its key (its seal, for a salted one)."""
    digest = bytes(key[len(NAMESPACE_PREFIX):])
    try:
        data = parse_doc(value)
        tenant = data.get(TENANT_MEMBER)
        if tenant is None:  # unsalted (or an older version's record, salt and all)
            namespace = Namespace.from_dict(data, strict=False)
        elif not isinstance(tenant, str) or not 0 < len(tenant) <= 32:
            raise ValueError("tenant label is not 1 to 16 bytes in hex")
        else:
            namespace = Namespace.recorded(data, digest, bytes.fromhex(tenant))
    except (ValueError, TypeError, AttributeError) as exc:  # ConfigError is a ValueError
        raise CorruptBlock(f"unreadable namespace record: {exc}") from None
    if tenant is not None and data.get(SEAL_MEMBER) != _seal(data, digest):
        raise CorruptBlock("namespace record does not match the digest in its key (its seal)",
                           reason="namespace_mismatch")
    if tenant is None and namespace.digest() != digest:
        raise CorruptBlock("namespace record does not hash to the digest in its key",
                           reason="namespace_mismatch")
    return namespace


def scrubbed(key: bytes, value) -> bytes | None:
    """``value`` rewritten without the salt an older version stored in it (its other members,
    such as the estimates, kept); None when it holds none. A record that does not decode loses
    the salt all the same (it stays broken: tools report it)."""
    try:
        doc = parse_doc(value)
    except (ValueError, TypeError):
        return None
    if not isinstance(doc, dict) or not doc.get(SALT_FIELD):
        return None
    try:
        namespace = decode_namespace(key, value)
    except CorruptBlock:
        return dump_doc({k: v for k, v in doc.items() if k != SALT_FIELD})
    known = {f.name for f in fields(Namespace)} | {TENANT_MEMBER, SEAL_MEMBER}
    return dump_doc({**{k: v for k, v in doc.items() if k not in known}, **record_doc(namespace)})


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
    so a record that LRU, a TTL or an operator removed comes back, and (a salted namespace's,
    read rather than probed) one an older version wrote with the salt in it is rewritten."""

    def __init__(self, namespace: Namespace, every: float = RECORD_CHECK_S) -> None:
        self.namespace = namespace
        self.every = every
        self._due: dict[str, float] = {}  # tier name -> when to check its record again

    def keep(self, tier) -> None:
        """Write ``tier``'s record when it is missing or holds the salt (an EncodedTier: ``name``,
        ``ns``, ``backend``)."""
        now = time.monotonic()
        if now < self._due.get(tier.name, 0.0):
            return
        self._due[tier.name] = now + self.every
        key = namespace_key(tier.ns)
        try:
            if not self.namespace.cache_salt:
                if not tier.backend.contains_many([key])[0]:
                    tier.backend.put_many([(key, encode_namespace(self.namespace))])
                return
            value = tier.backend.get_many([key])[0]  # (an older version's record holds the salt)
            value = encode_namespace(self.namespace) if value is None else scrubbed(key, value)
            if value is not None:
                tier.backend.put_many([(key, value)])
        except BackendError as exc:  # the blocks' own put reports the outage
            self._due[tier.name] = now
            log.debug("%s tier: namespace record not written: %s", tier.name, exc)
