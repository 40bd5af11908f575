"""A namespace's ``cache_salt`` is a secret: the namespace record every lower tier keeps holds its
tenant label (a hash) instead, every tool still reads it (model id, shapes, the prompt's keys for
``explain``), and records an older version wrote with the salt in them are still read, never
shown, and rewritten without it. Real LMDB / file stores under tmp_path, the real CLI."""

from __future__ import annotations

import dataclasses
import json

import pytest

from storage_backends.lmdb_disk import LmdbBackend
from tests.cli.conftest import cli
from tests.store.helpers import NS, keys_for, make_store, payloads
from tiered_kv.errors import CorruptBlock
from tiered_kv.store.records import decode_namespace, namespace_key

SALT = "tenant-42-private-salt-7f3a9c"
SALTED = dataclasses.replace(NS, cache_salt=SALT)
SECRET = "correct horse battery staple"
PROMPT = ",".join(map(str, range(4 * NS.block_size + 3)))  # keys_for(4) and a partial block


def salted_store(tmp_path, **settings) -> str:
    """An engine's LMDB store of 4 blocks of the salted namespace (and its record); its URL."""
    with make_store(tmp_path, ns=SALTED, **settings) as store:
        store.save(keys_for(4, SALTED), payloads(store, 4))
        assert store.flush(30)
    return f"lmdb://{tmp_path}/lmdb"


def values_holding_the_salt(backend) -> list[str]:
    return [k.hex() for k in backend.scan() if SALT.encode() in bytes(backend.get_many([k])[0] or b"")]


def lmdb(path) -> LmdbBackend:
    return LmdbBackend(path, capacity=1 << 40, record_access=False)


def test_regression_the_config_cache_salt_was_stored_in_clear_in_every_tiers_namespace_record(tmp_path):
    url = salted_store(tmp_path, encryption_secret=SECRET)
    with lmdb(tmp_path / "lmdb") as backend:
        assert values_holding_the_salt(backend) == []
        record = json.loads(bytes(backend.get_many([namespace_key(SALTED.digest())])[0]))
    assert "cache_salt" not in record and record["tenant"] == SALTED.tenant.hex()

    # every tool still reads the record: the model, that it is salted, the prompt's blocks
    [tier] = cli("inspect", url, "--json").json()["tiers"]
    ns = tier["namespaces"][SALTED.digest().hex()]
    assert ns["record"] is True and ns["model_id"] == NS.model_id and ns["cache_salt"] is True
    assert ns["blocks"] == 4 and tier["broken_namespace_records"] == {}
    verify = cli("verify", url, "--json")
    assert verify.code == 0 and verify.json()["tiers"][0]["namespaces"] == 1, verify.out
    explain = cli("explain", url, "--token-ids", PROMPT, "--json")
    assert explain.code == 0 and explain.json()["matched_blocks"] == 4, explain.out + explain.err
    first = SALTED.digest().hex() + keys_for(1, SALTED)[0].hex()
    show = cli("show", url, first, "--json")
    assert show.code == 0 and show.json()["model_id"] == NS.model_id, show.out + show.err
    outputs = [cli(*args) for args in (("inspect", url), ("ls", url, "--json"), ("verify", url),
                                        ("explain", url, "--token-ids", PROMPT))]
    assert all(r.code == 0 for r in outputs)
    assert not [r for r in (*outputs, verify, explain, show) if SALT in r.out + r.err]

    # a copy carries the record (and so the model id) without the salt, to LMDB and to files
    for dest in (f"lmdb://{tmp_path}/copy", f"file://{tmp_path}/files"):
        copied = cli("copy", url, dest, "--json")
        assert copied.code == 0 and copied.json()["namespace_records"] == 1, copied.out + copied.err
        [tier] = cli("inspect", dest, "--json").json()["tiers"]
        assert tier["broken_namespace_records"] == {} and SALT not in json.dumps(tier)
    with lmdb(tmp_path / "copy") as backend:
        assert values_holding_the_salt(backend) == []
    assert not [p for p in (tmp_path / "files").rglob("*") if p.is_file() and SALT.encode() in p.read_bytes()]


def test_a_salted_record_moved_under_another_namespaces_key_does_not_match_it(tmp_path):
    salted_store(tmp_path)
    other = dataclasses.replace(SALTED, model_id="other-llama")
    with lmdb(tmp_path / "lmdb") as backend:
        value = bytes(backend.get_many([namespace_key(SALTED.digest())])[0])
    ns = decode_namespace(namespace_key(SALTED.digest()), value)
    assert ns.digest() == SALTED.digest() and ns.tenant == SALTED.tenant and SALT not in repr(ns)
    altered = value.replace(b'"num_layers":4', b'"num_layers":5')
    assert altered != value
    for key, val in ((namespace_key(other.digest()), value), (namespace_key(SALTED.digest()), altered)):
        with pytest.raises(CorruptBlock) as caught:  # moved, altered
            decode_namespace(key, val)
        assert caught.value.reason == "namespace_mismatch"


def legacy_record(path) -> None:
    """Put the record an older version wrote: every field, the salt among them."""
    with lmdb(path) as backend:
        key = namespace_key(SALTED.digest())
        assert backend.put_many([(key, json.dumps(SALTED.describe(), sort_keys=True).encode())]) == [True]
        assert values_holding_the_salt(backend) == [key.hex()]


def test_regression_records_an_older_version_wrote_with_the_salt_are_read_never_shown_and_scrubbed(tmp_path):
    url = salted_store(tmp_path)
    legacy_record(tmp_path / "lmdb")
    [tier] = cli("inspect", url, "--json").json()["tiers"]
    assert tier["broken_namespace_records"] == {} and SALT not in json.dumps(tier)
    assert cli("explain", url, "--token-ids", PROMPT, "--json").json()["matched_blocks"] == 4

    copied = cli("copy", url, f"lmdb://{tmp_path}/copy", "--json")  # the copy holds no salt
    assert copied.code == 0, copied.out + copied.err
    with lmdb(tmp_path / "copy") as backend:
        assert values_holding_the_salt(backend) == []

    report = cli("verify", url, "--json").json()["tiers"][0]  # said, never shown
    assert any("cache_salt in the clear" in n for n in report["notes"]) and SALT not in json.dumps(report)
    fixed = cli("verify", url, "--fix", "--json")
    assert fixed.code == 0 and SALT not in fixed.out
    assert any("without their cache_salt" in a for a in fixed.json()["tiers"][0]["actions"])
    with lmdb(tmp_path / "lmdb") as backend:
        assert values_holding_the_salt(backend) == []
    assert cli("inspect", url, "--json").json()["tiers"][0]["broken_namespace_records"] == {}


def test_a_store_of_the_salted_namespace_rewrites_an_older_versions_record_without_the_salt(tmp_path):
    salted_store(tmp_path)
    legacy_record(tmp_path / "lmdb")
    with make_store(tmp_path, ns=SALTED) as store:  # its first write checks the record
        store.save(keys_for(6, SALTED)[4:], payloads(store, 2))
        assert store.flush(30)
    with lmdb(tmp_path / "lmdb") as backend:
        assert values_holding_the_salt(backend) == []
        value = backend.get_many([namespace_key(SALTED.digest())])[0]
    assert decode_namespace(namespace_key(SALTED.digest()), value).tenant == SALTED.tenant
