"""A Redis Cluster whose startup node is black-holed (its host drops the connection's SYNs, so
each connect waits out its timeout): calls arriving at once must not queue one connect each."""

from __future__ import annotations

import socket
import threading

import pytest
import redis

from storage_backends.registry import open_backend
from tiered_kv.errors import BackendUnavailable


@pytest.fixture
def black_hole():
    """127.0.0.1:port of a listener whose accept queue is full: a connect there gets no answer."""
    server = socket.create_server(("127.0.0.1", 0), backlog=0)
    port, fillers = server.getsockname()[1], []
    for _ in range(4):  # (more than the queue holds: the kernel drops further SYNs)
        filler = socket.socket()
        filler.setblocking(False)
        filler.connect_ex(("127.0.0.1", port))
        fillers.append(filler)
    yield port
    for sock in [*fillers, server]:
        sock.close()


def test_calls_queued_on_a_black_holed_cluster_s_first_connect_fail_with_it(black_hole, monkeypatch):
    # the cluster client is made (and connects) on first use under a lock: each call that had
    # queued on it made its own try after the one before failed, so the k-th of k calls arriving
    # together waited k connect timeouts (6 calls at 500 ms: the last 3 s) for one black hole
    b = open_backend(f"redis+cluster://127.0.0.1:{black_hole}", timeout="500ms", retries=0)
    connects, outcomes, callers = [], [], set()  # (the breaker's background probe connects too: not a caller)
    connect = redis.connection.Connection._connect

    def counted_connect(conn):
        if threading.get_ident() in callers:
            connects.append(conn)
        return connect(conn)

    monkeypatch.setattr(redis.connection.Connection, "_connect", counted_connect)
    barrier = threading.Barrier(6)

    def call() -> None:
        callers.add(threading.get_ident())
        barrier.wait()
        try:
            b.get_many([b"k"])
            outcomes.append("served")
        except BackendUnavailable:
            outcomes.append("unavailable")
        except Exception as exc:  # (any other type is a bug)
            outcomes.append(repr(exc))

    threads = [threading.Thread(target=call) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)  # (a hang guard only)
    b.close()
    assert outcomes == ["unavailable"] * 6
    assert len(connects) == 1, f"{len(connects)} connects to one black hole for calls made together"
