"""Redis for bench_tiers: a redis-server of its own on a free loopback port (no persistence,
stopped at exit) when no ``--redis-url`` is given, and ``redis-benchmark`` SET / GET figures of
that server when the tool is installed."""

from __future__ import annotations

import csv
import io
import shutil
import socket
import subprocess
import time

from .common import GB, MiB


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class OwnRedis:
    """A redis-server on a free loopback port, no persistence, killed at exit."""

    def __init__(self, workdir: str, maxmemory: int) -> None:
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            raise RuntimeError("redis-server is not installed")
        self.port = free_port()
        self.workdir = workdir
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", workdir, "--maxmemory", str(maxmemory),
             "--maxmemory-policy", "noeviction", "--protected-mode", "no",
             "--proto-max-bulk-len", str(512 * MiB)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        break
            except OSError:
                pass
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"redis-server did not start on port {self.port}")
            time.sleep(0.05)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.proc = None


def redis_benchmark(host: str, port: int, size: int, n: int, fresh_keys: bool = False) -> dict:
    """``redis-benchmark`` SET / GET of ``size``-byte values, one client, one command at a time.
    Its default SETs all write one key, each replacing the last value; with ``fresh_keys`` it
    SETs ``n`` random keys (``-r``: every value stays, as a store's puts do), reported as
    ``set_new_keys``. The caller deletes the ``key:*`` keys it made."""
    exe = shutil.which("redis-benchmark")
    if exe is None:
        return {"error": "redis-benchmark not installed"}
    cmd = [exe, "-h", host, "-p", str(port), "-c", "1", "-P", "1", "-d", str(size), "-n", str(n),
           "-t", "set" if fresh_keys else "set,get", "--csv"]
    if fresh_keys:
        cmd[1:1] = ["-r", str(10**12)]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    except subprocess.TimeoutExpired:
        return {"error": "redis-benchmark timed out"}
    out: dict = {}
    for row in csv.reader(io.StringIO(res.stdout)):
        if len(row) >= 2 and row[0] in ("SET", "GET"):
            try:
                rps = float(row[1])
            except ValueError:
                continue
            name = "set_new_keys" if fresh_keys else row[0].lower()
            out[name] = {"gbps": round(rps * size / GB, 3), "ops_per_s": round(rps, 1)}
    if not out:
        out["error"] = f"no figures parsed (rc {res.returncode}): {res.stderr.strip()[:200]}"
    return out
