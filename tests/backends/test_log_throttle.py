"""A warning repeated on every failed call is logged once per interval, with a count."""

from __future__ import annotations

import logging

from storage_backends.log_throttle import LogThrottle


def test_repeats_within_the_interval_are_held_back_and_counted_in_the_next_warning(caplog):
    throttle = LogThrottle(logging.getLogger("test.throttle"), interval=3600)
    with caplog.at_level(logging.WARNING, logger="test.throttle"):
        assert throttle.warning("disk %s failed: %s", "/x", "EFBIG")
        assert not throttle.warning("disk %s failed: %s", "/x", "EFBIG")
        assert not throttle.warning("disk %s failed: %s", "/x", "EFBIG")
        throttle._next = 0.0  # the interval has passed
        assert throttle.warning("disk %s failed: %s", "/x", "EFBIG")
    messages = [r.getMessage() for r in caplog.records]
    assert messages == ["disk /x failed: EFBIG",
                        "disk /x failed: EFBIG (2 similar warnings in the last 3600 s not shown)"]
