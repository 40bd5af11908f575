"""The Redis tier's loss watch (:mod:`storage_backends.redis_epoch`) for a user whose ACL refuses
the epoch marker, when the server then goes away: while the tier's breaker is open a look is
skipped (nothing is asked of the server), and the watch took that skip for an allowed look. It
said "allows the epoch marker again: losses are announced" (untrue: nothing was looked at) and
went back to looking every CHECK_EVERY_S, so the refusal would be warned again. Real
redis-server; the test waits on counters and the breaker, with a hang guard."""

from __future__ import annotations

import logging
import time
from contextlib import suppress

import redis

import storage_backends.redis_epoch as epoch
from storage_backends.registry import open_backend
from tiered_kv.errors import BackendError

GUARD_S = 60  # a hang guard only: nothing here asserts how long anything took


def until(check, what: str) -> None:
    end = time.monotonic() + GUARD_S
    while not check():
        assert time.monotonic() < end, f"hang guard: {what}"
        time.sleep(0.01)


def test_regression_a_look_skipped_while_the_tier_was_down_was_said_to_find_the_marker_allowed_again(
        own_redis, monkeypatch, caplog):
    caplog.set_level(logging.DEBUG, logger=epoch.__name__)
    monkeypatch.setattr(epoch, "CHECK_EVERY_S", 0.01)
    monkeypatch.setattr(epoch, "DENIED_EVERY_S", 0.01)  # (looks as often as allowed ones here)
    admin = redis.Redis(port=own_redis.port)
    admin.execute_command("ACL", "SETUSER", "tier", "reset", "on", ">pw", "~tkv:*", "+@all")
    admin.close()
    b = open_backend(own_redis.url.replace("redis://", "redis://tier:pw@"))
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
