"""One timed phase of bench_cluster: the same stored blocks put into, or got from, a cluster
through the store's remote tier or through plain redis-py, by the store's number of transfer
threads in jobs shaped as the store shapes them.

- ours: ``storage_backends`` opens the remote tier's backend for the cluster URL (what the store
  opens), and each job is one ``put_many`` of a write-behind job's blocks (16 MiB of payload, the
  store's ``SAVE_CHUNK_BYTES``) or one ``visit_many`` of a load job's (a 64 MiB load batch split
  across the threads); the backend cuts them into its own ~4 MiB pipelines.
- raw: ``redis.cluster.RedisCluster``, each job one non-transactional pipeline of SETs / GETs of
  the same names and bytes (or pipelines of at most ``raw_pipeline_bytes`` of values).

Each phase records wall seconds, this process's CPU seconds and every master's command-thread
CPU seconds."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import redis
from redis.crc import key_slot

from storage_backends.redis_names import RedisNames
from storage_backends.registry import open_backend

from .cluster_data import Encoded
from .cluster_servers import BenchCluster

PREFIX = b"tkv:"  # the remote tier's default key prefix
SAVE_JOB_BYTES = 16 << 20  # the store's write-behind job (tiered_kv.store.saving.SAVE_CHUNK_BYTES)
LOAD_BATCH_BYTES = 64 << 20  # one load_into batch, split across the transfer threads
CHECKED = 4  # blocks compared at each end after the timed gets
TIMEOUT_S = 60.0  # per call: a busy machine must not turn a slow reply into a miss


def put_jobs(n: int, payload: int) -> list[range]:
    per = max(1, SAVE_JOB_BYTES // payload)
    return [range(lo, min(n, lo + per)) for lo in range(0, n, per)]


def get_jobs(n: int, payload: int, workers: int) -> list[range]:
    batch = max(1, LOAD_BATCH_BYTES // payload)
    per = max(1, -(-min(batch, n) // workers))
    return [range(lo, min(n, lo + per)) for lo in range(0, n, per)]


def names_of(enc: Encoded) -> list[bytes]:
    return RedisNames(PREFIX, cluster=True).names(enc.keys)


def per_master_bytes(enc: Encoded, owners: Sequence[int], masters: int) -> list[int]:
    """Stored bytes each master serves, from the slot of each name."""
    out = [0] * masters
    for name, blob in zip(names_of(enc), enc.blobs):
        out[owners[key_slot(name)]] += len(blob)
    return out


class Timed:
    """Runs ``jobs`` on ``workers`` threads and records the phase."""

    def __init__(self, cluster: BenchCluster, workers: int) -> None:
        self.cluster, self.pool = cluster, ThreadPoolExecutor(workers, thread_name_prefix="bench-cluster")

    def run(self, jobs: list[range], job: Callable[[range], int]) -> dict:
        cpu0, wall0, srv0 = time.process_time(), time.perf_counter(), self.cluster.master_cpu_s()
        done = sum(self.pool.map(job, jobs))
        wall = time.perf_counter() - wall0
        cpu, srv1 = time.process_time() - cpu0, self.cluster.master_cpu_s()
        server = [None if a is None or b is None else b - a for a, b in zip(srv0, srv1)]
        return {"seconds": wall, "client_cpu_s": cpu, "server_cpu_s": server, "done": done}

    def close(self) -> None:
        self.pool.shutdown()


class Ours:
    """The remote tier's backend on the cluster."""

    def __init__(self, url: str) -> None:
        self.backend = open_backend(url, timeout=TIMEOUT_S)
        self.backend.contains_many([b"warm-up"])  # connects and learns the slot map

    def put(self, enc: Encoded, idx: range, names: Sequence[bytes]) -> int:  # names: the backend's own
        return sum(self.backend.put_many([(enc.keys[i], enc.blobs[i]) for i in idx]))

    def get(self, enc: Encoded, idx: range, names: Sequence[bytes], check: bool = False) -> int:
        keys = [enc.keys[i] for i in idx]
        seen = [0]

        def visit(j: int, value: memoryview) -> None:
            seen[0] += 1
            if check and bytes(value) != enc.blobs[idx[j]]:  # (memoryview == bytes is slow)
                raise AssertionError(f"block {idx[j]} came back different")

        self.backend.visit_many(keys, visit)
        return seen[0]

    def close(self) -> None:
        self.backend.close()


class Raw:
    """Plain redis-py: ``RedisCluster`` pipelines of SET / GET of the same names and bytes."""

    def __init__(self, cluster: BenchCluster, pipeline_bytes: int = 0) -> None:
        self.pipeline_bytes = pipeline_bytes  # 0: one pipeline per job
        first = cluster.nodes[0]
        self.client = redis.RedisCluster(host="127.0.0.1", port=first.port, socket_timeout=TIMEOUT_S,
                                         socket_connect_timeout=TIMEOUT_S, max_connections=64)

    def _cut(self, enc: Encoded, idx: range) -> list[range]:
        per = len(idx) if not self.pipeline_bytes else max(1, self.pipeline_bytes // enc.payload_bytes)
        return [idx[lo:lo + per] for lo in range(0, len(idx), per)]

    def put(self, enc: Encoded, idx: range, names: Sequence[bytes]) -> int:
        done = 0
        for part in self._cut(enc, idx):
            pipe = self.client.pipeline(transaction=False)
            for i in part:
                pipe.set(names[i], enc.blobs[i])
            done += sum(r is True for r in pipe.execute())
        return done

    def get(self, enc: Encoded, idx: range, names: Sequence[bytes], check: bool = False) -> int:
        done = 0
        for part in self._cut(enc, idx):
            pipe = self.client.pipeline(transaction=False)
            for i in part:
                pipe.get(names[i])
            values = pipe.execute()
            if check and any(v != enc.blobs[i] for i, v in zip(part, values)):
                raise AssertionError("a block came back different")
            done += sum(isinstance(v, bytes) for v in values)
        return done

    def close(self) -> None:
        self.client.close()


def run_path(path: str, cluster: BenchCluster, enc: Encoded, workers: int, check: bool,
             raw_pipeline_bytes: int = 0) -> dict[str, dict]:
    """Put every block, then get every block, through ``path`` (``ours`` or ``raw``); the
    cluster is emptied afterwards. Returns ``{"put": phase, "get": phase}`` and, for the put,
    each master's memory and keys."""
    n = len(enc.blobs)
    names = names_of(enc)
    timed = Timed(cluster, workers)
    client: Ours | Raw = Ours(cluster.url) if path == "ours" else Raw(cluster, raw_pipeline_bytes)
    try:
        before = cluster.master_memory()
        put = timed.run(put_jobs(n, enc.payload_bytes), lambda r: client.put(enc, r, names))
        after = cluster.master_memory()
        got = timed.run(get_jobs(n, enc.payload_bytes, workers), lambda r: client.get(enc, r, names))
        if check:  # untimed: a few blocks, first and last, must come back as they were stored
            for lo in (0, max(0, n - CHECKED)):
                client.get(enc, range(lo, min(n, lo + CHECKED)), names, check=True)
        put["memory"] = [{"port": a["port"], "used_memory_delta": a["used_memory"] - b["used_memory"],
                          "keys": a["keys"] - b["keys"]} for a, b in zip(after, before)]
        for phase in (put, got):
            if phase["done"] != n:
                raise RuntimeError(f"{path}: only {phase['done']} of {n} blocks went through")
        return {"put": put, "get": got}
    finally:
        client.close()
        timed.close()
        cluster.flush()
