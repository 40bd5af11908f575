"""The CLI on blocks whose self-consistent headers lie (another shape or dtype than their
namespace's block, or a zstd frame declaring 1 TiB): ``show``, ``verify``, ``explain`` and
``copy`` report each in one line with their exit code, never a traceback or a big allocation,
and ``copy`` never copies one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from storage_backends.file_dir import FileBackend
from storage_backends.lmdb_disk import LmdbBackend
from tests.cli.conftest import cli
from tests.store.helpers import NS, keys_for, make_store, payloads
from tests.store.test_lying_blocks_store import lying_block, one_tib_block
from tiered_kv.store.records import namespace_key

N = 4
ONE_LINE = 300  # characters a one-line report may take


def open_medium(url: str):
    path = url.split("://", 1)[1]
    return LmdbBackend(path, capacity="1GiB") if url.startswith("lmdb") else FileBackend(path, create=False)


def build(tmp_path: Path, medium: str, lies: dict[int, str], *, record: bool = True) -> tuple[str, list[bytes]]:
    """A store of N honest blocks (and their namespace record) on ``medium``, with the blocks at
    the indexes of ``lies`` replaced by lying ones; (its URL, the blocks' storage keys)."""
    disk = {"url": f"file://{tmp_path}/files"} if medium == "file" else "64MiB"
    keys = keys_for(N)
    with make_store(tmp_path, disk=disk) as store:
        store.save(keys, payloads(store, N))
        store.flush()
        planted = [(store.tier("disk").ns + keys[i],
                    one_tib_block(store.tier("disk").ns, keys[i]) if lie == "one_tib" else
                    lying_block(store, store.tier("disk"), keys[i], lie)) for i, lie in lies.items()]
        url = store.tier("disk").backend.url.split("?", 1)[0]
    backend = open_medium(url)
    try:
        backend.put_many(planted)
        if not record:
            backend.delete_many([namespace_key(NS.digest())])
        backend.flush()
    finally:
        backend.close()
    return url, [NS.digest() + k for k in keys]


def assert_one_line(result, *needles: str) -> str:
    """No traceback, nothing on stderr, and exactly one output line naming ``needles``."""
    assert "Traceback" not in result.out + result.err and result.err == ""
    lines = [line for line in result.out.splitlines() if all(n in line for n in needles)]
    assert len(lines) == 1, result.out
    assert len(lines[0]) < ONE_LINE
    return lines[0]


LIES = ("one_tib", "same_size_other_shape", "other_dtype_same_size", "fewer_layers")


@pytest.mark.parametrize("medium", ["lmdb", "file"])
def test_show_of_a_block_declaring_1tib_prints_one_line(tmp_path, medium):
    url, keys = build(tmp_path, medium, {1: "one_tib"})
    text = cli("show", url, keys[1].hex())
    assert text.code == 1
    assert_one_line(text, keys[1].hex(), "corrupt")
    assert text.out.count("\n") == 1, "a lying block is reported in one line"
    report = cli("show", url, keys[1].hex(), "--json")
    assert report.code == 1
    doc = report.json()
    assert (doc["valid"], doc["reason"]) == (False, "corrupt")
    assert "\n" not in doc["error"] and len(doc["error"]) < ONE_LINE and "layers" not in doc


@pytest.mark.parametrize("lie", ["same_size_other_shape", "other_dtype_same_size", "fewer_layers"])
def test_show_of_a_block_of_another_layout_than_its_namespace_is_corrupt(tmp_path, lie):
    url, keys = build(tmp_path, "lmdb", {2: lie})
    doc = cli("show", url, keys[2].hex(), "--json")
    assert doc.code == 1
    report = doc.json()
    assert (report["valid"], report["reason"]) == (False, "corrupt") and "layers" not in report
    assert "namespace" in report["error"] and "\n" not in report["error"]
    assert_one_line(cli("show", url, keys[2].hex()), keys[2].hex(), "corrupt")


@pytest.mark.parametrize("medium", ["lmdb", "file"])
@pytest.mark.parametrize("padded", [False, True], ids=["tiny_body", "32MiB_body"])
def test_verify_without_a_namespace_record_reports_a_block_declaring_1tib_in_one_line(tmp_path, medium, padded):
    url, keys = build(tmp_path, medium, {0: "one_tib"}, record=False)
    if padded:  # a body long enough for a zstd frame to expand to 1 TiB: the size cap refuses it
        backend = open_medium(url)
        try:
            [blob] = backend.get_many([keys[0]])
            backend.put_many([(keys[0], _padded(blob))])
        finally:
            backend.close()
    found = cli("verify", url)
    assert found.code == 1
    assert_one_line(found, keys[0].hex(), "corrupt")
    report = cli("verify", url, "--json")
    assert report.code == 1
    [finding] = report.json()["tiers"][0]["findings"]
    assert (finding["kind"], finding["key"]) == ("corrupt", keys[0].hex())
    assert "\n" not in finding["detail"] and len(finding["detail"]) < ONE_LINE


def _padded(blob: bytes) -> bytes:
    """The same lie with 32 MiB of zeros after its zstd frame (header and checks rewritten)."""
    import struct

    import xxhash

    from tiered_kv.store.codec import HEADER

    head, body = blob[: HEADER.size], blob[HEADER.size :] + bytes(32 << 20)
    fields = list(HEADER.unpack(head))
    fields[-5] = len(body)  # stored_len
    fields[-3] = xxhash.xxh3_64_intdigest(body) & 0xFFFFFFFF  # body check
    packed = HEADER.pack(*fields)
    return packed[:-4] + struct.pack("<I", xxhash.xxh32_intdigest(packed[:-4])) + body


@pytest.mark.parametrize("lie", LIES)
def test_verify_reports_a_lying_block_in_one_line_and_fix_removes_it(tmp_path, lie):
    url, keys = build(tmp_path, "lmdb", {1: lie})
    found = cli("verify", url)
    assert found.code == 1
    assert_one_line(found, keys[1].hex())
    fixed = cli("verify", url, "--fix", "--json")
    assert fixed.code == 0 and fixed.json()["tiers"][0]["findings"][0]["fixed"] is True
    assert cli("verify", url).code == 0


@pytest.mark.parametrize("lie", LIES)
def test_explain_counts_a_lying_block_as_a_corrupt_miss_where_reuse_stops(tmp_path, lie):
    url, keys = build(tmp_path, "lmdb", {2: lie})
    tokens = ",".join(map(str, range(N * NS.block_size + 1)))
    result = cli("explain", url, "--token-ids", tokens, "--json")
    assert result.code == 0 and result.err == ""
    report = result.json()
    assert report["matched_blocks"] == 2
    assert report["blocks"][2]["status"] == {"store": "corrupt"} and report["blocks"][2]["tier"] is None
    miss = report["first_miss"]
    assert (miss["index"], miss["reason"]) == (2, "corrupt")
    assert "\n" not in miss["detail"] and len(miss["detail"]) < ONE_LINE
    text = cli("explain", url, "--token-ids", tokens)
    assert_one_line(text, "first miss", "corrupt")


@pytest.mark.parametrize("verify", [True, False], ids=["verify", "no_verify"])
@pytest.mark.parametrize("lie", LIES)
def test_copy_skips_a_lying_block_exits_1_and_the_target_never_holds_it(tmp_path, lie, verify):
    url, keys = build(tmp_path, "lmdb", {1: lie})
    dest = f"file://{tmp_path}/export"
    args = ["copy", url, dest] + ([] if verify else ["--no-verify"])
    text = cli(*args)
    assert text.code == 1
    assert_one_line(text, keys[1].hex())
    target = FileBackend(f"{tmp_path}/export", create=False)
    try:
        assert target.contains_many(keys) == [True, False, True, True]
    finally:
        target.close()
    report = cli(*args, "--overwrite", "--json")
    assert report.code == 1
    assert report.json()["corrupt_skipped"] == [keys[1].hex()]


@pytest.mark.parametrize("verify", [True, False], ids=["verify", "no_verify"])
def test_copy_without_a_namespace_record_refuses_a_block_declaring_1tib(tmp_path, verify):
    url, keys = build(tmp_path, "lmdb", {3: "one_tib"}, record=False)
    dest = f"file://{tmp_path}/export"
    result = cli("copy", url, dest, "--json", *([] if verify else ["--no-verify"]))
    assert result.code == 1 and "Traceback" not in result.err
    report = json.loads(result.out)
    assert report["corrupt_skipped"] == [keys[3].hex()] and report["copied"] == N - 1
