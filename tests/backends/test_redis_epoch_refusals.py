"""The Redis loss watch against servers that refuse its marker (real redis-servers: ACL users made
with ``ACL SETUSER``, a replica made with ``REPLICAOF``, a failed snapshot for MISCONF). Every
NOPERM was told to allow the marker's key pattern, even when the ACL refused the SET command
itself; READONLY and MISCONF were logged at DEBUG only, at every look, so the watch was off
unsaid. Each is said once at WARNING now, with the advice that fits, and its end once at INFO.
Nothing here waits on time: the tests wait on the watch's looks, with a hang guard."""

from __future__ import annotations

import logging

import pytest
import redis

import storage_backends.redis_epoch as epoch
from storage_backends.redis_epoch_refusals import refusal_of
from storage_backends.registry import open_backend
from tests.backends.helpers import until
from tests.backends.test_redis_epoch_watch import epoch_warnings, limited_user
from tests.backends.test_redis_refusals import misconf
from tests.redis_server import free_port

AN_HOUR = 3600.0


@pytest.fixture
def watching(monkeypatch, caplog):
    """Open a tier on a URL and set a listener (the watch starts); every tier is closed after."""
    caplog.set_level(logging.DEBUG, logger=epoch.__name__)
    monkeypatch.setattr(epoch, "CHECK_EVERY_S", 0.01)
    opened = []

    def open_watched(url: str):
        b = open_backend(url, retries=0)
        opened.append(b)
        heard: list[str] = []
        b.listen(lambda change, keys: heard.append(change))
        return b, heard

    yield open_watched
    for b in opened:
        b.close()


def acl_user(server, *rules: str) -> str:
    """The URL of a user allowed every key and command but what ``rules`` (after them) take away."""
    admin = redis.Redis(port=server.port)
    try:
        admin.execute_command("ACL", "SETUSER", "tier", "reset", "on", ">pw", "~*", "+@all", *rules)
    finally:
        admin.close()
    return server.url.replace("redis://", "redis://tier:pw@")


def infos(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == epoch.__name__ and r.levelno == logging.INFO]


def test_regression_an_acl_refusing_the_set_command_was_told_to_allow_the_key_pattern(own_redis, watching, caplog):
    # "has no permissions to run the 'set' command": allowing ~tkv-epoch:tkv: changes nothing
    b, _ = watching(acl_user(own_redis, "-set"))
    until(lambda: b.epoch.denied, "the refused SET was never noticed")
    [warning] = epoch_warnings(caplog)
    assert "SET command" in warning and "+set" in warning, warning
    assert "key pattern" not in warning and "~tkv-epoch" not in warning, warning


def test_an_acl_refusing_the_marker_key_still_names_the_key_pattern(own_redis, watching, caplog):
    b, _ = watching(limited_user(own_redis, "~tkv:*"))
    until(lambda: b.epoch.denied, "the refused key was never noticed")
    [warning] = epoch_warnings(caplog)
    assert "allow the key pattern ~tkv-epoch:tkv:" in warning and "+set" not in warning, warning


def test_regression_a_read_only_replica_refusing_the_marker_was_logged_at_debug_only(own_redis, watching, caplog,
                                                                                     monkeypatch):
    monkeypatch.setattr(epoch, "DENIED_EVERY_S", AN_HOUR)  # (a READONLY look must not wait for it)
    admin = redis.Redis(port=own_redis.port)
    b, heard = watching(own_redis.url)
    until(lambda: b.epoch.looks >= 1, "the watch never looked")
    admin.replicaof("127.0.0.1", free_port())  # a replica (of a master not there): writes refused
    until(lambda: epoch_warnings(caplog), "the READONLY marker was never said")
    looked = b.epoch.looks
    until(lambda: b.epoch.looks >= looked + 5, "the watch stopped looking at its usual interval")
    [warning] = epoch_warnings(caplog)  # once, however many looks were refused
    assert "read-only replica (READONLY)" in warning and "loss watch is off until it is writable" in warning
    assert not b.epoch.denied
    admin.replicaof("NO", "ONE")  # writable again: the watch is back
    until(lambda: any("writable again" in m for m in infos(caplog)), "the writable server was never looked at again")
    admin.flushall()
    until(lambda: "lost" in heard, "the flush after the watch came back was never heard")
    assert len(epoch_warnings(caplog)) == 2  # (the refusal, then the flush)
    admin.close()


def test_regression_a_redis_unable_to_persist_refusing_the_marker_was_logged_at_debug_only(own_redis, watching,
                                                                                           caplog):
    b, _ = watching(own_redis.url)
    until(lambda: b.epoch.looks >= 1, "the watch never looked")
    admin = misconf(own_redis)
    until(lambda: epoch_warnings(caplog), "the MISCONF marker was never said")
    looked = b.epoch.looks
    until(lambda: b.epoch.looks >= looked + 3, "the watch stopped looking")
    [warning] = epoch_warnings(caplog)
    assert "(MISCONF)" in warning and "loss watch is off until it is writable" in warning, warning
    admin.config_set("save", "")  # snapshots off: writes are taken again
    until(lambda: any("writable again" in m for m in infos(caplog)), "the writable server was never looked at again")
    assert len(epoch_warnings(caplog)) == 1
    admin.close()


def test_the_refusals_are_told_apart_by_what_the_server_answered(own_redis):
    admin = redis.Redis(port=own_redis.port)
    user = redis.Redis.from_url(acl_user(own_redis, "resetkeys", "~tkv:*", "-get"))
    try:
        kinds = []
        for command in ((lambda: user.set(b"tkv-epoch:tkv:", b"x")), (lambda: user.get(b"tkv:k"))):
            with pytest.raises(redis.ResponseError) as refused:
                command()
            kinds.append(refusal_of(refused.value))
        admin.replicaof("127.0.0.1", free_port())
        with pytest.raises(redis.ResponseError) as read_only:
            admin.set(b"k", b"v")
        kinds.append(refusal_of(read_only.value))
        assert kinds == ["key", "command:get", "readonly"]
        assert refusal_of(redis.ConnectionError("refused")) is None
    finally:
        admin.replicaof("NO", "ONE")
        user.close()
        admin.close()
