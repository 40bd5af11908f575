"""A TCP proxy in front of a real Redis that, once told to, trickles what Redis answers: a few
bytes at a time, often enough that no socket read ever waits a whole timeout (a slow link, a
congested proxy, a server swapping). It counts what it delivered, and notes when a client
closed its connection."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass, field


@dataclass
class Link:
    """One client connection through the proxy."""

    delivered: int = 0  # bytes of replies handed to the client while trickling
    client_closed: threading.Event = field(default_factory=threading.Event)


class TrickleProxy:
    """Forwards 127.0.0.1:``port`` to ``target``; after :meth:`start_trickling`, replies go
    ``piece`` bytes every ``interval`` seconds."""

    def __init__(self, target: tuple[str, int], *, piece: int = 64, interval: float = 0.01) -> None:
        self.target, self.piece, self.interval = target, piece, interval
        self.trickling = threading.Event()
        self.links: list[Link] = []
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start_trickling(self) -> None:
        self.trickling.set()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            self._socks += [client, upstream]
            link = Link()
            self.links.append(link)
            threading.Thread(target=self._up, args=(client, upstream, link), daemon=True).start()
            threading.Thread(target=self._down, args=(upstream, client, link), daemon=True).start()

    @staticmethod
    def _up(client: socket.socket, upstream: socket.socket, link: Link) -> None:
        try:
            while data := client.recv(65536):
                upstream.sendall(data)
        except OSError:
            pass
        link.client_closed.set()  # (EOF or reset: the client dropped the connection)
        _shut(upstream)

    def _down(self, upstream: socket.socket, client: socket.socket, link: Link) -> None:
        try:
            while data := upstream.recv(65536):
                if not self.trickling.is_set():
                    client.sendall(data)
                    continue
                for start in range(0, len(data), self.piece):
                    time.sleep(self.interval)
                    client.sendall(data[start : start + self.piece])
                    link.delivered += len(data[start : start + self.piece])
        except OSError:
            pass
        _shut(client)

    def close(self) -> None:
        self.server.close()
        for sock in self._socks:
            _shut(sock)
            sock.close()


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
