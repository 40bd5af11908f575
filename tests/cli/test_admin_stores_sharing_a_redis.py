"""Two deployments share one Redis database, one under the default prefix ``tkv:`` and one under
``tkv:team-b:`` (which the default prefix's listing includes): the tools run on the default
store never take team B's entries for orphans of theirs, never delete them, and never count
their bytes as the store's own. A real redis-server, the real CLI."""

from __future__ import annotations

from tests.cli.conftest import cli
from tests.store.helpers import keys_for, make_store, payloads

TEAM_B = "tkv:team-b:"


def two_stores(redis_url: str) -> tuple[str, list[bytes]]:
    """4 blocks under the default prefix, 4 others under team B's; (team B's URL, its keys)."""
    for prefix, first in (("tkv:", 0), (TEAM_B, 8)):
        with make_store(None, disk=None, remote_url=f"{redis_url}?prefix={prefix}") as store:
            store.save(keys_for(first + 4)[first:], payloads(store, 4, seed=first))
            assert store.flush(30)
    return f"{redis_url}?prefix={TEAM_B}", keys_for(12)[8:]


def served(url: str, keys: list[bytes]) -> int:
    with make_store(None, disk=None, remote_url=url) as store:
        return store.lookup(keys)


def test_regression_verify_fix_on_the_default_prefix_deleted_another_prefixs_blocks_as_orphans(redis_url):
    team_b, keys = two_stores(redis_url)

    found = cli("verify", redis_url, "--json")
    fixed = cli("verify", redis_url, "--fix", "--json")

    assert served(team_b, keys) == 4, "team B's blocks were deleted"
    assert found.code == 0, found.out
    [report] = found.json()["tiers"]
    assert report["problems"]["orphaned"] == 0 and report["valid_blocks"] == 4
    assert any("another store's" in n for n in report["notes"]), report["notes"]
    assert fixed.code == 0 and fixed.json()["tiers"][0]["actions"] == []
    assert cli("verify", team_b).code == 0


def test_regression_evict_to_a_size_counted_another_prefixs_bytes_and_emptied_the_store(redis_url):
    team_b, keys = two_stores(redis_url)
    [listed] = cli("ls", redis_url, "--limit", "0", "--json").json()["tiers"]
    own = sum(row["size"] for row in listed["rows"])  # its 4 blocks; its record is well under 4 KiB

    result = cli("evict", redis_url, "--to", str(own + 4096), "--json")  # room for its record

    assert result.code == 0, result.out + result.err
    [report] = result.json()["tiers"]
    assert report["evicted_blocks"] == 0, "its own blocks were evicted for bytes that are not its"
    assert served(redis_url, keys_for(4)) == 4 and served(team_b, keys) == 4
    [inspected] = cli("inspect", redis_url, "--json").json()["tiers"]
    assert (inspected["blocks"], inspected["foreign_entries"], inspected["other_store_entries"]) == (4, 0, 5)
    assert inspected["stored_bytes"] == report["stored_bytes_before"] < own + 4096
