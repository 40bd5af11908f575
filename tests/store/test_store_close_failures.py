"""A store whose last steps of starting or closing fail still lets go of what it holds: its
exporter's series, its pool's threads and its media."""

from __future__ import annotations

import threading

import pytest

import tiered_kv.store.prometheus as prometheus
import tiered_kv.store.tiered_store as tiered_store
from tests.store.helpers import keys_for, make_store, payloads


def _exported_stores() -> int:
    return sum(len(collector._stores) for _, _, collector in prometheus._servers.values())


def test_regression_a_store_whose_stats_log_failed_to_start_stayed_exported_with_its_server(tmp_path, monkeypatch):
    class NoThread:  # the last part to start: a thread refused ("can't start new thread")
        def __init__(self, *args, **kwargs):
            raise RuntimeError("can't start new thread")

    monkeypatch.setattr(tiered_store, "StatsLogger", NoThread)
    before = _exported_stores()
    with pytest.raises(RuntimeError):
        make_store(tmp_path, metrics_port=0, metrics_log_interval=60)
    assert _exported_stores() == before, "a store never made stays scraped, its media closed under it"
    with make_store(tmp_path) as store:  # and its directory opens again at once
        assert store.lookup(keys_for(1)) == 0


def test_regression_a_close_whose_cost_record_raised_left_the_pool_and_media_open(tmp_path):
    before = {t.ident for t in threading.enumerate()}
    store = make_store(tmp_path)
    keys = keys_for(2)
    store.save(keys, payloads(store, 2))

    stop_recording = store.cost_record.close

    def broken() -> None:  # its thread stopped, then the last write of the record failed
        stop_recording()
        raise OSError("disk gone while the restore costs were written")

    store.cost_record.close = broken
    with pytest.raises(OSError):
        store.close()
    left = [t.name for t in threading.enumerate() if t.ident not in before and t.is_alive()]
    assert left == [], f"threads left running: {left}"
    with make_store(tmp_path) as again:  # its LMDB environment was closed: it opens again
        assert again.lookup(keys) == 2  # (and the flush ran)
