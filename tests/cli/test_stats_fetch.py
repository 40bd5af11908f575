"""``tiered-kv stats URL`` against endpoints that are no well-behaved exporter: a redirect to
another host never gets the URL's credentials, and a port that does not speak HTTP, an answer cut
short or a URL that cannot be asked are one line and an exit code, never a traceback."""

from __future__ import annotations

import base64
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.cli.conftest import cli

SCRAPE = b'tiered_kv_hits_total{tier="disk"} 5\n'
AUTH = "Basic " + base64.b64encode(b"user:s3cret").decode()


@contextmanager
def http_server(answer: Callable[[BaseHTTPRequestHandler], None]) -> Iterator[tuple[int, list[dict]]]:
    """A real HTTP server on a loopback port: (its port, the headers of every request it got)."""
    seen: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.append(dict(self.headers))
            answer(self)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_port, seen
    finally:
        server.shutdown()
        server.server_close()


def metrics(handler: BaseHTTPRequestHandler) -> None:
    handler.send_response(200)
    handler.send_header("Content-Length", str(len(SCRAPE)))
    handler.end_headers()
    handler.wfile.write(SCRAPE)


def redirect_to(location: str) -> Callable[[BaseHTTPRequestHandler], None]:
    def answer(handler: BaseHTTPRequestHandler) -> None:
        if handler.path != "/metrics":
            return metrics(handler)
        handler.send_response(302)
        handler.send_header("Location", location)
        handler.send_header("Content-Length", "0")
        handler.end_headers()
    return answer


def test_regression_the_urls_credentials_were_sent_on_to_the_host_a_redirect_named():
    with http_server(metrics) as (other, got_there):
        with http_server(redirect_to(f"http://localhost:{other}/metrics")) as (port, got_here):
            result = cli("stats", f"http://user:s3cret@127.0.0.1:{port}/metrics", "--json")
    assert result.code == 0, result.err
    assert result.json()["tiers"]["disk"]["hits"] == 5, "the redirect was followed"
    assert got_here[0].get("Authorization") == AUTH
    assert "Authorization" not in got_there[0], "credentials for one host went to another"


def test_a_redirect_on_the_same_host_keeps_the_credentials():
    with http_server(redirect_to("/metrics/")) as (port, got):
        result = cli("stats", f"http://user:s3cret@127.0.0.1:{port}/metrics", "--json")
    assert result.code == 0, result.err
    assert [h.get("Authorization") for h in got] == [AUTH, AUTH]


@contextmanager
def tcp_server(reply: bytes) -> Iterator[int]:
    """A loopback port that answers one connection with ``reply`` and closes it."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(60)  # (a test that never connected ends, failed, instead of hanging)

    def serve() -> None:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        with conn:
            conn.recv(4096)
            conn.sendall(reply)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        thread.join()
        listener.close()


def _one_line(result) -> str:
    assert "Traceback" not in result.err and result.out == "", result.err
    lines = result.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tiered-kv: error: "), result.err
    return lines[0]


def test_regression_a_port_that_does_not_speak_http_was_a_traceback():
    with tcp_server(b"SSH-2.0-OpenSSH_9.6\r\n") as port:
        result = cli("stats", f"127.0.0.1:{port}")
    assert result.code == 2
    assert "does not answer HTTP" in _one_line(result)


def test_regression_an_answer_cut_short_was_a_traceback():
    cut = b"HTTP/1.0 200 OK\r\nContent-Length: 4096\r\n\r\n" + SCRAPE  # then the connection closes
    with tcp_server(cut) as port:
        result = cli("stats", f"127.0.0.1:{port}")
    assert result.code == 3  # (the exporter went away mid-answer: try again)
    assert "cannot fetch metrics" in _one_line(result)


@pytest.mark.parametrize("url", ["http://127.0.0.1:abc/metrics", "http://exa mple:9400/metrics",
                                 "http://[::1/metrics", "http://127.0.0.1:99999/metrics"])
def test_regression_a_url_that_cannot_be_asked_was_a_traceback_or_an_unreachable_store(url):
    result = cli("stats", url)
    assert result.code == 2
    assert "bad metrics URL" in _one_line(result)
