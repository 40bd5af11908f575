"""The dashboard's panel of lost writes shows every tier's failed writes, whatever the tier is
called: a Redis tier that is down loses every write-behind (``remote_save_failed``), and the panel
used to show the disk tier's alone."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

from tests.store.helpers import keys_for, make_store, payloads
from tiered_kv.store.prometheus import export, unexport

DASHBOARD = Path(__file__).resolve().parents[2] / "examples" / "grafana_dashboard.json"
EVENT = re.compile(r'^tiered_kv_events_total\{[^}]*event="([^"]+)"[^}]*\} (\S+)$')


def _lost_writes_filter() -> re.Pattern:
    """The event matcher of the panel of dropped saves and failed loads (Prometheus anchors it)."""
    board = json.loads(DASHBOARD.read_text())
    panel = next(p for p in board["panels"] if p["title"].startswith("Dropped saves and failed loads"))
    (matcher,) = [m for t in panel["targets"] for m in re.findall(r'event=~"([^"]+)"', t["expr"])]
    return re.compile(matcher)


def _events(store) -> dict[str, float]:
    port = export(store, 0, "127.0.0.1")
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    finally:
        unexport(store)
    return {m.group(1): float(m.group(2)) for line in text.splitlines() if (m := EVENT.match(line))}


def test_regression_the_dashboard_hid_the_failed_writes_of_a_redis_tier_that_is_down(tmp_path, own_redis):
    with make_store(tmp_path, remote_url=own_redis.url,
                    tiers=[{"name": "shared", "url": f"file://{tmp_path}/files"}]) as store:
        own_redis.stop()
        store.save(keys_for(3), payloads(store, 3))
        store.flush()
        events = _events(store)
    lost = {name for name, n in events.items() if name.endswith(("_save_failed", "_save_rejected")) and n}
    assert "remote_save_failed" in lost, events
    shown = _lost_writes_filter()
    assert {name for name in lost if not shown.fullmatch(name)} == set()
    assert shown.fullmatch("loads_failed") and shown.fullmatch("shared_save_failed")
    assert not shown.fullmatch("admission_skipped"), "a chosen skip is no lost write"
