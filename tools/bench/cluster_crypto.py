"""bench_cluster's encryption at rest: what sealing and opening cost on the client, measured
through the remote tier's own code, and the sealed blocks the "ours, sealed" phases store.

Two :class:`~tiered_kv.store.encoded_tier.EncodedTier` objects over one in-memory backend (no
network): the plain tier (no secret) and the sealed one (``encryption_secret`` set, one tenant).
Each op is the tier's own call, per job of the store's shape (``cluster_run.put_jobs`` /
``get_jobs``), on a thread pool as the store's transfer pool runs them:

- ``encode``: ``tier.encode`` of each block into this thread's reused arena (as the store's write
  jobs encode), then the plain tier's ``put_blobs`` (stores as is);
- ``encode+seal``: the same, then the sealed tier's ``put_blobs``, which seals every block under
  the tenant's key (``BlockCodec.seal``): the write path with encryption;
- ``seal``: the sealed tier's ``put_blobs`` of blocks encoded already (sealing alone);
- ``decode``: the plain tier's ``read_into`` of plain blocks into reused buffers;
- ``open+decode``: the sealed tier's ``read_into`` of sealed blocks (each frame checked,
  authenticated and decrypted, then decoded): the read path with encryption.

GB/s are payload bytes (the blocks' uncompressed KV) per wall second; ``cpu_s_per_gb`` is this
process's CPU per payload GB (steadier than wall on a busy machine). The cost of encryption is
``encode+seal`` beside ``encode`` and ``open+decode`` beside ``decode``
(:func:`cluster_report.crypto_figures`)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from tiered_kv.config import Secret, TieredKVConfig
from tiered_kv.keys import tenant_label
from tiered_kv.store.codec_sealed import ENV_ENTRY, ENV_HEAD, INNER, OVERHEAD
from tiered_kv.store.encoded_tier import EncodedTier
from tiered_kv.store.metrics import StoreMetrics

from .cluster_data import Encoded
from .cluster_run import get_jobs, put_jobs

SECRET = b"bench-cluster: a throwaway secret, never a real one"
TENANT = tenant_label("bench-cluster tenant")  # a tenant, as a request's cache_salt names one
WARM_BYTES = 64 << 20  # of payload each op runs untimed before it is timed
OPS = ("encode", "encode+seal", "seal", "decode", "open+decode")
PAIRS = {"write": ("encode", "encode+seal"), "read": ("decode", "open+decode")}  # plain, sealed


class MemoryBackend:
    """Just what EncodedTier calls on a write and a read: stored blobs by name, kept only when
    asked (``keep``), so timed puts cost no copy; reads visit the blobs it was given."""

    def __init__(self, blobs: dict[bytes, bytes] | None = None, keep: bool = False) -> None:
        self.blobs = blobs if blobs is not None else {}
        self.keep = keep

    def put_many(self, items: Sequence[tuple[bytes, bytes]], tenant: bytes = b"") -> list[bool]:
        if self.keep:
            self.blobs.update((k, bytes(v)) for k, v in items)
        return [True] * len(items)

    def visit_many(self, keys: Sequence[bytes], visitor: Callable[[int, memoryview], None]) -> list[bool]:
        for i, k in enumerate(keys):
            visitor(i, memoryview(self.blobs[k]))
        return [True] * len(keys)

    def visit_split(self, keys: Sequence[bytes], outs, visitor) -> list[bool]:
        return self.visit_many(keys, lambda i, value: visitor(i, None, value))  # never split


def tiers_of(enc: Encoded, layer_groups: int) -> tuple[EncodedTier, EncodedTier]:
    """The remote tier of ``enc``'s namespace and codec, plain and sealed (each on its own memory
    backend; a read swaps in the blobs it reads)."""
    cfg = TieredKVConfig().remote
    made = [EncodedTier(cfg, MemoryBackend(), enc.namespace, StoreMetrics(), enc.codec, layer_groups, secret)
            for secret in (None, Secret(SECRET))]
    for tier in made:
        if tier.codec.level != enc.block_codec.level:
            tier.codec = enc.block_codec  # the level bench_cluster encoded with
    return made[0], made[1]


def block_keys_of(enc: Encoded) -> list[bytes]:
    """The tier's keys (the stored names less the namespace digest)."""
    cut = len(enc.namespace.digest())
    return [k[cut:] for k in enc.keys]


def seal_blocks(enc: Encoded, layer_groups: int) -> Encoded:
    """``enc``'s blocks sealed for :data:`TENANT` by the sealed tier's ``put_blobs`` (what the
    store stores with a secret), under the same names: what the "ours, sealed" phases move."""
    _, sealed = tiers_of(enc, layer_groups)
    sealed.backend = MemoryBackend(keep=True)
    keys = block_keys_of(enc)
    sealed.put_blobs(list(zip(keys, enc.blobs)), len(keys) * enc.payload_bytes, tenant=TENANT)
    return replace(enc, blobs=[sealed.backend.blobs[name] for name in enc.keys])


def expected_overhead(frames: int) -> int:
    """Bytes a sealed block grows by: its frame table, the plain block's checksum and body check
    in frame 0, a nonce and a tag per frame; ``frames``: the plain block's segments, plus one for
    the segment table when segmented."""
    return ENV_HEAD.size + frames * (ENV_ENTRY.size + OVERHEAD) + INNER.size


def overhead(plain: Encoded, sealed: Encoded) -> dict:
    """Stored bytes per block, plain and sealed, and what sealing adds (measured and expected)."""
    n = len(plain.blobs)
    p, s = plain.stored_bytes / n, sealed.stored_bytes / n
    frames = plain.segments + 1 if plain.segments > 1 else 1
    return {"plain_stored_bytes_per_block": round(p, 1), "sealed_stored_bytes_per_block": round(s, 1),
            "overhead_bytes_per_block": round(s - p, 1), "overhead_pct": round(100 * (s - p) / p, 4),
            "frames": frames, "expected_overhead_bytes": expected_overhead(frames)}


class _Arena(threading.local):
    """This thread's reused memory (touched once, as the store's write arena and host slots)."""

    buf = bytearray()

    def views(self, count: int, stride: int) -> list[memoryview]:
        if len(self.buf) < count * stride:
            self.buf = bytearray(count * stride)
        whole = memoryview(self.buf)
        return [whole[i * stride : (i + 1) * stride] for i in range(count)]


class CryptoBench:
    """The client-side ops of one kind on ``threads`` threads."""

    def __init__(self, plain: Encoded, sealed: Encoded, layer_groups: int, threads: int) -> None:
        self.plain, self.sealed, self.threads = plain, sealed, threads
        self.tier, self.sealed_tier = tiers_of(plain, layer_groups)
        self.keys = block_keys_of(plain)
        self.tier.backend = MemoryBackend(dict(zip(plain.keys, plain.blobs)))
        self.sealed_tier.backend = MemoryBackend(dict(zip(sealed.keys, sealed.blobs)))
        n, payload = len(plain.blobs), plain.payload_bytes
        self.write_jobs, self.read_jobs = put_jobs(n, payload), get_jobs(n, payload, threads)
        self.out_arena, self.in_arena = _Arena(), _Arena()
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="bench-crypto")
        self._touch()
        self._warm()

    def _touch(self) -> None:
        """Every thread's arenas allocated (zero-filled, so touched) before anything is timed."""
        gate = threading.Barrier(self.threads)
        stored = max(self.tier.stored_max, self.sealed_tier.stored_max)
        write = max(len(j) for j in self.write_jobs)
        read = max(len(j) for j in self.read_jobs)

        def touch(_: int) -> None:
            gate.wait(timeout=60)
            self.in_arena.views(write, stored)
            self.out_arena.views(read, self.plain.payload_bytes)

        list(self.pool.map(touch, range(self.threads)))

    def _warm(self) -> None:
        """Every op once, untimed, over up to WARM_BYTES of blocks (first passes touch fresh
        memory; the store runs warm). Not enough on its own: the first bench of a process was
        seen sealing 2 MiB blocks on 1 thread at ~0.5 GB/s against ~1.5 GB/s in later ones (not
        isolated); the repeats' median is the figure to read."""
        per_block = self.plain.payload_bytes
        for op in OPS:
            jobs, fn = self.job(op)
            take, size = [], 0
            for j in jobs:
                if size >= WARM_BYTES and len(take) >= self.threads:
                    break
                take.append(j)
                size += len(j) * per_block
            list(self.pool.map(fn, take))

    def _write(self, idx: range, seal: bool) -> int:
        views = self.in_arena.views(len(idx), self.tier.stored_max)
        items = [(self.keys[i], self.tier.encode(self.keys[i], self.plain.raw[i], into=views[j]))
                 for j, i in enumerate(idx)]
        tier = self.sealed_tier if seal else self.tier
        return sum(tier.put_blobs(items, len(idx) * self.plain.payload_bytes, tenant=TENANT))

    def _seal(self, idx: range) -> int:
        items = [(self.keys[i], self.plain.blobs[i]) for i in idx]
        return sum(self.sealed_tier.put_blobs(items, len(idx) * self.plain.payload_bytes, tenant=TENANT))

    def _read(self, idx: range, sealed: bool) -> int:
        tier = self.sealed_tier if sealed else self.tier
        outs = self.out_arena.views(len(idx), self.plain.payload_bytes)
        reasons, _ = tier.read_into([self.keys[i] for i in idx], outs, tenant=TENANT)
        if any(reasons):
            raise RuntimeError(f"{tier.name} tier read missed: {sorted({r for r in reasons if r})}")
        return len(idx)

    def job(self, op: str) -> tuple[list[range], Callable[[range], int]]:
        return {"encode": (self.write_jobs, lambda r: self._write(r, False)),
                "encode+seal": (self.write_jobs, lambda r: self._write(r, True)),
                "seal": (self.write_jobs, self._seal),
                "decode": (self.read_jobs, lambda r: self._read(r, False)),
                "open+decode": (self.read_jobs, lambda r: self._read(r, True))}[op]

    def run(self, op: str) -> dict:
        """One timed pass of ``op`` over every block."""
        jobs, fn = self.job(op)
        cpu0, wall0 = time.process_time(), time.perf_counter()
        done = sum(self.pool.map(fn, jobs))
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
        n = len(self.plain.blobs)
        if done != n:
            raise RuntimeError(f"{op}: {done} of {n} blocks went through")
        return {"op": op, "threads": self.threads, "seconds": wall, "cpu_s": cpu, "blocks": n,
                "payload_bytes": n * self.plain.payload_bytes}

    def check(self) -> None:
        """Untimed: the sealed read gives back the very payload (the plain one is checked by
        bench_cluster's own tests), and sealing really changed the stored bytes."""
        out = bytearray(self.plain.payload_bytes)
        for i in {0, len(self.keys) - 1}:
            reasons, _ = self.sealed_tier.read_into([self.keys[i]], [out], tenant=TENANT)
            if reasons != [None] or bytes(out) != self.plain.raw[i].tobytes():
                raise AssertionError(f"sealed block {i} did not open to its payload ({reasons})")
            if self.sealed.blobs[i][-64:] == self.plain.blobs[i][-64:]:
                raise AssertionError(f"sealed block {i} ends as the plain one does")

    def close(self) -> None:
        self.pool.shutdown()


def measure(plain: Encoded, sealed: Encoded, layer_groups: int, threads: Sequence[int], repeats: int,
            rep_offset: int = 0, say: Callable[[str], None] | None = None) -> list[dict]:
    """Records of every op on each thread count, ``repeats`` times (numbered from ``rep_offset``)
    in alternating order (plain first in even repeats, sealed first in odd ones)."""
    records = []
    for t in dict.fromkeys(threads):
        bench = CryptoBench(plain, sealed, layer_groups, t)
        try:
            bench.check()
            for rep in range(repeats):
                if say:
                    say(f"{plain.kind}: sealing and opening on {t} thread(s), repeat {rep + 1}/{repeats}")
                order = OPS if (rep + rep_offset) % 2 == 0 else ("seal", "encode+seal", "encode", "open+decode", "decode")
                for op in order:
                    records.append({"kind": plain.kind, "rep": rep + rep_offset, **bench.run(op)})
        finally:
            bench.close()
    return records
