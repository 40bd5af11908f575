"""``verify --fix`` reads each wrong entry again right before its delete; a serving process may
store a good block under that key between that read and the delete (an engine that read the
corrupt block and recomputed it). The delete takes an entry only while it still holds the value
judged (storage_backends.cas_delete), so that good block survives. The rewrite is made by another
thread, gated on events at exactly that point (real LMDB under tmp_path, a real redis-server, a
real file store)."""

from __future__ import annotations

import random
import threading

import pytest

from storage_backends.cas_delete import delete_if_unchanged
from storage_backends.file_dir import FileBackend
from storage_backends.lmdb_disk import LmdbBackend
from storage_backends.redis_remote import RedisBackend
from tiered_kv.admin.opening import open_tier
from tiered_kv.admin.verify import verify_tier
from tiered_kv.keys import Namespace
from tiered_kv.store.codec import BlockCodec

NS = Namespace(model_id="cas-test", dtype="bfloat16", num_layers=2, num_kv_heads=2, head_dim=8, block_size=4)
DIGEST = NS.digest()
N = 4  # corrupt blocks; the one at index 1 is rewritten good during the fix


def block(i: int, seed: int) -> tuple[bytes, bytes]:
    key = bytes([i]) * 16
    payload = random.Random(seed).randbytes(2 * 2 * 4 * 2 * 8 * 2)
    value = BlockCodec().encode(payload, dtype="bfloat16", shape=NS.block_shape, namespace=DIGEST, key=key,
                                created=1.0)
    return DIGEST + key, bytes(value)


def corrupt(value: bytes) -> bytes:
    return value[:-5] + bytes([value[-5] ^ 0xFF]) + value[-4:]


def fix_while_a_server_rewrites(tier, writer) -> dict:
    """verify --fix on ``tier`` whose blocks are all corrupt; right after the fix read block 1
    again (judged still wrong), ``writer`` (the serving process) stores a good block 1, on another
    thread, before the fix goes on to its delete."""
    key, good = block(1, seed=99)
    read, scanned, reread, rewritten = tier.backend.get_many, threading.Event(), threading.Event(), threading.Event()

    def serve() -> None:
        assert reread.wait(60)
        writer([(key, good)])
        rewritten.set()

    def reading(keys):
        values = read(keys)
        if scanned.is_set() and key in keys and not reread.is_set():
            reread.set()  # the fix's read right before its delete: the rewrite comes now
            assert rewritten.wait(60)
            report_of_rewrite.append(True)
        return values

    def progress(done, total):
        if done and not scanned.is_set() and sum(progress.seen) + done == total:
            scanned.set()
        progress.seen.append(done)

    progress.seen = []
    report_of_rewrite: list[bool] = []
    server = threading.Thread(target=serve)
    server.start()
    tier.backend.get_many = reading
    try:
        report = verify_tier(tier, fix=True, progress=progress)
    finally:
        reread.set()
        server.join()
        del tier.backend.get_many
    assert report_of_rewrite == [True], "the fix never read block 1 again after its scan"
    return report


def check(report: dict, held: list) -> None:
    _, good = block(1, seed=99)
    assert held[1] == good, "the good block stored between the re-read and the delete was deleted"
    assert [h is None for h in held] == [True, False, True, True]
    assert report["ok"] and report["problems"]["corrupt"] == N, report
    assert report["actions"][0].startswith(f"removed {N - 1} of {N} entries"), report["actions"]
    assert "left 1 entries alone" in report["actions"][1]


def fill(backend) -> list[bytes]:
    items = [block(i, seed=i) for i in range(N)]
    backend.put_many([(k, corrupt(v)) for k, v in items])
    return [k for k, _ in items]


def test_a_verify_fix_does_not_delete_an_lmdb_block_rewritten_between_its_reread_and_its_delete(tmp_path):
    with LmdbBackend(tmp_path / "s", capacity="64MiB") as b:
        keys = fill(b)
    tier = open_tier(f"lmdb://{tmp_path}/s")
    try:  # (the serving write goes through the same environment: LMDB orders writers across processes)
        report = fix_while_a_server_rewrites(tier, tier.backend.put_many)
        check(report, tier.backend.get_many(keys))
    finally:
        tier.close()


def test_a_verify_fix_does_not_delete_a_redis_block_rewritten_between_its_reread_and_its_delete(redis_url):
    with RedisBackend.from_url(redis_url) as serving:
        keys = fill(serving)
        tier = open_tier(redis_url)
        try:
            report = fix_while_a_server_rewrites(tier, serving.put_many)
            check(report, serving.get_many(keys))
        finally:
            tier.close()


def test_a_verify_fix_does_not_delete_a_file_block_rewritten_between_its_reread_and_its_delete(tmp_path):
    with FileBackend(tmp_path / "f") as serving:
        keys = fill(serving)
        tier = open_tier(f"file://{tmp_path}/f")
        try:
            report = fix_while_a_server_rewrites(tier, lambda items: serving.put_many(items, tenant=b"t1"))
            check(report, serving.get_many(keys))
        finally:
            tier.close()


@pytest.mark.parametrize("tenant", [b"", b"t1"])
def test_a_file_delete_if_unchanged_keeps_a_changed_value_and_takes_an_unchanged_one(tmp_path, tenant):
    with FileBackend(tmp_path / "f") as b:
        b.put_many([(b"a" * 16, b"old"), (b"b" * 16, b"same")], tenant=tenant)
        assert delete_if_unchanged(b, [(b"a" * 16, b"other"), (b"b" * 16, b"same"), (b"c" * 16, b"x")]) == \
            [False, True, False]
        assert b.get_many([b"a" * 16, b"b" * 16]) == [b"old", None]
        assert b.check() == [] and sorted(p.name for p in (tmp_path / "f").rglob("*")) == \
            sorted([".tiered-kv-file-store", "61", "62", *(p.name for p in (tmp_path / "f" / "61").iterdir())])


def test_a_redis_delete_if_unchanged_goes_by_batches_and_keeps_changed_values(redis_url):
    with RedisBackend.from_url(redis_url, pipeline_bytes=10) as b:
        items = [(bytes([i]) * 16, bytes([i]) * 8) for i in range(5)]
        b.put_many(items)
        pairs = [(k, v if i % 2 else b"changed!") for i, (k, v) in enumerate(items)]
        assert delete_if_unchanged(b, pairs) == [False, True, False, True, False]
        assert [v is not None for v in b.get_many([k for k, _ in items])] == [True, False, True, False, True]


def test_an_lmdb_delete_if_unchanged_compares_values_kept_in_segment_files_and_in_pages(tmp_path):
    with LmdbBackend(tmp_path / "s", capacity="64MiB", segment_min=1024) as b:
        items = [(bytes([i]) * 32, bytes([i]) * (5000 if i < 3 else 100)) for i in range(5)]
        b.put_many(items)
        pairs = [items[0], (items[1][0], items[1][1][:-1] + b"!"), (items[2][0], items[2][1][:100]),
                 items[3], (items[4][0], b"?" * 100)]
        assert delete_if_unchanged(b, pairs) == [True, False, False, True, False]
        assert b.get_many([k for k, _ in items]) == [None, items[1][1], items[2][1], None, items[4][1]]
        assert b.check() == [] and b.stats().entries == 3


def test_a_verify_fix_on_a_redis_that_forbids_scripts_still_removes_the_corrupt_blocks(own_redis):
    """A Redis whose ACL forbids EVAL (managed services often do): the fix falls back to deleting
    by key (as before delete-if-unchanged), it does not fail."""
    import redis

    admin = redis.Redis.from_url(own_redis.url)
    admin.execute_command("ACL", "SETUSER", "noscript", "on", ">pw", "~*", "&*", "+@all", "-@scripting")
    url = own_redis.url.replace("redis://", "redis://noscript:pw@", 1)
    with RedisBackend.from_url(url) as serving:
        keys = fill(serving)
        assert delete_if_unchanged(serving, [(keys[0], b"x")]) is None  # refused, said so
        tier = open_tier(url)
        try:
            report = verify_tier(tier, fix=True)
            assert report["actions"][0].startswith(f"removed {N} of {N} entries"), report["actions"]
            assert serving.get_many(keys) == [None] * N
        finally:
            tier.close()
    admin.close()
