"""A Redis that refuses the user or password of a tier's URL (real redis-servers: ``requirepass``,
an ACL user; a one-node Redis Cluster): the medium raises :class:`CredentialsRefused`, a
BackendUnavailable (an engine counts the tier down), naming the tier and its redacted URL, never
the password. It raised a plain BackendUnavailable, and the CLI dug redis-py's
AuthenticationError out of the exception's ``__context__`` to tell it from Redis being down."""

from __future__ import annotations

import logging
import subprocess
import time

import pytest
import redis

from storage_backends.registry import open_backend
from tests.redis_server import free_port
from tiered_kv.errors import BackendUnavailable, CredentialsRefused

PASSWORD = "Qv8nTz3kRight"
WRONG = "Jh5wXc7pWrong"
GUARD_S = 30.0  # a hang guard for a server to start, not a figure


@pytest.fixture
def locked(own_redis):
    """The test's own redis-server: the default user needs ``PASSWORD``; ``tier`` is an ACL user."""
    admin = redis.Redis(port=own_redis.port)
    admin.execute_command("ACL", "SETUSER", "tier", "on", f">{PASSWORD}", "~*", "+@all")
    admin.config_set("requirepass", PASSWORD)
    admin.close()
    return own_redis


def get_refused(port: int, retries: int) -> None:
    """One get through a tier whose URL has the wrong password: CredentialsRefused."""
    b = open_backend(url_with(port, f":{WRONG}@"), retries=retries)
    try:
        with pytest.raises(CredentialsRefused):
            b.get_many([b"k"])
    finally:
        b.close()


def url_with(port: int, userinfo: str, scheme: str = "redis") -> str:
    return f"{scheme}://{userinfo}127.0.0.1:{port}/0"


@pytest.mark.parametrize("userinfo", [f":{WRONG}@", "", f"nobody:{PASSWORD}@", f"tier:{WRONG}@"],
                         ids=["wrong-password", "no-password", "no-such-user", "acl-user-wrong-password"])
def test_regression_a_redis_refusing_the_urls_password_raised_a_plain_backend_unavailable(locked, userinfo):
    b = open_backend(url_with(locked.port, userinfo), retries=0)
    try:
        with pytest.raises(CredentialsRefused) as refused:
            b.get_many([b"k"])
        assert isinstance(refused.value, BackendUnavailable)  # an engine counts the tier down
        text = str(refused.value)
        assert text.startswith("authentication failed for the tier at ") and b.url in text, text
        assert PASSWORD not in text and WRONG not in text, text
        assert refused.value.__cause__ is None and refused.value.__suppress_context__  # (one line, ours)
        assert not b.available  # the breaker opened: the next calls fail at once, counted
        with pytest.raises(BackendUnavailable):
            b.get_many([b"k"])
        assert b.stats().errors >= 2
    finally:
        b.close()


def test_regression_a_url_without_a_password_was_told_the_password_in_it_was_wrong(locked):
    # and the server's answer to it spoke of "HELLO AUTH <user> <pass>": nothing said to give one
    none = open_backend(url_with(locked.port, ""), retries=0)
    wrong = open_backend(url_with(locked.port, f":{WRONG}@"), retries=0)
    try:
        with pytest.raises(CredentialsRefused) as without:
            none.get_many([b"k"])
        with pytest.raises(CredentialsRefused) as mistaken:
            wrong.get_many([b"k"])
    finally:
        none.close()
        wrong.close()
    assert "its URL gives none" in str(without.value) and "a wrong user" not in str(without.value), without.value
    assert "a wrong user or password in its URL" in str(mistaken.value), mistaken.value


def test_regression_the_engines_log_said_a_refused_password_without_the_servers_answer(locked, caplog):
    # the breaker logged redis-py 8's repr, "auth:AuthenticationError": no word of what Redis said
    caplog.set_level(logging.WARNING, logger="storage_backends.redis_breaker")
    get_refused(locked.port, retries=0)
    [said] = [r.getMessage() for r in caplog.records if r.name == "storage_backends.redis_breaker"]
    assert "AuthenticationError: invalid username-password pair" in said and WRONG not in said, said


def test_the_right_password_works_and_a_server_that_is_down_is_no_credentials_refusal(locked):
    b = open_backend(url_with(locked.port, f"tier:{PASSWORD}@"), retries=0)
    try:
        assert b.put_many([(b"k", b"v")]) == [True] and b.get_many([b"k"]) == [b"v"]
        locked.stop()
        with pytest.raises(BackendUnavailable) as down:
            b.get_many([b"k"])
        assert not isinstance(down.value, CredentialsRefused), down.value
    finally:
        b.close()


@pytest.fixture
def one_node_cluster(tmp_path):
    """A Redis Cluster of one master holding every slot, its default user needing ``PASSWORD``."""
    port, bus = free_port(), free_port()
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--cluster-port", str(bus), "--bind", "127.0.0.1",
         "--cluster-enabled", "yes", "--cluster-config-file", str(tmp_path / "nodes.conf"), "--dir", str(tmp_path),
         "--save", "", "--appendonly", "no", "--protected-mode", "no"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        node = redis.Redis(port=port, socket_timeout=2, socket_connect_timeout=0.2)
        _until(lambda: _answers(node), "the cluster node never started")
        node.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
        _until(lambda: node.cluster("info")["cluster_state"] == "ok", "the one-node cluster never formed")
        node.config_set("requirepass", PASSWORD)
        node.close()
        yield port
    finally:
        proc.kill()
        proc.wait(GUARD_S)


def _answers(node: redis.Redis) -> bool:
    try:
        return bool(node.ping())
    except redis.ConnectionError:
        return False


def _until(check, what: str) -> None:
    end = time.monotonic() + GUARD_S
    while not check():
        assert time.monotonic() < end, what
        time.sleep(0.05)


def test_a_cluster_refusing_the_urls_password_is_credentials_refused_too(one_node_cluster):
    # redis-py's cluster client wraps its startup nodes' AuthenticationError in a RedisClusterException
    right = open_backend(url_with(one_node_cluster, f":{PASSWORD}@", "redis+cluster"), retries=0)
    wrong = open_backend(url_with(one_node_cluster, f":{WRONG}@", "redis+cluster"), retries=0)
    try:
        assert right.put_many([(b"k", b"v")]) == [True] and right.get_many([b"k"]) == [b"v"]
        with pytest.raises(CredentialsRefused) as refused:
            wrong.get_many([b"k"])
        assert f"redis+cluster://:***@127.0.0.1:{one_node_cluster}/0" in str(refused.value)
        assert WRONG not in str(refused.value) and PASSWORD not in str(refused.value)
    finally:
        right.close()
        wrong.close()


def test_regression_a_refused_password_was_sent_again_retries_times_a_call(locked):
    # redis-py's AuthenticationError is a ConnectionError, so the tier's retry of refused
    # connections sent the wrong password `retries` more times a call (with backoff); some
    # managed Redis lock a client out after a few failed attempts. One connection a call now.
    admin = redis.Redis(port=locked.port, password=PASSWORD)
    before = admin.info("stats")["total_connections_received"]
    get_refused(locked.port, retries=3)
    assert admin.info("stats")["total_connections_received"] - before == 1
    admin.close()
