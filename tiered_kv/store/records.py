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

The namespace record also carries the store's **restore and prefill estimates**
(:class:`~tiered_kv.store.restore_costs.RestoreCosts`), as its member ``restore_costs``::

    {...the namespace's fields..., "restore_costs": {"format": 1, "tier": "disk", "written": 1764000000.0,
     "restore": {"disk": {"observed": 12, "samples": [[nbytes, seconds], ...], "fit": [latency_s, per_byte_s]},
                 "host": {...}},
     "prefill": {"observed": 40, "samples": [[new_tokens, attention_work, seconds], ...],
                 "fit": [per_step_s, per_token_s, per_pair_s]}}}

(``tier``: the name the writing store gave the tier holding it, so a tool that opened that tier
by URL knows which estimates are its; ``pinned`` beside ``samples``: an injected estimate;
``fit`` is for readers, recomputed from the samples on load). Inside the namespace record rather
than under a key of its own, because tools take any other entry for an orphan (``verify --fix``
removes it, ``inspect`` counts it as foreign) and ``copy`` carries namespace records only; a
namespace's readers ignore members that are not namespace fields. :class:`CostsKeeper` writes it
into the record of every lower tier holding one, at most every ``COSTS_SAVE_S`` seconds when the
estimates moved and at flush / close, reads it back from the first tier holding one when a store or the scheduler's index
opens (a restarted engine starts with the last run's figures), and, for the index (which cannot
observe), every ``COSTS_REFRESH_S`` seconds after.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections.abc import Mapping, Sequence
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
COSTS_FORMAT = 1
COSTS_SAVE_S = 60.0  # a store writes its estimates at most this often (and at flush / close)
COSTS_REFRESH_S = 60.0  # the scheduler's lookup index reads them back this often
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
    return hashlib.blake2b(bytes(digest) + _dump(members), digest_size=16, person=b"tkv-ns-record").hexdigest()


def _dump(doc: Mapping) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def _parsed(value):
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
    return _dump(record_doc(namespace))


def decode_namespace(key: bytes, value: bytes) -> Namespace:
    """The namespace a record describes (a salted one: :meth:`Namespace.recorded`); CorruptBlock
    when it is not valid, or does not match the digest in its key (its seal, for a salted one)."""
    digest = bytes(key[len(NAMESPACE_PREFIX):])
    try:
        data = _parsed(value)
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
        doc = _parsed(value)
    except (ValueError, TypeError):
        return None
    if not isinstance(doc, dict) or not doc.get(SALT_FIELD):
        return None
    try:
        namespace = decode_namespace(key, value)
    except CorruptBlock:
        return _dump({k: v for k, v in doc.items() if k != SALT_FIELD})
    known = {f.name for f in fields(Namespace)} | {TENANT_MEMBER, SEAL_MEMBER}
    return _dump({**{k: v for k, v in doc.items() if k not in known}, **record_doc(namespace)})


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


# -- the estimates in the namespace record ---------------------------------------------------------
def encode_costs(namespace: Namespace, snapshot: Mapping, tier: str) -> bytes:
    """The namespace record carrying :meth:`RestoreCosts.snapshot` (with format, tier and time)."""
    doc = record_doc(namespace)
    doc[COSTS_MEMBER] = {"format": COSTS_FORMAT, "tier": tier, "written": round(time.time(), 3), **snapshot}
    return _dump(doc)


def decode_costs(value: bytes) -> dict | None:
    """The estimates a namespace record carries (None: none); CorruptBlock when unreadable."""
    try:
        doc = _parsed(value)
    except (ValueError, TypeError) as exc:
        raise CorruptBlock(f"unreadable namespace record: {exc}") from None
    costs = doc.get(COSTS_MEMBER) if isinstance(doc, dict) else None
    if costs is None:
        return None
    if not isinstance(costs, dict) or costs.get("format") != COSTS_FORMAT:
        raise CorruptBlock("restore costs of another format")
    return costs


def read_costs(tiers: Sequence[tuple[str, object]], digest: bytes) -> dict | None:
    """The estimates in the namespace record of the first of ``tiers`` (name, medium) holding some."""
    key = namespace_key(digest)
    for name, backend in tiers:
        try:
            value = backend.get_many([key])[0]
            costs = decode_costs(value) if value is not None else None
            if costs is not None:
                return costs
        except (BackendError, CorruptBlock) as exc:
            log.debug("%s tier: restore costs not read: %s", name, exc)
    return None


class CostsKeeper:
    """Keeps ``costs`` (a RestoreCosts) and ``namespace``'s record in the lower ``tiers`` (name,
    medium) in step. ``writes``: a store, which reads the estimates when created (its worker's
    start-up), observes and writes (every ``every`` seconds when they moved, and on :meth:`save`);
    else the scheduler's index, which reads them on its thread at once and every ``every`` seconds
    after (never on the scheduler's path: a remote tier may be slow to answer; ``loaded`` is set
    once the first read is done)."""

    def __init__(self, costs, namespace: Namespace, tiers: Sequence[tuple[str, object]], *, writes: bool,
                 every: float) -> None:
        self.costs, self.namespace, self.tiers, self.writes = costs, namespace, list(tiers), writes
        self.digest = namespace.digest()
        self._written = -1  # costs.changes when last written or read
        self._seen: float | None = None  # "written" of the record last read
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.loaded = threading.Event()
        background = bool(self.tiers) and every > 0
        if writes or not background:
            self.load()
        self._thread = None
        if background:
            self._thread = threading.Thread(target=self._run, args=(every,), daemon=True,
                                            name="tiered-kv-costs")
            self._thread.start()

    def load(self) -> bool:
        """Replace the estimates by the record's (when there is one, newer than the last read)."""
        try:
            doc = read_costs(self.tiers, self.digest)
            if doc is None or doc.get("written") == self._seen:
                return False
            self.costs.restore_snapshot(doc)
            self._seen, self._written = doc.get("written"), self.costs.changes
            return True
        except Exception as exc:  # estimates are an optimisation: never a reason not to start
            log.warning("restore costs not read: %r", exc)
            return False
        finally:
            self.loaded.set()

    def save(self) -> bool:
        """Write the estimates when they moved since the last write (or read), into the namespace
        record of every tier holding one (a tier holding nothing of the namespace gets none)."""
        with self._lock:
            changes = self.costs.changes
            if not self.writes or changes == self._written or self.costs.empty():
                return False
            snapshot, key = self.costs.snapshot(), namespace_key(self.digest)
            for name, backend in self.tiers:
                try:
                    if backend.contains_many([key])[0]:
                        backend.put_many([(key, encode_costs(self.namespace, snapshot, name))])
                except Exception as exc:  # (a down tier: the blocks' own writes report it)
                    log.debug("%s tier: restore costs not written: %r", name, exc)
            self._written = changes
            return True

    def _run(self, every: float) -> None:
        wait = every if self.loaded.is_set() else 0.0  # the index's first read: at once
        while not self._stop.wait(wait):
            wait = every
            try:
                self.save() if self.writes else self.load()
            except Exception as exc:  # a closing medium: the next round (or close) tries again
                log.debug("restore costs: %r", exc)

    def close(self) -> None:
        """Stop the thread (the owner saves once more while its media are open)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
