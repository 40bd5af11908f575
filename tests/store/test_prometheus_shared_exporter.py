"""Two open stores of the same namespace and model on one exporter (an engine opening its store
again before the first is closed, or two replicas of a model in one process): each store's series
are its own, once each, and stay its own when the other closes. Real stores on tmp_path, real
HTTP scrapes, parsed by prometheus_client's parser."""

from __future__ import annotations

import urllib.request
from contextlib import contextmanager

from prometheus_client.parser import text_string_to_metric_families

from tests.store.helpers import keys_for, load, make_store, payloads
from tiered_kv.store.prometheus import export, unexport


def _scrape(port: int) -> dict[tuple, float]:
    """(sample name, sorted labels) -> value, failing on a series given twice."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    series: dict[tuple, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = (s.name, tuple(sorted(s.labels.items())))
            assert key not in series, f"series given twice: {key}"
            series[key] = s.value
    return series


def _hit(store, keys: list[bytes]) -> None:
    """Save ``keys`` to ``store`` and load them back: host hits, one per key."""
    store.save(keys, payloads(store, len(keys)))
    store.flush()
    assert all(load(store, keys)[0])


def _host_hits(series: dict[tuple, float], metric: str = "tiered_kv_hits_total") -> dict[str | None, float]:
    """``store`` label (None: none) -> the host tier's ``metric``."""
    return {dict(labels).get("store"): value for (name, labels), value in series.items()
            if name == metric and dict(labels)["tier"] == "host"}


@contextmanager
def _two_stores_exported(tmp_path):
    """Two open stores of one namespace, 3 and 1 host hits, exported on one port: (first, second,
    port); the second is unexported at the end (the first by its close, or here)."""
    with make_store(tmp_path / "a") as first, make_store(tmp_path / "b") as second:
        _hit(first, keys_for(3))
        _hit(second, keys_for(1))
        port = export(first, 0, "127.0.0.1")
        try:
            assert export(second, port, "127.0.0.1") == port
            yield first, second, port
        finally:
            unexport(second)
            unexport(first)


def test_regression_two_stores_of_one_namespace_on_one_exporter_gave_every_series_twice(tmp_path):
    with _two_stores_exported(tmp_path) as (_, _, port):
        series = _scrape(port)
    assert _host_hits(series) == {None: 3, "2": 1}, "each store's own count, once"


def test_regression_the_first_store_closing_moved_the_second_stores_counts_onto_its_series(tmp_path):
    # the second store's counts took over the first's series once it closed: a counter went down
    with _two_stores_exported(tmp_path) as (first, second, port):
        before = _host_hits(_scrape(port))
        first.close()  # (unexports it; the exporter stays up for the second)
        _hit(second, keys_for(1, first_token=16))
        after = _host_hits(_scrape(port))
        with make_store(tmp_path / "c") as third:  # opened again: the first's place is free
            export(third, port, "127.0.0.1")
            again = _scrape(port)
            unexport(third)
    assert before == {None: 3, "2": 1}
    assert after == {"2": 2}, "the second store's series kept, the first's gone"
    assert _host_hits(again) == {"2": 2}, "a store without traffic has no hits series yet"
    assert _host_hits(again, "tiered_kv_tier_up") == {None: 1, "2": 1}
