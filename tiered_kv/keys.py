"""Namespaces and chained content keys of full token blocks.

``key_0 = H(namespace_digest || tokens_0 || extras_0)``, ``key_i = H(key_{i-1} || tokens_i ||
extras_i)``; tokens are little-endian int32 (int64 when the namespace says so). Keys are 16 bytes
and depend only on their inputs, never on the process or ``PYTHONHASHSEED``. This module is
scheduler-side: it never imports torch.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields

import xxhash

from tiered_kv.dtypes import itemsize
from tiered_kv.errors import ConfigError, TokenError
from tiered_kv.kv_groups import KVGroup, check_groups, entry_plan, state_groups

FORMAT_VERSION = 1
KEY_BYTES = 16
CANONICAL_LAYOUT = "LKTHD"  # a block's payload as [layers, K/V, tokens, heads, dim]
WITHHELD_SALT = "<withheld: tenant {}>"  # the cache_salt of a namespace read back from a tier's record


def _blake2b_128(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def _sha256_128(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()[:16]


HASHES: dict[str, Callable[[bytes], bytes]] = {
    "xxh3_128": xxhash.xxh3_128_digest,
    "blake2b_128": _blake2b_128,
    "sha256_128": _sha256_128,
}

# array typecodes of exactly 4 and 8 bytes on this platform
_INT32 = "i" if array("i").itemsize == 4 else "l"
_INT64 = "q"


@dataclass(frozen=True)
class Namespace:
    """Everything that changes the KV bytes of the same tokens. Equal namespaces share blocks."""

    model_id: str  # model name or path as the engine knows it
    dtype: str  # KV dtype name, e.g. "bfloat16"
    num_layers: int  # attention layers whose KV a block carries
    num_kv_heads: int  # KV heads of this shard (after tensor parallel split)
    head_dim: int  # per-head dimension
    block_size: int  # tokens per block
    revision: str = ""  # weights fingerprint / revision; empty when unknown
    layout: str = CANONICAL_LAYOUT  # payload layout; other values name an engine's own (SGLang pages)
    tp_rank: int = 0  # tensor-parallel rank of this shard
    tp_size: int = 1  # tensor-parallel world size
    cache_salt: str = field(default="", repr=False)  # tenant salt (a secret): different salts never share blocks
    hash_algo: str = "xxh3_128"  # one of HASHES; a cryptographic one for multi-tenant use
    token_bytes: int = 4  # 4 (int32) or 8 (int64) bytes per token id in the key
    format_version: int = FORMAT_VERSION  # stored-block format version
    groups: tuple[KVGroup, ...] = ()  # KV cache groups (MLA, sliding, hybrid); () = one full-attention K/V

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size", "tp_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"namespace.{name} must be a positive integer, got {value!r}")
        if not isinstance(self.tp_rank, int) or not 0 <= self.tp_rank < self.tp_size:
            raise ConfigError(f"namespace.tp_rank must be in [0, {self.tp_size}), got {self.tp_rank!r}")
        if not self.model_id:
            raise ConfigError("namespace.model_id must not be empty")
        if self.hash_algo not in HASHES:
            raise ConfigError(f"namespace.hash_algo must be one of {sorted(HASHES)}, got {self.hash_algo!r}")
        if self.token_bytes not in (4, 8):
            raise ConfigError(f"namespace.token_bytes must be 4 or 8, got {self.token_bytes!r}")
        if self.groups:
            object.__setattr__(self, "groups", tuple(self.groups))
            if not all(isinstance(g, KVGroup) for g in self.groups):
                raise ConfigError("namespace.groups must be KVGroup values")
            check_groups(self.groups, self.block_size)
            if any(size % itemsize(self.dtype) for size in entry_plan(self.groups, self.block_size, self.dtype).sizes):
                raise ConfigError(f"every KV group's part must be whole {self.dtype} elements")

    def canonical(self) -> bytes:
        """A stable text form of every field, the input of :meth:`digest`."""
        # (a namespace without groups keeps the digest it had before groups existed)
        parts = [f"{f.name}={getattr(self, f.name)!r}" for f in fields(self) if f.name != "groups" or self.groups]
        return ("tiered-kv namespace\n" + "\n".join(parts)).encode()

    def digest(self) -> bytes:
        """16-byte fingerprint of this namespace (cached)."""
        cached = self.__dict__.get("_digest")
        if cached is None:
            cached = HASHES[self.hash_algo](self.canonical())
            object.__setattr__(self, "_digest", cached)
        return cached

    @property
    def hasher(self) -> Callable[[bytes], bytes]:
        return HASHES[self.hash_algo]

    @property
    def block_shape(self) -> tuple[int, ...]:
        """Payload shape of one stored entry: ``[num_layers, 2, block_size, num_kv_heads, head_dim]``,
        or, with groups, ``[entry elements]`` of :func:`tiered_kv.kv_groups.entry_plan`."""
        if self.groups:
            return (self.entry_plan.entry_nbytes // itemsize(self.dtype),)
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def entry_plan(self):
        """Byte offsets of each group's part in an entry (namespaces with groups)."""
        return entry_plan(self.groups, self.block_size, self.dtype)

    @property
    def has_state(self) -> bool:
        """Whether a prefix hit also needs a state entry at its last block (recurrent layers)."""
        return bool(state_groups(self.groups))

    def state_key(self, key: bytes) -> bytes:
        """The key of the state entry at the end of block ``key``."""
        from tiered_kv.kv_groups import state_key

        return state_key(self.hasher, key)

    @property
    def tenant(self) -> bytes:
        """The tenant label of this namespace's blocks in the tiers (:func:`tenant_label`)."""
        pinned = self.__dict__.get("_tenant")  # (a namespace read back from a record: :meth:`recorded`)
        return pinned if pinned is not None else tenant_label(self.cache_salt)

    def num_full_blocks(self, num_tokens: int) -> int:
        return num_tokens // self.block_size

    @classmethod
    def from_dict(cls, data: Mapping, *, strict: bool = True) -> Namespace:
        """The inverse of :meth:`describe`; unknown fields are a TypeError when ``strict``, and so
        is ``data`` that is no mapping (a namespace file holding a JSON list)."""
        if not isinstance(data, Mapping):
            raise TypeError(f"namespace fields must be a mapping (a JSON object), got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if strict and unknown:
            raise TypeError(f"unknown namespace fields {sorted(unknown)}")
        values = {k: v for k, v in data.items() if k in known}
        if values.get("groups"):
            values["groups"] = tuple(KVGroup.from_dict(g) for g in values["groups"])
        return cls(**values)

    @classmethod
    def recorded(cls, data: Mapping, digest: bytes, tenant: bytes) -> Namespace:
        """A salted namespace as a tier's record describes it (``data``: its other fields). Salts
        are never stored, so it is known by its ``digest`` and ``tenant`` label: :meth:`digest`,
        :attr:`tenant` and so :func:`block_keys` (which start from the digest) are the writer's;
        ``cache_salt`` is :data:`WITHHELD_SALT` (naming the label), so :meth:`canonical` and
        ``dataclasses.replace`` do not give that namespace back."""
        given = {k: v for k, v in data.items() if k != "cache_salt"}
        ns = cls.from_dict({**given, "cache_salt": WITHHELD_SALT.format(bytes(tenant).hex())}, strict=False)
        object.__setattr__(ns, "_digest", bytes(digest))
        object.__setattr__(ns, "_tenant", bytes(tenant))
        return ns

    def describe(self) -> dict:
        """Every field (``cache_salt`` too: for this process, never for a tier or a log)."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "groups"}
        if self.groups:
            out["groups"] = [g.describe() for g in self.groups]
        return out


def leading_present(present: Sequence[bool]) -> int:
    """How many leading blocks of a chain are present (a chained key is only reusable after
    every block before it)."""
    n = 0
    while n < len(present) and present[n]:
        n += 1
    return n


def tenant_label(cache_salt: str) -> bytes:
    """The tenant a ``cache_salt`` names, as the tiers record it for quotas and usage: 8 bytes
    of its hash (the salt itself never leaves the process), or ``b""`` for no salt."""
    if not cache_salt:
        return b""
    return hashlib.blake2b(cache_salt.encode(), digest_size=8, person=b"tkv-tenant").digest()


def key_extra(parts: Iterable[tuple[str, object]]) -> str | None:
    """A request's key extra (LoRA, salt, media, folded into every key of it) from ``(name,
    value)`` parts, as ``name=value;name=value`` with ``\\`` and ``;`` of a value escaped (a
    backslash before each): different parts never give the same text (``("a;b",)`` and
    ``("a", "b")`` joined bare did), and parts without those give the text they always did (so
    their stored blocks stay found). None for no parts."""
    out = []
    for name, value in parts:
        if not name or any(c in name for c in "=;\\"):
            raise ValueError(f"a key extra's name must be non-empty without '=', ';' or '\\': {name!r}")
        out.append(f"{name}=" + str(value).replace("\\", "\\\\").replace(";", "\\;"))
    return ";".join(out) or None


def tokens_to_bytes(tokens: Sequence[int], token_bytes: int = 4) -> bytes:
    """Little-endian fixed-width bytes of ``tokens``; raises TokenError when one does not fit."""
    try:
        arr = array(_INT32 if token_bytes == 4 else _INT64, tokens)
    except OverflowError as exc:
        raise TokenError(f"token id does not fit in {token_bytes} bytes: {exc}") from None
    except TypeError as exc:
        raise TokenError(f"token ids must be integers: {exc}") from None
    if sys.byteorder != "little":
        arr.byteswap()
    return arr.tobytes()


def block_keys(
    namespace: Namespace,
    tokens: Sequence[int],
    *,
    parent: bytes | None = None,
    start_block: int = 0,
    lora: str | int | None = None,
    extras: Mapping[int, bytes] | None = None,
) -> list[bytes]:
    """Chained keys of the full blocks of ``tokens``; a partial tail block gets no key.

    ``parent`` is the key of the block before ``tokens[0]`` (None: ``tokens`` start the prompt).
    ``start_block`` numbers the first block for ``extras`` (per-block bytes, e.g. multimodal
    hashes); ``lora`` is folded into every block.
    """
    if (parent is None) != (start_block == 0):
        raise TokenError("parent must be given exactly when start_block > 0")
    bs = namespace.block_size
    width = namespace.token_bytes
    n = len(tokens) // bs
    if n == 0:
        return []
    data = tokens_to_bytes(tokens[: n * bs], width)
    step = bs * width
    h = namespace.hasher
    prev = namespace.digest() if parent is None else parent
    common = b"" if lora is None else _frame(b"lora", str(lora).encode())
    keys: list[bytes] = []
    append = keys.append
    if not extras and not common:
        for off in range(0, n * step, step):
            prev = h(prev + data[off : off + step])
            append(prev)
        return keys
    for i in range(n):
        mm = extras.get(start_block + i, b"") if extras else b""
        extra = common + _frame(b"xtra", mm) if mm else common
        block = data[i * step : (i + 1) * step]
        prev = h(prev + block + b"\x00extra:" + extra) if extra else h(prev + block)
        append(prev)
    return keys


def _frame(tag: bytes, data: bytes) -> bytes:
    """``tag || len || data``: LoRA id and extras stay distinguishable once concatenated."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TokenError(f"block extras must be bytes, got {type(data).__name__}")
    return tag + len(data).to_bytes(4, "little") + bytes(data)


class KeyChain:
    """Keys of one request's full blocks, extended incrementally as tokens arrive."""

    def __init__(self, namespace: Namespace, *, lora: str | int | None = None,
                 extras: Mapping[int, bytes] | None = None) -> None:
        self.namespace = namespace
        self.lora = lora
        self.extras = dict(extras or {})
        self.keys: list[bytes] = []

    def update(self, tokens: Sequence[int]) -> list[bytes]:
        """Extend to all full blocks of ``tokens`` (the whole sequence so far); returns all keys."""
        bs = self.namespace.block_size
        have = len(self.keys)
        if len(tokens) // bs > have:
            self.keys.extend(block_keys(
                self.namespace, tokens[have * bs :],
                parent=self.keys[-1] if have else None, start_block=have,
                lora=self.lora, extras=self.extras,
            ))
        return self.keys
