"""The periodic stats line (``metrics_log_interval``) is made of the store's own counters: a
Redis tier that hangs does not hold it (the line never showed Redis' figures, yet every line
asked Redis for them)."""

from __future__ import annotations

import logging
import signal
import time

from tests.store.helpers import keys_for, load, make_store, payloads


def test_regression_the_stats_line_waited_on_a_hung_redis(tmp_path, own_redis, caplog):
    # a Redis timeout far longer than the wait below: a line that asks Redis cannot come in time
    with caplog.at_level(logging.INFO, logger="tiered_kv.store.stats_log"):
        store = make_store(tmp_path, remote_url=own_redis.url, remote={"timeout": 60, "retries": 1},
                           metrics_log_interval=0.05)
        try:
            keys = keys_for(3)
            store.save(keys, payloads(store, 3))
            store.flush()
            own_redis.proc.send_signal(signal.SIGSTOP)  # connections open, no answers
            assert all(load(store, keys)[0])  # host hits: the next line says so
            deadline = time.monotonic() + 20
            while not any("host 3 hits" in r.getMessage() for r in caplog.records):
                assert time.monotonic() < deadline, "no stats line while Redis hangs"
                time.sleep(0.02)
        finally:
            own_redis.proc.send_signal(signal.SIGCONT)
            store.close()
    line = next(r.getMessage() for r in caplog.records if "host 3 hits" in r.getMessage())
    assert "disk" in line and "remote" in line, line  # every tier's traffic, from the counters
