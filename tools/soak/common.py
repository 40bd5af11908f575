"""What every soak section shares: the namespace and deterministic payloads, store configs,
child processes forked from a preloaded server, acknowledgement files, a redis-server of our
own, and small figures helpers."""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from tiered_kv.keys import Namespace

# 16 KiB bf16 blocks: [4 layers, K/V, 16 tokens, 2 heads, 32 dims]
NS = Namespace(model_id="fault-soak", dtype="bfloat16", num_layers=4, num_kv_heads=2,
               head_dim=32, block_size=16)
SHAPE = NS.block_shape
BLOCK_BYTES = 2 * int(np.prod(SHAPE))
PRELOAD = ["torch", "numpy", "lmdb", "redis", "tiered_kv.store.tiered_store", "tiered_kv.connector",
           "tiered_kv.engine", "tiered_kv.admin.verify", "tiered_kv.admin.opening", "soak.common"]


# -- keys and payloads ----------------------------------------------------------------------------
def key_of(index: int, tag: str = "soak") -> bytes:
    """A 16-byte block key that depends only on ``tag`` and ``index``."""
    return hashlib.blake2b(f"{tag}:{index}".encode(), digest_size=16).digest()


def payload_bytes(key: bytes) -> np.ndarray:
    """The block payload stored under ``key``: KV-like bf16 values (per-channel scales),
    a pure function of the key, as a flat uint8 array of BLOCK_BYTES."""
    rng = np.random.default_rng(int.from_bytes(key[:8], "little"))
    scale = np.linspace(0.25, 4.0, SHAPE[-1], dtype=np.float32)
    values = rng.standard_normal(SHAPE, dtype=np.float32) * scale
    bf16 = (values.view(np.uint32) >> 16).astype(np.uint16)  # truncation: a valid bf16 pattern
    return bf16.view(np.uint8).reshape(-1)


def payload_tensor(key: bytes):
    """:func:`payload_bytes` as a canonical bf16 block tensor."""
    import torch

    return torch.from_numpy(payload_bytes(key).copy()).view(torch.bfloat16).view(SHAPE)


def digest_of(buf) -> int:
    """xxh3-64 of a buffer's bytes (what the soak compares instead of keeping payloads)."""
    return xxhash.xxh3_64_intdigest(memoryview(buf).cast("B"))


class Expected:
    """Digest of the payload of each key, computed once."""

    def __init__(self) -> None:
        self._digests: dict[bytes, int] = {}

    def matches(self, key: bytes, buf) -> bool:
        want = self._digests.get(key)
        if want is None:
            want = self._digests[key] = digest_of(payload_bytes(key))
        return digest_of(buf) == want


# -- stores ---------------------------------------------------------------------------------------
def store_config(*, host: str = "1MiB", disk_url: str | None = None, disk: dict | None = None,
                 remote_url: str | None = None, remote: dict | None = None, **top: Any) -> dict:
    """A TieredKVConfig dict: host tier, optional disk and remote tiers, top-level settings."""
    cfg: dict[str, Any] = {"host": {"capacity": host}, "workers": 2, **top}
    if disk_url:
        cfg["disk"] = {"url": disk_url, "capacity": "1GiB", **(disk or {})}
    if remote_url:
        cfg["remote"] = {"url": remote_url, "timeout": 0.5, "retries": 1, **(remote or {})}
    return cfg


def open_store(cfg: dict, ns: Namespace = NS):
    """A TieredStore over ``cfg`` (a dict, see :func:`store_config`)."""
    from tiered_kv.config import TieredKVConfig
    from tiered_kv.store import TieredStore

    return TieredStore(TieredKVConfig.from_dict(cfg), ns)


def stored_block_keys(backend, ns: Namespace = NS) -> list[bytes]:
    """Block keys (without the namespace digest) a medium holds for ``ns``."""
    digest = ns.digest()
    return sorted(k[16:] for k in backend.scan(digest) if len(k) == 32 and k.startswith(digest))


def host_slots_held(store) -> dict:
    """Host slots still leased (pinned) or reserved (phase one, never committed or aborted)."""
    stats = store.host.stats()
    reserved = stats.used_bytes // store.host.slot_bytes - stats.entries
    return {"leased": int(stats.extra.get("leased", 0)), "reserved": int(reserved)}


def load_checked(store, keys: Sequence[bytes], expected: Expected) -> dict:
    """Load ``keys`` through ``load_into`` in batches and compare each served block with its
    payload. Returns served / matched / wrong key lists and the exceptions raised."""
    import torch

    out: dict[str, list] = {"served": [], "wrong": [], "missed": [], "errors": []}
    for start in range(0, len(keys), 64):
        batch = list(keys[start : start + 64])
        outs = [torch.zeros(SHAPE, dtype=torch.bfloat16) for _ in batch]
        try:
            ok = store.load_into(batch, outs)
        except Exception as exc:  # counted: nothing may reach the caller
            out["errors"].append(f"{type(exc).__name__}: {exc}")
            out["missed"].extend(batch)
            continue
        for key, good, tensor in zip(batch, ok, outs):
            if not good:
                out["missed"].append(key)
                continue
            out["served"].append(key)
            if not expected.matches(key, tensor.view(torch.uint8).numpy()):
                out["wrong"].append(key)
    return out


# -- child processes ------------------------------------------------------------------------------
_CTX: Any = None


def context():
    """A forkserver context whose server imported torch and the store once: children start in
    ~0.1 s instead of ~3 s, and fork from a process that never ran a torch op."""
    global _CTX
    if _CTX is None:
        _CTX = multiprocessing.get_context("forkserver")
        _CTX.set_forkserver_preload(PRELOAD)
    return _CTX


def child_setup() -> None:
    """First thing in every child: one torch thread, library logs quiet."""
    import torch

    torch.set_num_threads(1)
    logging.basicConfig(level=logging.ERROR)
    logging.getLogger("tiered_kv").setLevel(logging.ERROR)
    logging.getLogger("storage_backends").setLevel(logging.ERROR)


def join_or_kill(proc, timeout: float) -> bool:
    """Wait for ``proc`` up to ``timeout`` s; SIGKILL it when it overruns. True if it exited."""
    proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        proc.join(10)
        return False
    return True


class Ack:
    """An append-only line file a child writes (``O_APPEND``, one ``write`` per line, so a
    SIGKILL leaves whole lines and at most one torn last line) and the parent reads."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._fd: int | None = None

    def write(self, *words: str) -> None:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.write(self._fd, (" ".join(words) + "\n").encode())

    def lines(self) -> list[list[str]]:
        """Complete lines written so far, split into words (a torn last line is left out)."""
        try:
            text = self.path.read_bytes().decode(errors="replace")
        except FileNotFoundError:
            return []
        return [line.split() for line in text.split("\n")[:-1] if line.strip()]

    def wait_for(self, word: str, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(line and line[0] == word for line in self.lines()):
                return True
            time.sleep(0.01)
        return False


def keys_in(lines: Iterable[list[str]], word: str) -> list[bytes]:
    """Keys (hex words) of every line starting with ``word``."""
    return [bytes.fromhex(h) for line in lines if line and line[0] == word for h in line[1:]]


# -- a redis-server of our own --------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the forked redis-server before exec: SIGKILL it when this script dies (PR_SET_PDEATHSIG)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)


class RedisProcess:
    """One redis-server on 127.0.0.1 and a fixed free port: start, kill, hang (SIGSTOP),
    continue (SIGCONT). Killed with this script even if the script itself is killed."""

    def __init__(self, workdir: Path) -> None:
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            raise RuntimeError("redis-server is not installed")
        self.workdir = Path(workdir)
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.stopped = False

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> RedisProcess:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.workdir), "--maxmemory", "512mb",
             "--maxmemory-policy", "allkeys-lru", "--protected-mode", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=_die_with_parent)
        if not self.answers(timeout):
            self.kill()
            raise RuntimeError(f"redis-server did not start on port {self.port}")
        return self

    def answers(self, timeout: float) -> bool:
        """Whether the server answers PING within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.settimeout(0.2)
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return True
            except OSError:
                time.sleep(0.05)
        return False

    def hang(self) -> None:
        """Black-hole it: the kernel still accepts connections, nothing answers."""
        if self.proc is not None and not self.stopped:
            self.proc.send_signal(signal.SIGSTOP)
            self.stopped = True

    def resume(self) -> None:
        if self.proc is not None and self.stopped:
            self.proc.send_signal(signal.SIGCONT)
            self.stopped = False

    def kill(self) -> None:
        if self.proc is not None:
            self.resume()
            self.proc.kill()
            self.proc.wait(timeout=10)
            self.proc = None


# -- figures --------------------------------------------------------------------------------------
def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) of ``values`` by nearest rank; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def pct(part: int, whole: int) -> float | None:
    return None if whole == 0 else round(100.0 * part / whole, 2)


def error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc)[:200]}"
