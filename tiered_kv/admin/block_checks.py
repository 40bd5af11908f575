"""The block a namespace stores (its dtype and shape, so its size), and checking a stored block
as the store would: against that block when the namespace is known, else with its declared size
bounded — a lying header never makes a tool allocate what it declares. An encrypted block is
checked as far as a tool without its key can: header, frame table and every frame's check over
the ciphertext (its payload is None)."""

from __future__ import annotations

from tiered_kv.errors import CorruptBlock
from tiered_kv.keys import Namespace
from tiered_kv.store.codec import MAX_RAW_BYTES, BlockCodec, BlockLayout, Sealing
from tiered_kv.store.records import split_key


def block_layout(namespace: Namespace | None) -> BlockLayout | None:
    """The block every stored block of ``namespace`` must be (None: namespace unknown)."""
    return None if namespace is None else BlockLayout(namespace.dtype, namespace.block_shape)


def check_block(key: bytes, value, namespace: Namespace | None, *, decode: bool = True,
                sealing: Sealing | None = None, keyless: bool = True):
    """Validate a stored block as the store would: against its namespace's block (dtype, shape)
    when the namespace is known, else with its declared raw length bounded (MAX_RAW_BYTES).
    (header, payload) with ``decode`` (payload None for an encrypted block whose framing is
    sound), the header alone without; CorruptBlock (one-line detail) when it fails.

    ``sealing``: read as a replica holding that tenant's key does (a plain block is then an
    ``unencrypted`` CorruptBlock, one sealed under another key ``wrong_key``). Without it a
    sealed block is sound when all a reader without the key can check is (``keyless``), or a
    ``no_key`` CorruptBlock, as a replica without a secret counts it (``keyless`` False)."""
    digest, block = split_key(key)
    layout = block_layout(namespace)
    if decode:
        try:
            return BlockCodec().decode(value, namespace=digest, key=block, expect=layout, sealing=sealing)
        except CorruptBlock as exc:
            if exc.reason != "no_key" or not keyless:  # no_key: all checkable without the key was sound
                raise
            return BlockCodec.read_header(value, expect=layout, max_raw=MAX_RAW_BYTES), None
    return BlockCodec.read_header(value, namespace=digest, key=block, expect=layout, max_raw=MAX_RAW_BYTES)
