"""``tiered-kv evict --namespace NS`` removes the blocks of the one namespace NS names, never
another's: a spec that names one namespace by its model id and begins another's digest is
ambiguous and refused (exit 2, nothing removed). Real LMDB under tmp_path, the real CLI."""

from __future__ import annotations

import dataclasses

from storage_backends.lmdb_disk import LmdbBackend
from tests.cli.conftest import cli
from tests.store.helpers import NS, keys_for, make_store, payloads


def test_regression_evict_by_a_hex_model_id_removed_the_blocks_of_the_namespace_whose_digest_it_begins(
        tmp_path):
    hexy = dataclasses.replace(NS, model_id=NS.digest().hex()[:6])  # a model id of hex digits
    for ns in (NS, hexy):
        with make_store(tmp_path, ns=ns) as store:
            store.save(keys_for(3, ns), payloads(store, 3))
            assert store.flush(30)
    url = f"lmdb://{tmp_path}/lmdb"
    theirs = [NS.digest() + k for k in keys_for(3, NS)]

    result = cli("evict", url, "--namespace", hexy.model_id, "--json")

    with LmdbBackend(tmp_path / "lmdb", capacity=1 << 40, record_access=False) as backend:
        assert backend.contains_many(theirs) == [True] * 3, "another model's blocks were evicted"
    assert result.code == 2 and "matches 2 namespaces" in result.err, result.out + result.err
    assert result.err.count("\n") == 1 and "Traceback" not in result.err

    by_digest = cli("evict", url, "--namespace", hexy.digest().hex()[:12], "--json")
    assert by_digest.code == 0 and by_digest.json()["tiers"][0]["evicted_blocks"] == 3
    with LmdbBackend(tmp_path / "lmdb", capacity=1 << 40, record_access=False) as backend:
        assert backend.contains_many(theirs) == [True] * 3
        assert not any(backend.contains_many([hexy.digest() + k for k in keys_for(3, hexy)]))
