"""``tiered-kv copy`` puts every block for the tenant its source stores it for: the destination's
usage per tenant (``inspect``) and its tenant quotas follow the blocks, on LMDB and on files.
Real stores under tmp_path, the real CLI."""

from __future__ import annotations

from storage_backends.lmdb_disk import LmdbBackend
from tests.cli.conftest import cli
from tests.store.helpers import keys_for, make_store, payloads
from tiered_kv.keys import tenant_label

ALICE, BOB = tenant_label("tenant-a"), tenant_label("tenant-b")


def engine_store(tmp_path) -> str:
    """An engine's LMDB store: 4 blocks of Alice's, 2 of Bob's, 1 of no tenant (encrypted, so
    each under its tenant's key); its URL."""
    keys = keys_for(7)
    with make_store(tmp_path, encryption_secret="correct horse battery staple") as store:
        store.save(keys[:4], payloads(store, 4), ALICE)
        store.save(keys[4:6], payloads(store, 2, seed=1), BOB)
        store.save(keys[6:], payloads(store, 1, seed=2))
        assert store.flush(30)
    return f"lmdb://{tmp_path}/lmdb"


def entries_per_tenant(url: str) -> dict[str, int]:
    [tier] = cli("inspect", url, "--json").json()["tiers"]
    return {label: t["entries"] for label, t in tier["tenants"].items()}


def test_regression_copy_put_every_block_untenanted_so_they_escaped_their_tenants_quota(tmp_path):
    url = engine_store(tmp_path)
    held = {ALICE.hex(): 4, BOB.hex(): 2, "-": 2}  # "-": the untenanted block and the namespace record
    assert entries_per_tenant(url) == held
    for dest in (f"lmdb://{tmp_path}/copy", f"file://{tmp_path}/files"):
        result = cli("copy", url, dest, "--json")
        assert result.code == 0 and result.json()["copied"] == 7, result.out + result.err
        assert entries_per_tenant(dest) == held, dest
    with LmdbBackend(tmp_path / "copy", capacity=1 << 40, record_access=False) as copy:
        tenants = {copy.entry_meta(k)["tenant"] for k in copy.scan() if len(k) == 32}
    assert tenants == {ALICE, BOB, b""}

    # and from the file store on: its files name their tenants too
    result = cli("copy", f"file://{tmp_path}/files", f"lmdb://{tmp_path}/again", "--json")
    assert result.code == 0 and result.json()["copied"] == 7, result.out + result.err
    assert entries_per_tenant(f"lmdb://{tmp_path}/again") == held


def test_a_copied_tenants_blocks_count_against_its_quota_where_they_land(tmp_path):
    url = engine_store(tmp_path)
    result = cli("copy", url, f"lmdb://{tmp_path}/copy", "--json")
    assert result.code == 0, result.out + result.err
    with LmdbBackend(tmp_path / "copy", capacity=1 << 40, record_access=False) as copy:
        copied = {t: [k for k in copy.scan() if len(k) == 32 and copy.entry_meta(k)["tenant"] == t]
                  for t in (ALICE, BOB)}
        quota = copy.tenant_totals()[ALICE].used_bytes
    # the engine runs the copy with Alice held to what she has: her next block evicts her own
    with LmdbBackend(tmp_path / "copy", capacity="1GiB", tenant_quota=quota) as engine:
        assert engine.put_many([(b"alice-next", b"a" * 20_000)], tenant=ALICE) == [True]
        held = {t: sum(engine.contains_many(keys)) for t, keys in copied.items()}
        assert engine.tenant_totals()[ALICE].used_bytes <= quota
    assert held[ALICE] < 4, "Alice's copied blocks escaped her quota"
    assert held[BOB] == 2, "Bob paid for Alice"
