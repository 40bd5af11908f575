"""`inspect` shows what each tenant (a cache_salt label) holds in a tier that keeps figures per
tenant, with its share of the tenant quota: labels in hex, what no tenant stored as `-`."""

from __future__ import annotations

from storage_backends.lmdb_disk import LmdbBackend
from tests.cli.conftest import cli

ALICE, BOB = bytes.fromhex("a11ce00000000001"), bytes.fromhex("b0b0000000000002")


def fill(path) -> None:
    """Alice stores 3 values of 1,000 bytes, Bob 2 of 5,000; 1 value of 10 bytes has no tenant."""
    backend = LmdbBackend(path, capacity="64MiB")
    try:
        assert all(backend.put_many([(b"alice-%d" % i, b"a" * 1000) for i in range(3)], tenant=ALICE))
        assert all(backend.put_many([(b"bob-%d" % i, b"b" * 5000) for i in range(2)], tenant=BOB))
        assert all(backend.put_many([(b"shared", b"s" * 10)]))
    finally:
        backend.close()


def test_inspect_reports_bytes_and_entries_per_tenant_against_the_configured_quota(tmp_path):
    fill(tmp_path / "store")
    config = tmp_path / "tkv.toml"
    config.write_text(f'[disk]\nurl = "lmdb://{tmp_path / "store"}"\ntenant_quota = "10000"\n')
    [tier] = cli("inspect", "--config", config, "--json").json()["tiers"]
    assert tier["tenant_quota_bytes"] == 10_000
    assert tier["tenants"] == {
        ALICE.hex(): {"stored_bytes": 3000, "entries": 3, "quota_bytes": 10_000, "quota_used": 0.3},
        BOB.hex(): {"stored_bytes": 10_000, "entries": 2, "quota_bytes": 10_000, "quota_used": 1.0},
        "-": {"stored_bytes": 10, "entries": 1, "quota_bytes": None, "quota_used": None},
    }
    text = cli("inspect", "--config", config)
    assert text.code == 0 and "usage per tenant" in text.out
    rows = {line.split()[1]: line for line in text.out.splitlines() if line.startswith("│ ")}
    assert "30.0%" in rows[ALICE.hex()] and "100.0%" in rows[BOB.hex()]


def test_without_a_quota_usage_is_shown_alone_and_without_tenants_only_in_json(tmp_path):
    fill(tmp_path / "store")
    [tier] = cli("inspect", tmp_path / "store", "--json").json()["tiers"]
    assert tier["tenant_quota_bytes"] is None
    assert {label: t["stored_bytes"] for label, t in tier["tenants"].items()} == \
        {ALICE.hex(): 3000, BOB.hex(): 10_000, "-": 10}
    assert all(t["quota_used"] is None for t in tier["tenants"].values())
    assert "usage per tenant" in cli("inspect", tmp_path / "store").out

    untenanted = LmdbBackend(tmp_path / "plain", capacity="64MiB")
    untenanted.put_many([(b"shared", b"s" * 10)])
    untenanted.close()
    [tier] = cli("inspect", tmp_path / "plain", "--json").json()["tiers"]
    assert tier["tenants"] == {"-": {"stored_bytes": 10, "entries": 1, "quota_bytes": None, "quota_used": None}}
    assert "usage per tenant" not in cli("inspect", tmp_path / "plain").out, "one '-' row says nothing more"
