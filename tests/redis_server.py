"""A real ``redis-server`` on a free loopback port, for tests (no mocks)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """Starts, stops and restarts one redis-server bound to 127.0.0.1 on a fixed free port."""

    def __init__(self, workdir: Path, port: int | None = None, maxmemory: str = "512mb") -> None:
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            raise RuntimeError("redis-server is not installed (.ci/run installs it)")
        self.workdir = workdir
        self.port = port or free_port()
        self.maxmemory = maxmemory
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.workdir), "--maxmemory", self.maxmemory,
             "--maxmemory-policy", "allkeys-lru", "--protected-mode", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=10)
            self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def flushall(self) -> None:
        with socket.create_connection(("127.0.0.1", self.port), timeout=2) as s:
            s.sendall(b"FLUSHALL\r\n")
            s.recv(16)


def calls_at_once(call, *, threads: int = 8, rounds: int = 10) -> list[Exception]:
    """Run ``call()`` ``rounds`` times on each of ``threads`` threads started together; the
    exceptions they raised (an AssertionError too)."""
    import threading

    barrier, failures = threading.Barrier(threads), []

    def caller() -> None:
        barrier.wait()
        for _ in range(rounds):
            try:
                call()
            except Exception as exc:  # (kept: the test says which it expected)
                failures.append(exc)

    started = [threading.Thread(target=caller) for _ in range(threads)]
    for t in started:
        t.start()
    for t in started:
        t.join()
    return failures
