"""Encryption at rest through the store, on a real LMDB tier and a real Redis: a replica with the
secret loads exactly what was saved (copies up stay sealed); one without it, or with another
secret or as another tenant, gets counted misses (no exception, no bytes) and leaves the blocks
for the replicas that can read them; the media hold no plaintext; the CLI checks sealed blocks
without the key; the secret never shows in the config's text forms."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from tests.cli.conftest import cli
from tests.store.helpers import keys_for, load, load_staged, make_store, payloads, rewrite_stored_blocks
from tiered_kv.config import TieredKVConfig
from tiered_kv.errors import ConfigError
from tiered_kv.store.codec import BlockCodec
from tiered_kv.store.codec_header import HEADER_BYTES, pack_header

SECRET = "correct horse battery staple"
OTHER = "another secret, just as long"
N = 6


def stored(tmp_path, secret: str | None = SECRET, tenant: bytes | None = None, **over):
    """Blocks saved (and flushed to LMDB) by a store with ``secret``; (keys, payloads)."""
    with make_store(tmp_path, encryption_secret=secret, **over) as store:
        keys, data = keys_for(N), payloads(store, N)
        store.save(keys, data, tenant)
        assert store.flush(30)
    return keys, data


def stored_values(tmp_path) -> list[bytes]:
    seen: list[bytes] = []
    rewrite_stored_blocks(tmp_path / "lmdb", lambda k, v: seen.append(v))
    return seen


@pytest.mark.parametrize("loader", [load, load_staged])
def test_the_secret_holder_loads_exactly_what_was_saved(tmp_path, loader):
    keys, data = stored(tmp_path)
    with make_store(tmp_path, encryption_secret=SECRET) as store:
        ok, outs = loader(store, keys)
        assert ok == [True] * N
        assert all(torch.equal(a, b) for a, b in zip(outs, data))
        assert store.metrics.misses() == 0


def test_lmdb_holds_sealed_blocks_with_no_plaintext_run(tmp_path):
    keys, data = stored(tmp_path, disk={"codec": "raw"})  # raw: a plain block would hold the payload
    values = stored_values(tmp_path)
    assert len(values) == N and all(BlockCodec.read_header(v).sealed for v in values)
    everything = b"".join(values)
    windows = {everything[i : i + 16] for i in range(len(everything) - 15)}
    for p in data:
        raw = p.view(torch.uint8).numpy().tobytes()
        assert not any(raw[i : i + 16] in windows for i in range(0, len(raw), 16))


@pytest.mark.parametrize(("secret", "reason"), [(None, "no_key"), (OTHER, "wrong_key")])
def test_a_replica_without_the_secret_counts_misses_and_leaves_the_blocks(tmp_path, secret, reason):
    keys, data = stored(tmp_path)
    with make_store(tmp_path, encryption_secret=secret) as store:
        for loader in (load, load_staged):
            ok, outs = loader(store, keys)
            assert ok == [False] * N
            assert all(o is None or not o.any() for o in outs)  # no byte of a block it cannot open
        assert store.metrics.misses(reason) == 2 * N
        assert store.metrics.misses("corrupt") == 0
        assert store.present(keys) == [True] * N  # left for replicas that hold the key
    with make_store(tmp_path, encryption_secret=SECRET) as store:
        ok, outs = load(store, keys)
        assert ok == [True] * N and all(torch.equal(a, b) for a, b in zip(outs, data))


def test_regression_after_a_secret_rotation_the_old_blocks_missed_for_good(tmp_path):
    """A replica with a new secret read the old blocks as ``wrong_key`` misses, recomputed them,
    and its save skipped them (the tier held those keys): every later restart missed again. The
    save now replaces a block this replica read as sealed under another secret."""
    keys, data = stored(tmp_path)
    with make_store(tmp_path, encryption_secret=OTHER) as store:
        ok, _ = load(store, keys[:4])
        assert ok == [False] * 4 and store.metrics.misses("wrong_key") == 4
        store.save(keys, data)  # the engine recomputed and saves them all
        assert store.flush(30)
    with make_store(tmp_path, encryption_secret=OTHER) as store:
        ok, outs = load(store, keys)
        assert ok == [True] * 4 + [False] * (N - 4)  # the blocks never read here were left alone
        assert all(torch.equal(a, b) for a, b in zip(outs[:4], data))
        assert store.metrics.misses("wrong_key") == N - 4
    with make_store(tmp_path, encryption_secret=SECRET) as store:  # the old secret: its last two
        ok, _ = load(store, keys)
        assert ok == [False] * 4 + [True] * (N - 4)


def test_a_replica_without_the_secret_never_replaces_sealed_blocks(tmp_path):
    keys, data = stored(tmp_path)
    with make_store(tmp_path) as store:
        ok, _ = load(store, keys)
        assert ok == [False] * N and store.metrics.misses("no_key") == N
        store.save(keys, data)
        assert store.flush(30)
    assert all(BlockCodec.read_header(v).sealed for v in stored_values(tmp_path))


def test_plain_blocks_are_refused_once_encryption_is_on_and_replaced_by_sealed_ones(tmp_path):
    keys, data = stored(tmp_path, secret=None)
    with make_store(tmp_path, encryption_secret=SECRET) as store:
        ok, _ = load(store, keys)
        assert ok == [False] * N and store.metrics.misses("unencrypted") == N
        assert store.present(keys) == [False] * N  # removed: a sealed copy may take their place
        store.save(keys, data)
        assert store.flush(30)
    assert all(BlockCodec.read_header(v).sealed for v in stored_values(tmp_path))
    with make_store(tmp_path, encryption_secret=SECRET) as store:
        ok, outs = load(store, keys)
        assert ok == [True] * N and all(torch.equal(a, b) for a, b in zip(outs, data))


def test_another_tenants_blocks_fail_authentication(tmp_path):
    keys, data = stored(tmp_path, tenant=b"alice-01")
    with make_store(tmp_path, encryption_secret=SECRET) as store:
        for tenant, want in ((b"bob--002", False), (b"alice-01", True)):
            plan = store.load(store.prepare_load(keys, tenant))
            try:
                plan.wait(30)
                assert plan.ok == [want] * N
                if want:
                    assert all(torch.equal(store.slot_tensor(s), p) for s, p in zip(plan.slots, data))
            finally:
                store.release(plan)
        assert store.metrics.misses("wrong_key") == N


def test_regression_another_tenant_was_served_a_tenants_plaintext_from_host_memory(tmp_path):
    """The host tier keeps plaintext and leased its entries to whoever asked: bob, asking for
    alice's keys, got her bytes (and his lease resealed them under his key for the tiers below).
    Another tenant's host entry is now a ``wrong_key`` miss, as the lower tiers' copies are."""
    alice, bob = b"alice-01", b"bob--002"
    with make_store(tmp_path, encryption_secret=SECRET) as store:
        keys, data = keys_for(N), payloads(store, N)
        store.save(keys, data, alice)
        assert store.flush(30)
        for tenant, want in ((bob, False), (alice, True)):
            plan = store.load(store.prepare_load(keys, tenant))
            try:
                plan.wait(30)
                assert plan.ok == [want] * N and (plan.slots == [None] * N) is not want
                if want:
                    assert all(torch.equal(store.slot_tensor(s), p) for s, p in zip(plan.slots, data))
            finally:
                store.release(plan)
        assert store.metrics.misses("wrong_key") == N
        assert bob not in store.tier("disk").backend.tenant_totals(), "nothing resealed for bob"


def test_a_sealed_block_moved_under_another_key_is_never_served(tmp_path):
    keys, _ = stored(tmp_path)
    first = stored_values(tmp_path)[0]

    def move(storage_key: bytes, value: bytes):  # every block replaced by the first one, header rewritten
        h, f = BlockCodec.read_header(value), BlockCodec.read_header(first)
        return pack_header(f.codec, f.dtype, f.level, f.shape, h.namespace, h.key, f.raw_len, f.stored_len,
                           f.checksum, f.body_check, f.created, f.flags) + first[HEADER_BYTES:]

    assert rewrite_stored_blocks(tmp_path / "lmdb", move) == N
    with make_store(tmp_path, encryption_secret=SECRET) as store:
        ok, _ = load(store, keys)
        assert sum(ok) == 1  # the one block that is where it was stored
        assert store.metrics.misses("wrong_key") == N - 1


def test_shared_redis_replicas_with_and_without_the_key(tmp_path, redis_url):
    writer = make_store(None, remote_url=redis_url, encryption_secret=SECRET)
    keys, data = keys_for(N), payloads(writer, N)
    writer.save(keys, data)
    assert writer.flush(30)
    keyless = make_store(None, remote_url=redis_url)
    wrong = make_store(None, remote_url=redis_url, encryption_secret=OTHER)
    reader = make_store(tmp_path, remote_url=redis_url, encryption_secret=SECRET)  # with an empty disk tier
    try:
        assert load(keyless, keys)[0] == [False] * N and keyless.metrics.misses("no_key") == N
        assert load(wrong, keys)[0] == [False] * N and wrong.metrics.misses("wrong_key") == N
        ok, outs = load(reader, keys)
        assert ok == [True] * N and all(torch.equal(a, b) for a, b in zip(outs, data))
        assert reader.flush(30)
    finally:
        for store in (writer, keyless, wrong, reader):
            store.close()
    values = stored_values(tmp_path)  # the remote hits were copied up to disk, still sealed
    assert len(values) == N and all(BlockCodec.read_header(v).sealed for v in values)
    with make_store(tmp_path, encryption_secret=SECRET) as alone:  # the disk copies alone
        ok, outs = load(alone, keys)
        assert ok == [True] * N and all(torch.equal(a, b) for a, b in zip(outs, data))


def test_verify_and_show_check_sealed_blocks_without_the_key(tmp_path):
    stored(tmp_path)
    url = f"lmdb://{tmp_path}/lmdb"
    report = cli("verify", url, "--json").json()
    assert report["ok"] is True and report["tiers"][0]["valid_blocks"] == N
    shown = cli("show", url, keys_for(N)[0].hex(), "--json")
    assert shown.code == 0, shown.err
    entry = shown.json()
    assert entry["valid"] is True and entry["header"]["encrypted"] is True and "layers" not in entry
    victim = keys_for(N)[0]
    flip = lambda k, v: v[:-1] + bytes([v[-1] ^ 1]) if k.endswith(victim) else None  # noqa: E731
    assert rewrite_stored_blocks(tmp_path / "lmdb", flip) == 1
    report = cli("verify", url, "--json").json()
    [finding] = report["tiers"][0]["findings"]
    assert finding["kind"] == "corrupt" and "checksum" in finding["detail"]


def test_the_secret_never_shows_in_the_configs_text_forms(tmp_path, monkeypatch):
    config = TieredKVConfig.load(None, environ={"TIERED_KV_ENCRYPTION_SECRET": SECRET})
    assert config.encryption_secret.reveal() == SECRET.encode()
    shown = [repr(config), str(config), f"{config.encryption_secret}",
             json.dumps(dataclasses.asdict(config), default=str)]
    assert not any(SECRET in text for text in shown)
    path = tmp_path / "secret"
    path.write_text(SECRET + "\n")
    assert TieredKVConfig.from_dict({"encryption_secret": f"file:{path}"}) == config
    monkeypatch.setenv("TKV_TEST_SECRET", SECRET)
    assert TieredKVConfig.from_dict({"encryption_secret": "env:TKV_TEST_SECRET"}) == config
    with pytest.raises(ConfigError) as info:
        TieredKVConfig.from_dict({"encryption_secret": "short secret"})
    assert "short secret" not in str(info.value)
    with pytest.raises(ConfigError):
        TieredKVConfig.from_dict({"encryption_secret": "env:TKV_NOT_SET_ANYWHERE"})
    assert TieredKVConfig.from_dict({}).encryption_secret is None


@pytest.mark.parametrize("loader", [load, load_staged])
def test_regression_a_replica_without_the_secret_replaced_sealed_blocks_by_copying_a_plain_one_up(tmp_path, loader):
    # the disk holds sealed blocks; a shared tier below it plain copies of them (written by a
    # replica without the secret): loading them there copied the plain ones over the sealed ones
    shared = [{"name": "shared", "url": f"file://{tmp_path}/shared"}]
    keys, data = stored(tmp_path)
    with make_store(tmp_path / "other", disk=None, tiers=shared) as other:
        other.save(keys, data)
        assert other.flush(30)
    with make_store(tmp_path, tiers=shared) as keyless:
        ok, outs = loader(keyless, keys)
        assert ok == [True] * N and all(torch.equal(o, d) for o, d in zip(outs, data))  # from the shared tier
        assert keyless.metrics.misses("no_key") == N
        assert keyless.flush(30)
    assert all(BlockCodec.read_header(v).sealed for v in stored_values(tmp_path))
