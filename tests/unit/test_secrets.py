"""Credentials appear nowhere: not in config errors, not in the CLI's tables or JSON, not in log
records, not in the demo's report or its child processes' argv (visible to every user in ``ps``).

The secret is ``s3cret``, given both ways Redis URLs carry one: in the userinfo and in the query
string. The Redis these tests talk to is a real redis-server that requires that password.
"""

from __future__ import annotations

import logging
import re
import subprocess
from pathlib import Path

import pytest
import redis

from storage_backends.redaction import redact_url
from tests.cli.conftest import cli
from tests.redis_server import RedisServer, free_port
from tiered_kv.config import TieredKVConfig
from tiered_kv.errors import ConfigError

SECRET = "s3cret"


def secret_url(port: int, scheme: str = "redis") -> str:
    return f"{scheme}://user:{SECRET}@127.0.0.1:{port}/0?password={SECRET}"


def assert_no_secret(*texts: str) -> None:
    for text in texts:
        assert SECRET not in text, text


@pytest.fixture(scope="module")
def locked_redis(tmp_path_factory):
    """A real redis-server that only serves user ``user`` with password ``s3cret``."""
    server = RedisServer(tmp_path_factory.mktemp("locked-redis")).start()
    admin = redis.Redis(port=server.port)
    admin.acl_setuser("user", enabled=True, passwords=[f"+{SECRET}"], keys=["*"], commands=["+@all"])
    admin.config_set("requirepass", SECRET)  # the default user needs it too: no anonymous access
    admin.close()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def demo_on_locked_redis(locked_redis, tmp_path_factory):
    """``tiered-kv demo restart --store URL --json`` on the locked Redis, with the argv of every
    child process it started."""
    workdir = tmp_path_factory.mktemp("demo-secret")
    launched: list[list[str]] = []
    real_run = subprocess.run

    def watching_run(cmd, *args, **kwargs):
        launched.append([str(a) for a in cmd])
        return real_run(cmd, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(subprocess, "run", watching_run)
        result = cli("demo", "restart", "--dir", workdir, "--store", secret_url(locked_redis.port),
                     "--json", "--model-size", "tiny", "--prompt-tokens", "700")
        table = cli("demo", "restart", "--dir", workdir, "--store", secret_url(locked_redis.port),
                    "--model-size", "tiny", "--prompt-tokens", "700")
    assert result.code == 0, result.err
    return workdir, result, table, launched


def test_unknown_scheme_error_does_not_show_the_password():
    url = secret_url(6379, scheme="nosuch")
    with pytest.raises(ConfigError, match="remote.url") as err:
        TieredKVConfig.load({"remote": {"url": url}})
    assert_no_secret(str(err.value))
    assert "nosuch://user:***@127.0.0.1:6379/0?password=***" in str(err.value)
    result = cli("inspect", url)
    assert result.code == 2
    assert_no_secret(result.out, result.err)


def test_query_string_password_is_hidden_when_redis_is_unreachable(caplog):
    url = secret_url(free_port())  # nothing listens there
    caplog.set_level(logging.DEBUG)
    for args in (("inspect", url), ("inspect", url, "--json"), ("ls", url, "--json")):
        result = cli(*args)
        assert result.code == 3, result.err
        assert "password=***" in result.err
        assert_no_secret(result.out, result.err)
    assert_no_secret(*(r.getMessage() for r in caplog.records))


def test_redacted_urls_keep_everything_but_the_secrets():
    assert redact_url("redis://user:pw@h:1/0?password=pw&db=2&ttl=1d") == \
        "redis://user:***@h:1/0?password=***&db=2&ttl=1d"
    assert redact_url("rediss://:pw@h/0?auth_token=x&ssl_cert_reqs=none") == \
        "rediss://:***@h/0?auth_token=***&ssl_cert_reqs=none"
    assert redact_url("unix:///run/redis.sock?db=0&passwd=x") == "unix:///run/redis.sock?db=0&passwd=***"
    assert redact_url("lmdb:///var/cache/kv?capacity=8GiB") == "lmdb:///var/cache/kv?capacity=8GiB"


def pieces_of(password: str) -> list[str]:
    """The password, decoded, and each piece of it a parser may cut out and quote."""
    whole = [password, password.replace("%2F", "/")]
    return whole + [p for w in whole for p in re.split(r"[/?#@=&:]", w) if p]


def engine_store(url: str):
    """An engine's store whose remote tier is ``url`` (from a config, as an engine opens it)."""
    from tiered_kv.keys import Namespace
    from tiered_kv.store import TieredStore

    ns = Namespace(model_id="m", dtype="float32", num_layers=1, num_kv_heads=1, head_dim=4, block_size=4)
    return TieredStore(TieredKVConfig.load({"host": {"capacity": "1MiB"}, "remote": {"url": url}}), ns)


@pytest.mark.parametrize("password", ["Ab3/xYz9+q", "Pq7?wZk2", "Hx4#Lm9", "Gy2/Qe5@Wd7?Tf3#Ua8"])
def test_regression_a_password_holding_a_slash_query_or_hash_mark_was_printed_as_a_bad_redis_url(password, caplog):
    """``bad Redis URL 'redis://default:Ab3/xYz9+q@…': Port could not be cast to integer value
    as 'Ab3'``: the userinfo was cut at the first ``/`` (or ``?``), and redis-py quoted a piece."""
    url = f"redis://default:{password}@127.0.0.1:{free_port()}/0"
    caplog.set_level(logging.DEBUG)
    result = cli("inspect", url)
    assert result.code == 2 and "'redis://default:***@127.0.0.1:" in result.err, result.err
    assert "percent-encode" in result.err
    with pytest.raises(ConfigError, match="percent-encode") as refused:
        engine_store(url)
    said = [result.out, result.err, str(refused.value), *(r.getMessage() for r in caplog.records)]
    for piece in pieces_of(password):
        assert not any(piece in text for text in said), (piece, said)


@pytest.mark.parametrize("password", ["Rt5@Vb8", "Ns6%2FJk3"])
def test_a_password_holding_an_at_sign_or_an_escape_is_read_whole_and_never_shown(password, caplog):
    url = f"redis://default:{password}@127.0.0.1:{free_port()}/0?password={password}"  # nothing listens
    caplog.set_level(logging.DEBUG)
    result = cli("inspect", url)
    assert result.code == 3 and "redis://default:***" in result.err, result.err
    store = engine_store(url)
    shown = str(store.stats())
    store.close()
    said = [result.out, result.err, shown, *(r.getMessage() for r in caplog.records)]
    for piece in pieces_of(password):
        assert not any(piece in text for text in said), (piece, said)


def test_regression_redacted_urls_ended_the_userinfo_at_the_first_slash_or_question_mark():
    assert redact_url("redis://default:Ab3/xYz9+q@127.0.0.1:6390/0") == "redis://default:***@127.0.0.1:6390/0"
    assert redact_url("rediss://u:a?b#c@d@h:1/0?db=1&token=t") == "rediss://u:***@h:1/0?db=1&token=***"
    assert redact_url("redis://u:p@ss@h:1/0?db=1&token=t") == "redis://u:***@h:1/0?db=1&token=***"
    # read two ways (a password up to the @, or a query value holding it): secret either way
    assert redact_url("redis://h:6379/0?password=p@ss") == "redis://h:***"
    assert redact_url("redis://u:p@ss@h:1/0?password=p@ss") == "redis://u:***"


def test_cli_tables_and_json_on_a_locked_redis_never_show_the_password(demo_on_locked_redis, locked_redis,
                                                                       caplog, tmp_path):
    url = secret_url(locked_redis.port)
    caplog.set_level(logging.DEBUG)
    inspected = cli("inspect", url, "--json")
    assert inspected.code == 0, inspected.err
    [tier] = inspected.json()["tiers"]
    assert tier["blocks"] > 0 and tier["url"] == redact_url(url)
    listed = cli("ls", url, "--json", "--limit", "3")
    assert listed.code == 0 and listed.json()["tiers"][0]["rows"]
    key = listed.json()["tiers"][0]["rows"][0]["key"]
    outputs = [inspected, listed]
    for args in (("inspect", url), ("ls", url), ("show", url, key), ("show", url, key, "--json"),
                 ("verify", url), ("verify", url, "--json"), ("evict", url, "--older-than", "7d", "--dry-run"),
                 ("evict", url, "--older-than", "7d", "--dry-run", "--json"),
                 ("copy", url, f"lmdb://{tmp_path}/a"), ("copy", url, f"lmdb://{tmp_path}/b", "--json"),
                 ("copy", f"lmdb://{tmp_path}/a", url, "--json")):
        result = cli(*args)
        assert result.code == 0, (args, result.err)
        outputs.append(result)
    assert_no_secret(*(r.out + r.err for r in outputs))
    assert_no_secret(*(r.getMessage() for r in caplog.records))


def test_cli_config_file_with_a_password_never_shows_it(demo_on_locked_redis, locked_redis, tmp_path):
    config = tmp_path / "tkv.toml"
    config.write_text(f'[remote]\nurl = "{secret_url(locked_redis.port)}"\n')
    for args in (("inspect", "--config", config), ("inspect", "--config", config, "--json"),
                 ("ls", "--config", config, "--json")):
        result = cli(*args)
        assert result.code == 0, result.err
        assert_no_secret(result.out, result.err)


def test_demo_report_files_and_child_argv_never_show_the_password(demo_on_locked_redis):
    workdir, result, table, launched = demo_on_locked_redis
    assert result.json()["outputs_identical"] and result.json()["run2"]["tier_hits_blocks"]
    assert table.code == 0 and "restart-and-resume demo" in table.out
    assert_no_secret(result.out, result.err, table.out, table.err)
    children = [cmd for cmd in launched if "tiered_kv.cli.demo_run" in cmd]
    assert len(children) == 4  # run 1 and run 2, twice
    assert_no_secret(*(" ".join(cmd) for cmd in children))
    for path in Path(workdir).glob("*.json"):
        assert_no_secret(path.read_text())


def test_stats_with_credentials_in_the_metrics_url_never_shows_them(tmp_path):
    from tiered_kv.keys import Namespace
    from tiered_kv.store import TieredStore
    from tiered_kv.store.prometheus import export, unexport

    ns = Namespace(model_id="m", dtype="float32", num_layers=1, num_kv_heads=1, head_dim=4, block_size=4)
    store = TieredStore(TieredKVConfig.load({"host": {"capacity": "1MiB"}}), ns)
    try:
        port = export(store, 0, "127.0.0.1")
        url = f"http://user:{SECRET}@127.0.0.1:{port}/metrics?token={SECRET}"
        for args in (("stats", url), ("stats", url, "--json")):
            result = cli(*args)
            assert result.code == 0, result.err
            assert_no_secret(result.out, result.err)
    finally:
        unexport(store)
        store.close()
    down = cli("stats", f"http://user:{SECRET}@127.0.0.1:{free_port()}/metrics?token={SECRET}")
    assert down.code == 3 and "user:***@" in down.err
    assert_no_secret(down.out, down.err)


def test_regression_an_encryption_secret_file_of_dev_zero_was_read_for_ever():
    from tiered_kv.config import TieredKVConfig
    from tiered_kv.errors import ConfigError

    with pytest.raises(ConfigError, match="not a secret"):
        TieredKVConfig.from_dict({"encryption_secret": "file:/dev/zero"})
