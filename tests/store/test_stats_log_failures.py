"""The periodic stats line (``metrics_log_interval``) outlives a line that fails: a logging filter
of the application that raised once ended the stats thread, and no line came again. Real store
on tmp_path, real logging."""

from __future__ import annotations

import logging
import time

from tests.store.helpers import keys_for, load, make_store, payloads

LOGGER = "tiered_kv.store.stats_log"


class _FailsOnce(logging.Filter):
    """An application's filter that fails on the first record it sees, then lets all pass."""

    def __init__(self) -> None:
        super().__init__()
        self.failed = False

    def filter(self, record: logging.LogRecord) -> bool:
        if not self.failed:
            self.failed = True
            raise RuntimeError("filter broke once")
        return True


def test_regression_a_logging_filter_that_failed_once_silenced_the_stats_line_for_good(tmp_path, caplog):
    logger, failing = logging.getLogger(LOGGER), _FailsOnce()
    logger.addFilter(failing)
    try:
        with caplog.at_level(logging.INFO, logger=LOGGER):
            with make_store(tmp_path, metrics_log_interval=0.05) as store:
                keys = keys_for(2)
                store.save(keys, payloads(store, 2))
                store.flush()
                assert all(load(store, keys)[0])  # host hits: a line after the failure says so
                deadline = time.monotonic() + 30  # (a hang guard only)
                while not any("host 2 hits" in r.getMessage() for r in caplog.records):
                    assert time.monotonic() < deadline, "no stats line after one failed"
                    time.sleep(0.02)
                thread = store._stats_log._thread
                assert thread.is_alive()
            assert not thread.is_alive(), "the close stops the thread"
    finally:
        logger.removeFilter(failing)
    assert failing.failed
    skipped = [r for r in caplog.records if "stats line skipped" in r.getMessage()]
    assert [r.levelno for r in skipped] == [logging.WARNING], "the failure said once, at WARNING"
    assert "filter broke once" in skipped[0].getMessage()
