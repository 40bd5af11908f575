"""The fleet dashboard (examples/grafana_dashboard.json) queries only metrics and labels the
exporter really has: scraped from a store with host, LMDB and Redis tiers after some traffic,
and again with Redis away (its tier shows as down)."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import pytest

from tests.store.helpers import keys_for, load, make_store, payloads
from tiered_kv.errors import BackendUnavailable
from tiered_kv.store.prometheus import export, unexport

DASHBOARD = Path(__file__).resolve().parents[2] / "examples" / "grafana_dashboard.json"
METRIC = re.compile(r"\btiered_kv_[a-z_]+\b")
BY = re.compile(r"\bby \(([^)]*)\)")
SAMPLE = re.compile(r"^(tiered_kv_[a-z_]+)\{([^}]*)\} ")


def _exprs() -> list[str]:
    board = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p["targets"]]
    exprs += [v["query"] for v in board["templating"]["list"] if v["type"] == "query"]
    return exprs


def _scrape(store) -> dict[str, set[str]]:
    """Metric name -> label names, as Prometheus would scrape them from ``store``."""
    port = export(store, 0, "127.0.0.1")
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    finally:
        unexport(store)
    found: dict[str, set[str]] = {}
    for line in text.splitlines():
        if m := SAMPLE.match(line):
            found.setdefault(m.group(1), set()).update(kv.split("=")[0] for kv in m.group(2).split(","))
    return found


def test_every_metric_and_label_the_dashboard_queries_is_exported(tmp_path, redis_server):
    with make_store(tmp_path, remote_url=redis_server.url) as store:
        keys = keys_for(6)
        store.save(keys, payloads(store, 6))
        store.flush()
        load(store, keys + keys_for(2, first_token=999_000))  # hits, and misses with reasons
        found = _scrape(store)
    for expr in _exprs():
        names = set(METRIC.findall(expr))
        assert names and names <= set(found), f"not exported: {sorted(names - set(found))} in {expr}"
        labels = set().union(*(found[n] for n in names))
        for group in BY.findall(expr):
            wanted = {g.strip() for g in group.split(",")} - {"instance"}  # Prometheus adds instance
            assert wanted <= labels, f"labels {sorted(wanted - labels)} missing for {expr}"


def test_a_redis_tier_whose_breaker_is_open_shows_as_down(tmp_path, own_redis):
    with make_store(tmp_path, remote_url=own_redis.url) as store:
        store.save(keys_for(2), payloads(store, 2))
        store.flush()
        assert 'tier="remote"' in _up_lines(store, 1)
        own_redis.stop()
        with pytest.raises(BackendUnavailable):  # the call that finds Redis gone opens the breaker
            store.tier("remote").backend.get_many([b"k" * 16])
        assert 'tier="remote"' in _up_lines(store, 0)


def _up_lines(store, value: int) -> str:
    port = export(store, 0, "127.0.0.1")
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    finally:
        unexport(store)
    return "\n".join(line for line in text.splitlines()
                     if line.startswith("tiered_kv_tier_up{") and line.endswith(f" {float(value)}"))
