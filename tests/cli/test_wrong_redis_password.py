"""A Redis tier whose URL carries a wrong password (or user, or none where one is required):
the tools exited 3, "cannot be reached now, try again later", though Redis answered and no retry
would ever mend it. It is configuration: exit 2, one line saying authentication failed, the URL
redacted. An engine still counts such a tier as unavailable (misses, failed saves; no crash)."""

from __future__ import annotations

import pytest
import redis

from tests.cli.conftest import cli
from tests.store.helpers import keys_for, load, make_store, payloads

PASSWORD = "Rt7kQw2zGood"
WRONG = "Wx9pLm4vBad"


@pytest.fixture
def locked(own_redis):
    """The test's own real redis-server, requiring ``PASSWORD`` of its default user."""
    admin = redis.Redis(port=own_redis.port)
    admin.config_set("requirepass", PASSWORD)
    admin.close()
    return own_redis


def url_with(port: int, userinfo: str) -> str:
    return f"redis://{userinfo}127.0.0.1:{port}/0"


def one_line(result, code: int) -> str:
    assert result.code == code, (result.code, result.err)
    assert result.out == "" and result.err.count("\n") == 1 and "Traceback" not in result.err, result.err
    assert PASSWORD not in result.err and WRONG not in result.err, result.err
    return result.err


def test_regression_a_wrong_redis_password_was_reported_as_unreachable_exit_3(locked, tmp_path):
    assert cli("inspect", url_with(locked.port, f":{PASSWORD}@")).code == 0  # the right one works
    wrong = url_with(locked.port, f":{WRONG}@")
    for args in (["inspect", wrong], ["ls", wrong, "--json"], ["verify", wrong],
                 ["explain", wrong, "--token-ids", "1,2"], ["copy", wrong, f"lmdb://{tmp_path}/copy"]):
        err = one_line(cli(*args), 2)
        assert err.startswith("tiered-kv: error: authentication failed for the tier"), (args, err)
        assert f"redis://:***@127.0.0.1:{locked.port}/0" in err, err


@pytest.mark.parametrize("userinfo", ["", "nobody:{password}@", ":{wrong}@"], ids=["no-password", "no-such-user",
                                                                                    "wrong-password"])
def test_a_config_whose_remote_tier_is_refused_its_credentials_is_exit_2(locked, tmp_path, userinfo):
    config = tmp_path / "tkv.toml"
    url = url_with(locked.port, userinfo.format(password=PASSWORD, wrong=WRONG))
    config.write_text(f'[remote]\nurl = "{url}"\n')
    err = one_line(cli("inspect", "--config", config), 2)
    assert "authentication failed for the tier" in err and f"127.0.0.1:{locked.port}/0" in err, err


def test_a_redis_that_is_down_is_still_unreachable_exit_3(locked):
    locked.stop()
    err = one_line(cli("inspect", url_with(locked.port, f":{WRONG}@")), 3)
    assert "authentication" not in err, err


def test_an_engine_counts_a_tier_refusing_its_password_as_unavailable(locked, tmp_path):
    keys = keys_for(6)
    with make_store(tmp_path, host="64KiB", disk=None, remote_url=url_with(locked.port, f":{WRONG}@")) as store:
        data = payloads(store, 4)
        store.save(keys[:4], data[:4])
        store.flush()
        assert store.lookup(keys) == 4  # the host tier serves what it holds
        ok, _ = load(store, keys[4:])
        assert ok == [False, False]
        assert store.metrics.events["remote_save_failed"] == 4
        assert store.metrics.misses("remote_unavailable") == 4  # the lookup's two and the load's two
