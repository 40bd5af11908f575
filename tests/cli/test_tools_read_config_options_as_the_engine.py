"""Every tool that opens a config's tiers (inspect, ls, show, verify, evict, explain) reads their
medium options as the engine does: a config the engine serves with is one the tools open, with
the same figures; one it refuses, they refuse in its words (exit 2, one line); and a tool's open
of a store changes nothing in it (real LMDB, file stores and a real redis-server)."""

from __future__ import annotations

import hashlib

import pytest

from storage_backends.lmdb_diskfull import RESERVE_NAME
from storage_backends.registry import open_backend
from tests.cli.conftest import cli
from tiered_kv.config import TieredKVConfig
from tiered_kv.errors import ConfigError

ALICE, BOB = bytes.fromhex("a11ce00000000001"), bytes.fromhex("b0b0000000000002")
READERS = (("inspect",), ("ls",), ("verify",), ("evict", "--to", "1GiB", "--dry-run"),
           ("explain", "--token-ids", "1,2,3"), ("show", "00" * 16))


def _filled(url: str) -> None:
    backend = open_backend(url)
    try:
        assert all(backend.put_many([(b"alice-%d" % i, b"a" * 1000) for i in range(3)], tenant=ALICE))
        assert all(backend.put_many([(b"bob-0", b"b" * 5000)], tenant=BOB))
    finally:
        backend.close()


@pytest.mark.parametrize("scheme", ["lmdb", "file"])
def test_regression_a_tenant_quotas_table_the_engine_serves_with_was_refused_by_every_tool(tmp_path, scheme):
    # folded into the URL the tools open, the table became its text, which the medium refuses
    # in a URL: exit 2 for every tool, on a config the engine opens
    url = f"{scheme}://{tmp_path / 'store'}"
    _filled(url)
    config = tmp_path / "tkv.toml"
    config.write_text(f'[[tiers]]\nname = "t"\nurl = "{url}"\ntenant_quota = "8000"\n'
                      f'[tiers.options]\ntenant_quotas = {{ "{ALICE.hex()}" = "2000" }}\n')
    (section,) = TieredKVConfig.from_toml(config).lower_tiers
    engine_side = open_backend(section.url, **section.medium_options())
    try:
        quotas = engine_side.quotas
    finally:
        engine_side.close()
    assert (quotas.of(ALICE), quotas.of(BOB)) == (2000, 8000)
    for command in ("inspect", "ls", "verify"):  # (verify: 1, the values are no blocks)
        result = cli(command, "--config", config, "--json")
        assert (result.code, result.err) == (1 if command == "verify" else 0, ""), command
    (tier,) = cli("inspect", "--config", config, "--json").json()["tiers"]
    assert tier["tenants"][ALICE.hex()]["quota_bytes"] == quotas.of(ALICE)
    assert tier["tenants"][BOB.hex()]["quota_bytes"] == quotas.of(BOB)
    assert tier["tenants"][ALICE.hex()]["quota_used"] == 1.5  # (3,000 bytes of its 2,000)
    assert cli("evict", "--config", config, "--to", "1GiB", "--dry-run").code == 0


def test_regression_a_redis_ttl_written_as_a_small_float_was_refused_by_the_tools(redis_url, tmp_path):
    # TOML's 0.00005 folded into the URL as "5e-05", a duration no query reads: every tool
    # refused a config whose Redis tier the engine opens
    config = tmp_path / "tkv.toml"
    config.write_text(f'[remote]\nurl = "{redis_url}"\n[remote.options]\nttl = 0.00005\n')
    remote = TieredKVConfig.from_toml(config).remote
    open_backend(remote.url, **remote.medium_options()).close()  # (the engine's medium takes it)
    for command in ("inspect", "ls", "verify"):
        result = cli(command, "--config", config, "--json")
        assert result.code == 0, (command, result.err)
    assert cli("inspect", "--config", config, "--json").json()["tiers"][0]["blocks"] == 0


@pytest.mark.parametrize(("options", "key"), [
    ("[disk.options]\nsync = 1.0\n", "disk.sync"),
    ("[disk.options]\nmax_readers = \"600.0\"\n", "disk: lmdb max_readers"),
    ("[disk.options]\nwriteback = \"soon\"\n", "disk: lmdb writeback"),
])
def test_a_config_value_the_engine_refuses_is_refused_by_every_tool_in_its_words(tmp_path, options, key):
    config = tmp_path / "tkv.toml"
    config.write_text(f'[disk]\nurl = "lmdb://{tmp_path / "store"}"\n{options}')
    with pytest.raises(ConfigError) as engine_said:
        TieredKVConfig.from_toml(config)
    assert str(engine_said.value).startswith(key)
    for command in READERS:
        result = cli(command[0], "--config", config, *command[1:])
        assert (result.code, result.out) == (2, ""), (command, result.err)
        assert result.err == f"tiered-kv: error: {engine_said.value}\n", command
    assert not (tmp_path / "store").exists()  # (nothing made for a config refused)


def test_a_tools_open_of_a_config_that_records_accesses_changes_nothing_in_the_store(tmp_path):
    # the engine's settings (record_access, a writer's reserve of room for deletes) are not a
    # tool's: its reads record nothing and its open makes no reserve.space
    url = f"lmdb://{tmp_path / 'store'}"
    _filled(url)
    (tmp_path / "store" / RESERVE_NAME).unlink()
    config = tmp_path / "tkv.toml"
    config.write_text(f'[disk]\nurl = "{url}"\n[disk.options]\nrecord_access = true\nsync = true\n')
    before = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in (tmp_path / "store").iterdir()
              if p.name != "lock.mdb"}
    for command in READERS:
        result = cli(command[0], "--config", config, *command[1:])
        # (1: verify finds no blocks, show's key is missing; explain opened the store and found
        # no namespace to explain)
        assert result.code in (0, 1) or "holds 0 namespaces" in result.err, (command, result.err)
    after = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in (tmp_path / "store").iterdir()
             if p.name != "lock.mdb"}
    assert after == before


def test_regression_an_lmdb_url_of_capacity_0_which_the_engine_refuses_was_a_tools_store_of_no_capacity(tmp_path):
    # a tool's open of an lmdb store leaves the capacity out of the medium: the tool read it
    # alone, took 0 for "no capacity", and named a bad one "capacity", as no medium does
    url = f"lmdb://{tmp_path / 'store'}"
    _filled(url)
    for given, said in (("0", "lmdb capacity must be positive, got '0'"), ("-1", "lmdb capacity: expected a byte")):
        with pytest.raises(ConfigError) as engine_said:
            open_backend(f"{url}?capacity={given}")
        assert str(engine_said.value).startswith(said)
        result = cli("inspect", f"{url}?capacity={given}", "--json")
        assert (result.code, result.err) == (2, f"tiered-kv: error: {engine_said.value}\n"), given
    # (the store refused is closed again: this process opens it once more)
    assert cli("inspect", f"{url}?capacity=1MiB", "--json").json()["tiers"][0]["capacity_bytes"] == 1 << 20
