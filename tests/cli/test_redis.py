"""`copy` from the demo's LMDB store into a real Redis; `explain`, `inspect` and `verify` against
Redis see the same blocks; a Redis that is down is one error line and exit 3."""

from __future__ import annotations

from tests.cli.conftest import cli


def _explain(url: str, tokens: list[int]) -> dict:
    result = cli("explain", url, "--token-ids", ",".join(map(str, tokens)), "--json")
    assert result.code == 0, result.err
    return result.json()


def test_copy_lmdb_to_redis_then_explain_against_redis_shows_the_same_blocks(demo_store, redis_url):
    copied = cli("copy", demo_store.url, redis_url, "--json")
    assert copied.code == 0, copied.err
    report = copied.json()
    lmdb_view = cli("inspect", demo_store.url, "--json").json()["tiers"][0]
    assert report["copied"] == report["blocks"] == lmdb_view["blocks"] and report["namespace_records"] == 1
    assert report["corrupt_skipped"] == [] and report["rejected"] == 0
    for tokens in demo_store.prompts.values():
        from_lmdb, from_redis = _explain(demo_store.url, tokens), _explain(redis_url, tokens)
        assert from_redis == from_lmdb  # same keys, same tier name ("store"), same first miss
        assert from_redis["matched_blocks"] > 0
    redis_view = cli("inspect", redis_url, "--json").json()["tiers"][0]
    assert redis_view["medium"] == "redis"
    assert redis_view["namespaces"].keys() == lmdb_view["namespaces"].keys()
    for key in ("blocks", "tokens", "raw_bytes", "stored_bytes", "model_id", "block_shape"):
        (ns_redis,), (ns_lmdb,) = redis_view["namespaces"].values(), lmdb_view["namespaces"].values()
        assert ns_redis[key] == ns_lmdb[key], key
    assert cli("verify", redis_url).code == 0
    again = cli("copy", demo_store.url, redis_url, "--json").json()
    assert again["copied"] == 0 and again["already_present"] == report["blocks"]


def test_a_config_file_names_both_tiers(demo_store, redis_url, tmp_path):
    assert cli("copy", demo_store.url, redis_url).code == 0
    config = tmp_path / "tkv.toml"
    config.write_text(f'[disk]\nurl = "{demo_store.url}"\ncapacity = "64MiB"\n[remote]\nurl = "{redis_url}"\n')
    tiers = cli("inspect", "--config", config, "--json").json()["tiers"]
    assert [t["tier"] for t in tiers] == ["disk", "remote"]
    assert tiers[0]["capacity_bytes"] == 64 << 20 and 0 < tiers[0]["capacity_used"] < 1
    tokens = demo_store.prompts["rag-question-1"]
    report = cli("explain", "--config", config, "--token-ids", ",".join(map(str, tokens)), "--json").json()
    assert report["tiers"] == ["disk", "remote"] and report["tier_blocks"] == {"disk": report["matched_blocks"]}
    assert all(b["status"] == {"disk": "ok", "remote": "ok"} for b in report["blocks"])
    only_remote = cli("ls", "--config", config, "--tier", "remote", "--json").json()["tiers"]
    assert [t["tier"] for t in only_remote] == ["remote"]


def test_regression_a_redis_prefix_in_a_tiers_options_table_was_ignored_by_the_tools(demo_store, redis_url,
                                                                                    tmp_path):
    # the tools opened each configured tier by its URL alone: a store whose engines keep their
    # blocks under [remote.options] prefix = "app1:" looked empty to inspect, verify and evict
    assert cli("copy", demo_store.url, redis_url + "?prefix=app1:").code == 0
    config = tmp_path / "tkv.toml"
    config.write_text(f'[remote]\nurl = "{redis_url}"\n[remote.options]\nprefix = "app1:"\n')
    (tier,) = cli("inspect", "--config", config, "--json").json()["tiers"]
    assert tier["blocks"] == cli("inspect", demo_store.url, "--json").json()["tiers"][0]["blocks"] > 0


def test_an_unreachable_redis_is_one_error_line_and_exit_3(own_redis):
    url = own_redis.url
    assert cli("inspect", url).code == 0  # empty but reachable
    own_redis.stop()
    for args in (["inspect", url], ["verify", url], ["ls", url], ["explain", url, "--token-ids", "1,2"]):
        result = cli(*args)
        assert result.code == 3, (args, result)
        assert result.out == "" and result.err.count("\n") == 1
        assert result.err.startswith("tiered-kv: error: redis at ") and "Traceback" not in result.err
