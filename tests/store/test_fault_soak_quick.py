"""The fault soak of issue 10 in its quick form (``tools/fault_soak.py --quick --json``, a child
process): SIGKILLs mid-write, flipped bytes and lying headers in LMDB / Redis / file:// tiers, a
Redis killed and hung under the reference engine, a full filesystem, and two processes sharing
one LMDB directory and one Redis. Every figure that must be zero (or 100 %) is asserted here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SOAK_TIMEOUT_S = 180


@pytest.fixture(scope="module")
def soak() -> dict:
    """One quick soak run shared by the tests below; its JSON report's sections."""
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "fault_soak.py"), "--quick", "--json"],
                          capture_output=True, text=True, timeout=SOAK_TIMEOUT_S, cwd=REPO)
    lines = proc.stdout.strip().splitlines()
    assert lines, f"no report (exit {proc.returncode}): {proc.stderr[-3000:]}"
    report = json.loads(lines[-1])
    assert report["quick"] is True
    for name, figures in report["sections"].items():
        assert "error" not in figures, f"section {name} broke off: {figures['error']}"
    return report["sections"]


def test_sigkill_mid_write_never_serves_a_torn_block_and_loses_nothing_acknowledged(soak):
    s = soak["sigkill"]
    assert s["kills"] >= 10 and s["reopens"] == s["kills"]
    assert s["torn_served"] == 0
    assert s["reopen_ok_pct"] == 100.0, s["errors"]
    assert s["durable_lost"] == 0
    assert s["durable_acknowledged"] > 0, "the children acknowledged nothing: the check proved nothing"


def test_flipped_bytes_and_lying_headers_are_counted_misses_in_every_tier(soak):
    s = soak["corruption"]
    assert set(s["tiers"]) == {"lmdb", "file", "redis"} and not s["tier_errors"]
    assert s["damaged_loaded"] >= 100 and all(t["stored"] == t["blocks"] for t in s["tiers"].values())
    assert s["detected_pct"] == 100.0, {n: t["lies_by_kind"] for n, t in s["tiers"].items()}
    assert s["wrong_served"] == 0
    assert s["exceptions"] == 0, s["exception_kinds"]
    assert s["host_slots_leaked"] == 0, {n: t["host_slots_held"] for n, t in s["tiers"].items()}


def test_engine_rides_out_a_killed_and_a_hung_redis_with_identical_outputs(soak):
    s = soak["redis_outage"]
    assert s["engine_errors"] == 0, s["errors"]
    assert s["outputs_identical"] is True
    up = ("warm_hits", "restarted_hits", "continued")
    assert sum(s["phases"][p]["external_tokens"] for p in up) > 0, "Redis served nothing even when up"
    assert s["lookup_ms_p99"] is not None and s["hung_lookups"] > 0


def test_full_filesystem_keeps_every_committed_block(soak):
    s = soak["disk_full"]
    assert s["committed"] > 0 and s["save_failures_counted"] > 0, "the limit was never reached"
    assert s["committed_lost"] == 0
    assert s["save_exceptions"] == 0 and s["wrong_served"] == 0


def test_two_processes_on_one_lmdb_and_two_engines_on_one_redis_agree(soak):
    s = soak["shared"]
    assert s["inconsistent"] == 0, s
    assert s["committed_lost"] == 0, s
    assert s["lmdb"]["cross_read"] > 0 and s["redis_engines"]["blocks_reported_stored"] > 0
