"""A config file's lower tiers, in order: with a third tier (a file store named "archive" after
the disk tier), `inspect`, `explain` and `ls` open every one of them, and `--tier` picks one by
name."""

from __future__ import annotations

from tests.cli.conftest import cli


def _config(tmp_path, disk_url: str, archive_url: str):
    path = tmp_path / "tkv.toml"
    path.write_text(f'[disk]\nurl = "{disk_url}"\ncapacity = "64MiB"\n\n'
                    f'[[tiers]]\nname = "archive"\nurl = "{archive_url}"\ncapacity = "1GiB"\n')
    return path


def test_a_third_tier_named_archive_is_opened_after_the_disk_tier(demo_store, tmp_path):
    archive = f"file://{tmp_path / 'archive'}"
    assert cli("copy", demo_store.url, archive).code == 0
    config = _config(tmp_path, demo_store.url, archive)

    tiers = cli("inspect", "--config", config, "--json").json()["tiers"]
    assert [(t["tier"], t["medium"]) for t in tiers] == [("disk", "lmdb"), ("archive", "file")]
    assert tiers[1]["blocks"] == tiers[0]["blocks"] > 0 and tiers[1]["capacity_bytes"] == 1 << 30
    assert tiers[1]["namespaces"].keys() == tiers[0]["namespaces"].keys()

    tokens = demo_store.prompts["rag-question-1"]
    report = cli("explain", "--config", config, "--token-ids", ",".join(map(str, tokens)), "--json").json()
    assert report["tiers"] == ["disk", "archive"] and report["tier_blocks"] == {"disk": report["matched_blocks"]}
    assert all(b["status"] == {"disk": "ok", "archive": "ok"} for b in report["blocks"])

    only_archive = cli("ls", "--config", config, "--tier", "archive", "--json").json()["tiers"]
    assert [t["tier"] for t in only_archive] == ["archive"] and only_archive[0]["total"] == tiers[1]["blocks"]


def test_a_tier_the_config_does_not_name_is_one_error_line(demo_store, tmp_path):
    config = _config(tmp_path, demo_store.url, f"file://{tmp_path / 'archive'}")
    result = cli("inspect", "--config", config, "--tier", "cold")
    assert result.code == 2 and result.out == ""
    assert result.err == f"tiered-kv: error: config {config} names no tier 'cold'\n"
