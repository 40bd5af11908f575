"""The periodic one-line traffic summary (``metrics_log_interval``)."""

from __future__ import annotations

import logging
import time

import pytest

from tests.store.helpers import keys_for, load, make_store, payloads
from tiered_kv.config import TieredKVConfig
from tiered_kv.errors import ConfigError
from tiered_kv.store.stats_log import summary_line


def test_the_summary_reports_what_changed_since_the_previous_line():
    tier = {"hits": 3, "misses": {"absent": 2}, "bytes_in": 1 << 20, "bytes_out": 0}
    before = {"tiers": {"disk": tier}, "events": {"saves_dropped": 1}, "queued_bytes": {}}
    now = {"tiers": {"disk": {"hits": 10, "misses": {"absent": 2, "corrupt": 1},
                              "bytes_in": 3 << 20, "bytes_out": 5 << 20}},
           "events": {"saves_dropped": 4}, "queued_bytes": {"save": 2048, "load": 0}}
    line = summary_line(now, before)
    assert line.startswith("disk 7 hits / 1 misses (corrupt 1), in 2.0 MiB, out 5.0 MiB")
    assert "queued save 2.0 KiB" in line and line.endswith("events saves_dropped 3")


def test_a_store_logs_its_traffic_periodically_and_stops_when_closed(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="tiered_kv.store.stats_log"):
        store = make_store(tmp_path, metrics_log_interval=0.05)
        keys = keys_for(4)
        store.save(keys, payloads(store, 4))
        store.flush()
        load(store, keys)
        deadline = time.monotonic() + 5
        while not any("host 4 hits" in r.getMessage() for r in caplog.records):
            assert time.monotonic() < deadline, [r.getMessage() for r in caplog.records]
            time.sleep(0.02)
        store.close()
    assert not store._stats_log._thread.is_alive()


@pytest.mark.parametrize("value", ["0s", "-1", "soon"])
def test_a_bad_interval_is_a_config_error_naming_it(value):
    with pytest.raises(ConfigError, match="metrics_log_interval"):
        TieredKVConfig.from_dict({"metrics_log_interval": value})


def test_the_interval_comes_from_the_environment_too():
    cfg = TieredKVConfig.from_env({"TIERED_KV_METRICS_LOG_INTERVAL": "30s"})
    assert cfg.metrics_log_interval == 30.0
