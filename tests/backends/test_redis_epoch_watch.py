"""The Redis tier's loss watch (:mod:`storage_backends.redis_epoch`) against a real redis-server:
its thread sleeps between looks on an event that the tier's close (or the tier's collection) sets,
and a user whose ACL is limited to the tier's prefix (the marker lies outside it) is told once
which key pattern to allow. Nothing here waits on time: the tests wait on counters and threads,
with a hang guard."""

from __future__ import annotations

import gc
import logging
import re
import sys
import threading
from contextlib import suppress

import pytest
import redis

import storage_backends.redis_epoch as epoch
from storage_backends.registry import open_backend
from tests.backends.helpers import until
from tiered_kv.errors import BackendError

GUARD_S = 60  # a hang guard only: nothing here asserts how long anything took
AN_HOUR = 3600.0


def watching(backend, heard: list) -> threading.Thread:
    """Set a listener (which starts the watch); the watch's thread."""
    before = set(threading.enumerate())
    backend.listen(lambda change, keys: heard.append(change))
    return next(t for t in threading.enumerate() if t not in before and t.name == "tiered-kv-redis-epoch")


def sleeping_for(thread: threading.Thread) -> float | None:
    """The timeout of the ``threading.Event.wait`` ``thread`` is blocked in now, or None."""
    frame = sys._current_frames().get(thread.ident)
    while frame is not None:
        if frame.f_code.co_name == "wait" and isinstance(frame.f_locals.get("self"), threading.Event):
            return frame.f_locals.get("timeout")
        frame = frame.f_back
    return None


def epoch_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == epoch.__name__ and r.levelno == logging.WARNING]


def limited_user(server, *patterns: str) -> str:
    """The URL of a user that may use only the keys of ``patterns`` (ACL ``~pattern``)."""
    admin = redis.Redis(port=server.port)
    try:
        admin.execute_command("ACL", "SETUSER", "tier", "reset", "on", ">pw", *patterns, "+@all")
    finally:
        admin.close()
    return server.url.replace("redis://", "redis://tier:pw@")


def test_between_looks_the_watch_sleeps_the_whole_interval_and_the_tiers_close_ends_it_at_once(
        redis_url, monkeypatch):
    # the thread napped 0.25 s at a time to notice a close: it woke 4x a second for nothing,
    # and a close was seen up to a nap later
    monkeypatch.setattr(epoch, "CHECK_EVERY_S", AN_HOUR)
    b = open_backend(redis_url)
    thread = watching(b, heard := [])
    until(lambda: b.epoch.looks == 1 and sleeping_for(thread) == AN_HOUR,
          "the watch never slept on an event for the whole interval")
    b.close()
    thread.join(GUARD_S)
    assert not thread.is_alive(), "the watch outlived its closed tier"
    assert b.epoch.looks == 1 and heard == []


def test_a_dropped_tier_still_ends_its_watch(redis_url, monkeypatch):
    monkeypatch.setattr(epoch, "CHECK_EVERY_S", AN_HOUR)
    b = open_backend(redis_url)
    thread, watch = watching(b, []), b.epoch
    until(lambda: watch.looks == 1, "the watch never looked")
    del b  # never closed: the watch holds it weakly, so it is collected, and that ends the thread
    gc.collect()
    thread.join(GUARD_S)
    assert not thread.is_alive(), "the watch kept a dropped tier's thread alive"


def test_a_user_limited_to_the_prefix_is_told_once_which_key_to_allow_and_the_watch_looks_rarely(
        own_redis, monkeypatch, caplog):
    # the marker lies outside the prefix: NOPERM at every look, logged at DEBUG only, so losses
    # went unseen without a word
    caplog.set_level(logging.DEBUG, logger=epoch.__name__)
    monkeypatch.setattr(epoch, "CHECK_EVERY_S", 0.01)
    b = open_backend(limited_user(own_redis, "~tkv:*"))
    try:
        thread = watching(b, heard := [])
        until(lambda: b.epoch.looks >= 1, "the watch never looked")
        assert b.put_many([(b"k", b"v")]) == [True] and b.get_many([b"k"]) == [b"v"]  # the tier works
        assert len(epoch_warnings(caplog)) == 1
        assert "~tkv-epoch:tkv:" in epoch_warnings(caplog)[0]
        until(lambda: sleeping_for(thread) == epoch.DENIED_EVERY_S, "the watch kept looking every interval")
        assert b.epoch.looks == 1 and "lost" not in heard
    finally:
        b.close()
    thread.join(GUARD_S)
    assert not thread.is_alive()


def test_allowing_the_key_pattern_the_warning_names_makes_a_flush_heard_as_lost(own_redis, monkeypatch, caplog):
    caplog.set_level(logging.DEBUG, logger=epoch.__name__)
    monkeypatch.setattr(epoch, "CHECK_EVERY_S", 0.01)
    monkeypatch.setattr(epoch, "DENIED_EVERY_S", 0.01)  # (looks as often as allowed ones here)
    b = open_backend(limited_user(own_redis, "~tkv:*"))
    try:
        watching(b, heard := [])
        until(lambda: b.epoch.looks >= 5, "the watch never looked")
        [warning] = epoch_warnings(caplog)  # once, however many looks were refused
        pattern = re.search(r"~\S+", warning).group()
        limited_user(own_redis, "~tkv:*", pattern)  # what the warning asks for
        until(lambda: not b.epoch.denied, "the allowed marker was never looked at again")
        looked = b.epoch.looks
        until(lambda: b.epoch.looks >= looked + 2, "the watch stopped looking")  # (the marker was seen)
        assert heard == []
        own_redis.flushall()
        until(lambda: "lost" in heard, "the flush was never heard")
        assert len(epoch_warnings(caplog)) == 2  # the refusal, then the flush (nothing more was said)
    finally:
        b.close()


@pytest.mark.parametrize(("prefix", "cluster", "pattern"), [
    (b"tkv:", False, "~tkv-epoch:tkv:"),
    (b"tkv:", True, "~tkv-epoch:{*}tkv:"),
    (b"a*b?[c]:", False, r"~tkv-epoch:a\*b\?\[c\]:"),  # matched literally
])
def test_the_marker_pattern_names_the_marker_keys_only(prefix, cluster, pattern):
    assert epoch.marker_pattern(prefix, cluster) == pattern


def test_regression_a_look_skipped_while_the_tier_was_down_was_said_to_find_the_marker_allowed_again(
        own_redis, monkeypatch, caplog):
    """While the tier's breaker is open a look is skipped (nothing is asked of the server), and the
    watch took that skip for an allowed look: it said "allows the epoch marker again" (untrue) and
    went back to looking every CHECK_EVERY_S, so the refusal would be warned again."""
    caplog.set_level(logging.DEBUG, logger=epoch.__name__)
    monkeypatch.setattr(epoch, "CHECK_EVERY_S", 0.01)
    monkeypatch.setattr(epoch, "DENIED_EVERY_S", 0.01)  # (looks as often as allowed ones here)
    b = open_backend(limited_user(own_redis, "~tkv:*"))
    try:
        b.listen(lambda change, keys: None)
        until(lambda: b.epoch.denied, "the refused marker was never noticed")
        own_redis.stop()  # the server goes away: a call fails and the breaker opens
        until(lambda: tripped(b), "the breaker never opened")
        looked = b.epoch.looks
        until(lambda: b.epoch.looks >= looked + 3, "the watch stopped looking")  # (each one skipped)
        assert b.epoch.denied, "a skipped look cleared the refusal"
        said = [r.getMessage() for r in caplog.records if r.name == epoch.__name__ and r.levelno >= logging.INFO]
        assert not any("allows the epoch marker again" in m for m in said), said
    finally:
        b.close()


def tripped(b) -> bool:
    """A call made (it fails: the server is away); whether the tier's breaker is open now."""
    with suppress(BackendError):
        b.get_many([b"k"])
    return not b.available
