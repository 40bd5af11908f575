"""A TCP proxy that limits throughput: a slow remote tier made of a real Redis behind a link of
a given bandwidth (both directions share one budget each way), for bench_restore's slow-tier
scenario. Threads pump bytes; a token bucket per direction paces them."""

from __future__ import annotations

import socket
import threading
import time

from .redis_server import free_port

CHUNK = 64 << 10


class _Bucket:
    """Paces ``rate`` bytes per second over every connection going one way."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.lock = threading.Lock()
        self.free_at = time.monotonic()

    def take(self, n: int) -> None:
        with self.lock:
            now = time.monotonic()
            start = max(now, self.free_at)
            self.free_at = start + n / self.rate
            delay = self.free_at - now
        if delay > 0:
            time.sleep(delay)


class ThrottleProxy:
    """Listens on a free loopback port and forwards to ``target`` (host, port) at ``rate`` B/s."""

    def __init__(self, target: tuple[str, int], rate: float) -> None:
        self.target = target
        self.up, self.down = _Bucket(rate), _Bucket(rate)
        self.port = free_port()
        self.server = socket.create_server(("127.0.0.1", self.port))
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            for sock in (client, upstream):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._pump, args=(client, upstream, self.up), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, self.down), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket, bucket: _Bucket) -> None:
        try:
            while True:
                data = src.recv(CHUNK)
                if not data:
                    break
                bucket.take(len(data))
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def close(self) -> None:
        self.closed = True
        self.server.close()
