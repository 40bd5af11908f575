"""The tools on an encrypted store, given the engine's config as the secret itself, ``file:`` or
``env:``: ``explain`` opens blocks as that config's replicas do (``no_key`` without a secret,
``wrong_key`` under another one, ``unencrypted`` for a plain block where blocks are sealed); the
other tools need no key, so a secret they cannot read never stops them; no command prints the
secret or a key derived from it. Real LMDB stores under tmp_path, the real CLI."""

from __future__ import annotations

import logging

import pytest

from tests.cli.conftest import cli
from tests.store.helpers import NS, keys_for, make_store, payloads
from tiered_kv.keys import tenant_label
from tiered_kv.store.tenant_cipher import derive_key

SECRET = "correct horse battery staple"
OTHER = "another secret, just as long"
ALICE = tenant_label("tenant-a")
N = 4
PROMPT = ",".join(str(t) for t in range(N * NS.block_size + 1))  # N full blocks, all claimable


def saved(tmp_path, secret: str | None) -> str:
    """An engine's LMDB store of N blocks (sealed with ``secret``; Alice's, but the last one,
    so each opens under its own tenant's key); its URL."""
    keys = keys_for(N)
    with make_store(tmp_path, encryption_secret=secret) as store:
        store.save(keys[:-1], payloads(store, N - 1), ALICE)
        store.save(keys[-1:], payloads(store, 1, seed=1))
        assert store.flush(30)
    return f"lmdb://{tmp_path}/lmdb"


def config(tmp_path, url: str, secret: str | None, name: str = "engine.toml") -> str:
    path = tmp_path / name
    line = "" if secret is None else f'encryption_secret = "{secret}"\n'
    path.write_text(f'{line}[disk]\nurl = "{url}"\ncapacity = "64MiB"\n')
    return str(path)


@pytest.mark.parametrize(("written", "engine", "reason"), [
    (SECRET, None, "no_key"), (SECRET, OTHER, "wrong_key"), (None, SECRET, "unencrypted")])
def test_regression_explain_called_blocks_the_configs_engine_cannot_open_reusable(tmp_path, written, engine, reason):
    """``explain --config`` said every block was reusable from disk; that config's engine misses
    every one (and removes the plain ones)."""
    url = saved(tmp_path, written)
    report = cli("explain", "--config", config(tmp_path, url, engine), "--token-ids", PROMPT, "--json")
    assert report.code == 0, report.err
    doc = report.json()
    assert doc["matched_blocks"] == 0
    assert doc["first_miss"]["reason"] == reason
    assert [b["status"] for b in doc["blocks"]] == [{"disk": reason}] * N
    # and an engine of that config does miss them, for that reason
    with make_store(tmp_path, encryption_secret=engine) as store:
        assert store.lookup(keys_for(N)) == N  # (present: lookups do not open blocks)
        plan = store.load(store.prepare_load(keys_for(N)[:1], ALICE))
        try:
            plan.wait(30)
            assert plan.ok == [False]
        finally:
            store.release(plan)
        assert store.metrics.misses(reason) == 1


def test_explain_with_the_engines_secret_opens_each_block_under_its_tenants_key(tmp_path):
    url = saved(tmp_path, SECRET)
    for engine in (config(tmp_path, url, SECRET), config(tmp_path, url, None, "plain.toml")):
        doc = cli("explain", "--config", engine, "--token-ids", PROMPT, "--json").json()
        sealed = engine.endswith("engine.toml")
        assert doc["matched_blocks"] == (N if sealed else 0)
        assert doc["first_miss"]["reason"] == ("partial_block" if sealed else "no_key")
    plain = saved(tmp_path / "plain", None)  # a plain store read by a plain engine: served
    assert cli("explain", "--config", config(tmp_path, plain, None, "p.toml"), "--token-ids", PROMPT,
               "--json").json()["matched_blocks"] == N
    # a bare URL names no engine: sealed blocks whose framing is sound count as served
    assert cli("explain", url, "--token-ids", PROMPT, "--json").json()["matched_blocks"] == N


def test_regression_a_secret_only_the_engine_can_read_made_every_tool_refuse_its_config(tmp_path, monkeypatch):
    """``inspect``/``verify``... ``--config`` exited 2 on a ``file:`` secret the operator could
    not read, or an ``env:`` one set only for the engine, though they check sealed blocks
    without the key; ``explain``, which opens them as the engine does, still needs it."""
    url = saved(tmp_path, SECRET)
    monkeypatch.delenv("ENGINE_SECRET", raising=False)
    for secret in (f"file:{tmp_path}/engine-only/secret", "env:ENGINE_SECRET"):
        path = config(tmp_path, url, secret)
        key = keys_for(N)[0].hex()
        for args in (("inspect",), ("ls",), ("show", key), ("verify",), ("evict", "--to", "1GiB", "--dry-run")):
            result = cli(*args, "--config", path, "--json")
            assert result.code == 0, (args, result.err)
        assert cli("verify", "--config", path, "--json").json()["tiers"][0]["valid_blocks"] == N
        explained = cli("explain", "--config", path, "--token-ids", PROMPT)
        assert explained.code == 2 and "encryption_secret" in explained.err


def test_no_command_prints_the_secret_or_a_key_derived_from_it(tmp_path, monkeypatch, caplog):
    url = saved(tmp_path, SECRET)
    (tmp_path / "secret").write_text(SECRET + "\n")
    monkeypatch.setenv("ENGINE_SECRET", SECRET)
    caplog.set_level(logging.DEBUG)
    raw = SECRET.encode()
    keys = [derive_key(raw, t) for t in (b"", ALICE)]
    needles = [SECRET, raw.hex(), *(k.hex() for k in keys), *(k.hex().upper() for k in keys)]
    key = keys_for(N)[0].hex()
    for given in (SECRET, f"file:{tmp_path}/secret", "env:ENGINE_SECRET"):
        path = config(tmp_path, url, given)
        for args in (("inspect",), ("ls", "--all"), ("show", key), ("verify",), ("verify", "--fix"),
                     ("evict", "--to", "1GiB", "--dry-run"), ("explain", "--token-ids", PROMPT)):
            for form in ((), ("--json",)):
                result = cli("-v", *args, "--config", path, *form)
                assert result.code == 0, (args, result.err)
                said = result.out + result.err + caplog.text
                assert not [n for n in needles if n in said], args
        copied = cli("-v", "copy", url, f"lmdb://{tmp_path}/copy-{len(caplog.text)}", "--json")
        assert copied.code == 0 and not [n for n in needles if n in copied.out + copied.err + caplog.text]
    # and the tools changed nothing an engine with the key reads
    with make_store(tmp_path, encryption_secret=SECRET) as store:
        plan = store.load(store.prepare_load(keys_for(N)[:-1], ALICE))
        try:
            plan.wait(30)
            assert plan.ok == [True] * (N - 1)
        finally:
            store.release(plan)
