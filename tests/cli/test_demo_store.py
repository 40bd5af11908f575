"""`inspect`, `ls`, `show` and `explain` on the store `tiered-kv demo restart` left behind report
what the demo stored, with the numbers of the demo's own JSON."""

from __future__ import annotations

import json
from math import prod

from tests.cli.conftest import cli
from tiered_kv.engine import ModelConfig
from tiered_kv.engine.config import EngineConfig
from tiered_kv.store.codec import HEADER_BYTES


def _disk(run: dict) -> dict:
    return run["store"]["tiers"]["disk"]


def test_inspect_json_counts_match_the_demo_runs(demo_store):
    result = cli("inspect", demo_store.url, "--json")
    assert result.code == 0, result.err
    [tier] = result.json()["tiers"]
    [(digest, ns)] = tier["namespaces"].items()
    r1, r2 = demo_store.run1, demo_store.run2
    written = _disk(r1)["blocks_in"] + _disk(r2)["blocks_in"]
    assert ns["blocks"] == tier["blocks"] == written == r2["store"]["backends"]["disk"]["entries"] - 1
    assert tier["namespace_records"] == 1 and tier["foreign_entries"] == 0
    assert ns["raw_bytes"] == _disk(r1)["bytes_in"] + _disk(r2)["bytes_in"]
    assert ns["stored_bytes"] == _disk(r1)["stored_bytes_in"] + _disk(r2)["stored_bytes_in"]
    assert ns["compression_ratio"] == round(ns["raw_bytes"] / ns["stored_bytes"], 4)
    model, engine = ModelConfig.tiny(), EngineConfig()
    assert ns["record"] and ns["model_id"] == engine.model_id
    assert ns["dtype"] == model.dtype and ns["block_size"] == engine.block_size
    assert ns["block_shape"] == [model.num_layers, 2, engine.block_size, model.num_kv_heads, model.head_dim]
    assert ns["tokens"] == ns["blocks"] * engine.block_size
    assert ns["oldest"] <= ns["newest"] and sum(ns["last_access_age"].values()) == ns["blocks"]
    assert ns["hits"] == _disk(r2)["hits"], "run 2's disk hits are in the meta table"
    assert tier["used_bytes"] == r2["store"]["backends"]["disk"]["used_bytes"]
    assert cli("inspect", demo_store.url).code == 0  # the table renders too


def test_explain_reuses_what_run_two_reused_and_names_the_first_miss(demo_store):
    run2 = demo_store.report["run2"]["prompts"]
    seen: set[str] = set()
    for name, tokens in demo_store.prompts.items():
        report = cli("explain", demo_store.url, "--token-ids", ",".join(map(str, tokens)), "--json").json()
        p = run2[name]
        assert report["tokens"] == p["prompt_tokens"]
        assert report["stored_blocks"] * report["block_size"] == p["full_block_tokens"], "every full block is stored"
        if name != "chat-turn-2":  # served in run 1: run 2 reused every full block (device or disk)
            assert report["matched_tokens"] == p["matched_tokens"] + p["device_cached_tokens"] == p["full_block_tokens"]
            assert report["first_miss"]["reason"] == "partial_block"
        else:  # new in run 2: its history came from disk, its new blocks were saved by run 2
            assert report["matched_tokens"] >= p["matched_tokens"]
            assert report["first_miss"]["reason"] == "last_token"  # 1248 tokens: a whole last block
            assert report["matched_blocks"] == report["claimable_blocks"] == report["full_blocks"] - 1
        # the connector also saves blocks that decoding filled: prompt + output but the last
        # token (sampled, never fed back); together they are exactly what the store holds
        decoded = tokens + p["output"][:-1]
        full = cli("explain", demo_store.url, "--token-ids", ",".join(map(str, decoded)), "--json").json()
        assert full["stored_blocks"] == full["full_blocks"]
        seen |= {b["key"] for b in full["blocks"]}
    listed = cli("ls", demo_store.url, "--limit", "0", "--json").json()["tiers"][0]
    digest = next(iter(cli("inspect", demo_store.url, "--json").json()["tiers"][0]["namespaces"]))
    assert {r["key"] for r in listed["rows"]} == {digest + k for k in seen}, "the store holds these blocks, only them"


def test_explain_reports_an_unseen_prompt_as_absent(demo_store):
    report = cli("explain", demo_store.url, "--token-ids", ",".join(str(i) for i in range(1, 40)), "--json").json()
    assert report["matched_tokens"] == 0
    assert report["first_miss"] == {"index": 0, "tokens": [0, 16], "reason": "absent", "detail": "store: absent"}
    text = cli("explain", demo_store.url, "--token-ids", "1,2,3," * 20 + "4")
    assert text.code == 0 and "first miss: block 0" in text.out


def test_ls_pages_and_filters(demo_store, tmp_path):
    total = len(cli("ls", demo_store.url, "--limit", "0", "--json").json()["tiers"][0]["rows"])
    page = cli("ls", demo_store.url, "--limit", "10", "--offset", str(total - 4), "--json").json()["tiers"][0]
    assert page["total"] == total and len(page["rows"]) == 4
    everything = cli("ls", demo_store.url, "--all", "--limit", "0", "--json").json()["tiers"][0]
    assert everything["total"] == total + 1 and {r["kind"] for r in everything["rows"]} == {"block", "namespace"}
    by_model = cli("ls", demo_store.url, "--namespace", EngineConfig().model_id, "--json").json()["tiers"][0]
    assert by_model["total"] == total
    sizes = [r["size"] for r in cli("ls", demo_store.url, "--sort", "size", "--limit", "0", "--json").json()["tiers"][0]["rows"]]
    assert sizes == sorted(sizes)
    big = cli("ls", demo_store.url, "--min-size", str(sizes[-1]), "--json").json()["tiers"][0]
    assert big["total"] == sizes.count(sizes[-1])
    assert cli("ls", demo_store.url, "--older-than", "1d", "--json").json()["tiers"][0]["total"] == 0
    assert cli("ls", demo_store.url, "--newer-than", "1d", "--json").json()["tiers"][0]["total"] == total
    text = cli("ls", demo_store.url, "--limit", "3")
    assert text.code == 0 and f"1-3 of {total}" in text.out


def test_show_gives_header_fields_and_per_layer_statistics(demo_store):
    tokens = demo_store.prompts["rag-question-1"]
    block = cli("explain", demo_store.url, "--token-ids", ",".join(map(str, tokens)), "--json").json()["blocks"][0]
    report = cli("show", demo_store.url, block["key"], "--json").json()  # the 32-hex block key
    model, engine = ModelConfig.tiny(), EngineConfig()
    shape = [model.num_layers, 2, engine.block_size, model.num_kv_heads, model.head_dim]
    h = report["header"]
    assert report["valid"] is True and report["model_id"] == engine.model_id
    assert h["key"] == block["key"] and report["key"] == h["namespace"] + h["key"]
    assert h["shape"] == shape and h["dtype"] == model.dtype
    assert h["raw_len"] == prod(shape) * 4 and report["size"] == HEADER_BYTES + h["stored_len"]
    assert [(r["layer"], r["part"]) for r in report["layers"]] == [(i, p) for i in range(model.num_layers) for p in "KV"]
    for row in report["layers"]:
        assert row["nan"] == row["inf"] == 0 and row["min"] <= row["mean"] <= row["max"] and row["std"] > 0
    by_prefix = cli("show", demo_store.url, report["key"][:48], "--no-stats", "--json").json()
    assert by_prefix["key"] == report["key"] and "layers" not in by_prefix
    text = cli("show", demo_store.url, report["key"])
    assert text.code == 0 and "per-layer statistics" in text.out
    missing = cli("show", demo_store.url, "00" * 32)
    assert missing.code == 1 and missing.err.startswith("tiered-kv: error: no entry")


def test_read_only_commands_leave_lru_order_and_hits_alone(demo_copy):
    from storage_backends.lmdb_disk import LmdbBackend

    def state():
        b = LmdbBackend(demo_copy, capacity="1GiB")
        try:
            order = b.lru_order()
            return order, [b.entry_meta(k)["hits"] for k in order]
        finally:
            b.close()

    before = state()
    url = f"lmdb://{demo_copy}"
    for args in (["inspect"], ["ls"], ["verify"], ["show", before[0][-1].hex()],
                 ["explain", "--token-ids", "1,2,3"]):
        assert cli(args[0], url, *args[1:]).code == 0
    assert state() == before


def test_the_demo_json_itself_is_what_the_cli_read(demo_store):
    """Guard the fixture: the demo stored to LMDB and its outputs matched."""
    assert demo_store.report["store"] == demo_store.url
    assert demo_store.report["outputs_identical"] is True
    assert json.loads((demo_store.workdir / "run2.json").read_text())["prompts"].keys() == demo_store.prompts.keys()


def test_the_demo_leaves_its_prompts_for_explain_tokens_file(demo_store):
    for name, tokens in demo_store.prompts.items():
        path = demo_store.workdir / "prompts" / f"{name}.json"
        assert json.loads(path.read_text()) == tokens
        by_file = cli("explain", demo_store.url, "--tokens", path, "--json").json()
        by_ids = cli("explain", demo_store.url, "--token-ids", ",".join(map(str, tokens)), "--json").json()
        assert by_file == by_ids and by_file["matched_tokens"] > 0
