"""``tiered-kv stats URL`` against a metrics endpoint (a real HTTP server on a loopback port) that
refuses who asks: 401 (no or wrong credentials) or 403. That is configuration, exit 2 with one
line saying so, the URL's password masked: it was exit 3, "cannot be reached now", which no retry
mends. Other error statuses stay exit 3."""

from __future__ import annotations

from collections.abc import Callable
from http.server import BaseHTTPRequestHandler

import pytest

from tests.cli.conftest import cli
from tests.cli.test_stats_fetch import AUTH, http_server, metrics

PASSWORD = "s3cret"


def status(code: int) -> Callable[[BaseHTTPRequestHandler], None]:
    def answer(handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(code)
        if code == 401:
            handler.send_header("WWW-Authenticate", 'Basic realm="metrics"')
        handler.send_header("Content-Length", "0")
        handler.end_headers()
    return answer


def basic_auth(handler: BaseHTTPRequestHandler) -> None:
    """The exporter behind a proxy asking for ``user:s3cret``."""
    if handler.headers.get("Authorization") == AUTH:
        return metrics(handler)
    return status(401)(handler)


def one_line(result) -> str:
    assert result.out == "" and result.err.count("\n") == 1 and "Traceback" not in result.err, result.err
    assert PASSWORD not in result.err and "Wr0ngPw" not in result.err, result.err
    return result.err


def test_regression_a_metrics_endpoint_answering_401_was_exit_3_try_again_later():
    with http_server(basic_auth) as (port, _):
        assert cli("stats", f"http://user:{PASSWORD}@127.0.0.1:{port}/metrics").code == 0  # the right ones
        missing = cli("stats", f"127.0.0.1:{port}")
        wrong = cli("stats", f"http://user:Wr0ngPw@127.0.0.1:{port}/metrics")
    assert missing.code == 2, missing.err
    assert one_line(missing) == (f"tiered-kv: error: authentication failed for the metrics endpoint "
                                 f"http://127.0.0.1:{port}/metrics: HTTP 401 Unauthorized; give a user and password "
                                 "in the URL: http(s)://USER:PASSWORD@HOST:PORT/metrics\n")
    assert wrong.code == 2, wrong.err
    assert one_line(wrong).startswith(f"tiered-kv: error: authentication failed for the metrics endpoint "
                                      f"http://user:***@127.0.0.1:{port}/metrics: HTTP 401"), wrong.err


def test_a_metrics_endpoint_answering_403_is_exit_2_too():
    with http_server(status(403)) as (port, _):
        result = cli("stats", f"http://user:{PASSWORD}@127.0.0.1:{port}/metrics", "--json")
    assert result.code == 2, result.err
    assert "authentication failed for the metrics endpoint" in one_line(result) and "HTTP 403" in result.err


@pytest.mark.parametrize("code", [500, 503])
def test_a_metrics_endpoint_failing_otherwise_is_still_unreachable_now(code):
    with http_server(status(code)) as (port, _):
        result = cli("stats", f"127.0.0.1:{port}")
    assert result.code == 3, result.err
    assert one_line(result).startswith(f"tiered-kv: error: cannot fetch metrics from http://127.0.0.1:{port}/metrics"), \
        result.err
