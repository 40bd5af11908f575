"""One contract, run unchanged against every storage medium (a real slab, real LMDB files, a
real redis-server). Each backend is opened through the URL registry, as the store opens it."""

from __future__ import annotations

import itertools
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from storage_backends.registry import backend_class, open_backend

CAPACITY = 64 << 20
BIG = 1 << 20  # the largest value every medium takes (the host slot)
MODULES = {"host": "storage_backends.host", "lmdb": "storage_backends.lmdb_disk",
           "redis": "storage_backends.redis_remote", "file": "storage_backends.file_dir"}
_examples = itertools.count()


@pytest.fixture(params=["host", "lmdb", "redis", "file"])
def url(request, tmp_path) -> str:
    name = request.param
    if name == "host":
        url = "host://?capacity=64MiB&slot=1MiB"
    elif name == "lmdb":
        url = f"lmdb://{tmp_path}/db?capacity=64MiB"
    elif name == "file":
        url = f"file://{tmp_path}/files?capacity=64MiB"
    else:
        url = request.getfixturevalue("redis_url")
    try:
        backend_class(url)
    except ModuleNotFoundError as exc:  # a backend still being written: only its own module
        if exc.name != MODULES[name]:
            raise
        pytest.skip(f"{MODULES[name]} does not exist yet")
    return url


@pytest.fixture
def backend(url):
    b = open_backend(url)
    yield b
    b.close()


def bounded(backend) -> bool:
    """Media that keep our bytes to a capacity of their own (host, lmdb); Redis evicts by its
    server's policy and reports the server's memory."""
    return backend.name in ("host", "lmdb", "file")


def value(seed: int, n: int) -> bytes:
    """``n`` bytes with NULs and every byte value, different for every seed."""
    block = bytes((seed * 31 + j * 7) % 256 for j in range(256))
    return (block * (n // 256 + 1))[:n]


def test_binary_keys_and_values_round_trip_byte_exact(backend):
    sizes = [1, 2, 255, 4096, 65536, 300_001, BIG]
    items = [(b"\x00k\xff" + bytes([i]) * 29, value(i, n)) for i, n in enumerate(sizes)]
    items.append((b"\x00" * 32, b"\x00" * 1000))  # all-NUL key and value
    assert backend.put_many(items) == [True] * len(items)
    assert backend.get_many([k for k, _ in items]) == [v for _, v in items]


def test_batch_order_is_kept_and_misses_are_none(backend):
    assert backend.put_many([(b"a", b"1"), (b"c", b"3"), (b"e", b"5")]) == [True] * 3
    assert backend.get_many([b"e", b"b", b"a", b"zz", b"c", b"a"]) == [b"5", None, b"1", None, b"3", b"1"]


def test_contains_many_answers_presence_without_side_effects(backend):
    backend.put_many([(b"a", b"1"), (b"b", b"2")])
    before = backend.stats()
    assert backend.contains_many([b"b", b"zz", b"a"]) == [True, False, True]
    after = backend.stats()
    assert (after.gets, after.hits, after.entries) == (before.gets, before.hits, before.entries)
    assert backend.get_many([b"zz"]) == [None]  # asking did not create it


def test_contains_does_not_refresh_recency(backend):
    if not bounded(backend):
        pytest.skip("recency is the Redis server's business")
    slots = CAPACITY // BIG
    backend.put_many([(bytes([i]), value(i, BIG)) for i in range(slots)])  # exactly full
    for _ in range(3):
        backend.contains_many([bytes([0])])
    backend.put_many([(b"new", value(99, BIG))])
    assert backend.contains_many([bytes([0]), bytes([1]), b"new"]) == [False, True, True]


def test_overwrite_replaces_the_value_and_its_size(backend):
    backend.put_many([(b"k", b"old" * 1000)])
    before = backend.stats()
    backend.put_many([(b"k", b"new")])
    assert backend.get_many([b"k"]) == [b"new"]
    after = backend.stats()
    assert after.entries == before.entries
    if bounded(backend):
        assert after.used_bytes == before.used_bytes - 3000 + 3


def test_delete_many_counts_what_was_present(backend):
    backend.put_many([(b"a", b"1"), (b"b", b"2"), (b"c", b"3")])
    assert backend.delete_many([b"a", b"nope", b"c", b"a"]) == 2
    assert backend.get_many([b"a", b"b", b"c"]) == [None, b"2", None]
    assert backend.delete_many([b"a"]) == 0


def test_scan_by_prefix_returns_exactly_our_keys(backend):
    ours = [b"ns1\x00" + bytes([i]) for i in range(5)]
    backend.put_many([(k, b"x") for k in ours] + [(b"ns2*", b"y"), (b"n[s?", b"z"), (b"ns", b"w")])
    assert sorted(backend.scan(b"ns1\x00")) == sorted(ours)
    assert list(backend.scan(b"ns2*")) == [b"ns2*"]  # glob characters are literal
    assert list(backend.scan(b"n[s?")) == [b"n[s?"]
    assert sorted(backend.scan(b"ns")) == sorted(ours + [b"ns2*", b"ns"])
    assert len(list(backend.scan())) == 8
    assert list(backend.scan(b"zz")) == []


def test_visit_many_shows_each_present_value_once(backend):
    items = [(b"a", value(1, 5000)), (b"b", value(2, BIG)), (b"c", b"\x00")]
    backend.put_many(items)
    seen: dict[int, bytes] = {}

    def visitor(i: int, buf: memoryview) -> None:
        assert isinstance(buf, memoryview) and i not in seen
        seen[i] = bytes(buf)

    found = backend.visit_many([b"b", b"missing", b"a", b"c"], visitor)
    assert found == [True, False, True, True]
    assert seen == {0: items[1][1], 2: items[0][1], 3: b"\x00"}


def test_stats_move_with_use(backend):
    before = backend.stats()
    backend.put_many([(b"a", b"1" * 1000), (b"b", b"2" * 1000)])
    backend.get_many([b"a", b"x"])
    after = backend.stats()
    assert after.name == backend.name
    assert after.entries == before.entries + 2
    assert after.puts - before.puts == 2
    assert after.gets - before.gets == 2 and after.hits - before.hits == 1
    if bounded(backend):  # Redis reports server memory, not our bytes
        assert after.used_bytes - before.used_bytes == 2000
        assert after.capacity_bytes == CAPACITY


def test_empty_batches_are_fine(backend):
    assert backend.get_many([]) == []
    assert backend.put_many([]) == []
    assert backend.contains_many([]) == []
    assert backend.delete_many([]) == 0
    assert backend.visit_many([], lambda i, b: None) == []


def test_close_is_idempotent_and_later_calls_are_errors(url):
    b = open_backend(url)
    b.put_many([(b"a", b"1")])
    b.close()
    b.close()
    with pytest.raises(ValueError):
        b.get_many([b"a"])


def test_concurrent_puts_and_gets_from_several_threads(backend):
    errors: list[BaseException] = []

    def work(t: int) -> None:
        try:
            for i in range(15):
                key = f"t{t}-{i}".encode()
                assert backend.put_many([(key, value(t * 100 + i, 3000 + i))]) == [True]
                assert backend.get_many([key]) == [value(t * 100 + i, 3000 + i)]
                assert backend.contains_many([key]) == [True]
                if i % 5 == 0:
                    list(backend.scan(f"t{t}-".encode()))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    keys = [f"t{t}-{i}".encode() for t in range(4) for i in range(15)]
    assert backend.get_many(keys) == [value(t * 100 + i, 3000 + i) for t in range(4) for i in range(15)]
    assert backend.stats().entries == 60  # the host has 64 slots


def test_over_capacity_keeps_the_most_recently_used(backend):
    if not bounded(backend):
        pytest.skip("Redis evicts by its own maxmemory policy")
    slots = CAPACITY // BIG
    for i in range(slots + 16):  # 80 MiB into 64 MiB, key 0 kept hot
        assert backend.put_many([(i.to_bytes(2, "big"), value(i, BIG))]) == [True]
        assert backend.get_many([(0).to_bytes(2, "big")]) == [value(0, BIG)]
    present = backend.contains_many([i.to_bytes(2, "big") for i in range(slots + 16)])
    assert [i for i, p in enumerate(present) if p] == [0, *range(17, slots + 16)]
    stats = backend.stats()
    assert stats.used_bytes <= CAPACITY and stats.evictions >= 16


def test_a_value_larger_than_the_whole_capacity_is_refused_not_raised(backend):
    if not bounded(backend):
        pytest.skip("Redis has no per-backend capacity")
    before = backend.stats().put_rejected
    assert backend.put_many([(b"huge", bytes(CAPACITY + 1)), (b"ok", b"y")]) == [False, True]
    assert backend.get_many([b"huge", b"ok"]) == [None, b"y"]
    assert backend.stats().put_rejected == before + 1


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.tuples(st.sampled_from([b"a", b"b", b"\x00", b"k" * 40, b"\xff" * 32]),
                              st.binary(min_size=0, max_size=3000)), max_size=12))
def test_any_sequence_of_puts_reads_back_like_a_dict(backend, ops):
    ns = f"ex{next(_examples)}:".encode()  # one backend for all examples: a namespace each
    model: dict[bytes, bytes] = {}
    for key, val in ops:
        assert backend.put_many([(ns + key, val)]) == [True]
        model[key] = val
    keys = [b"a", b"b", b"\x00", b"k" * 40, b"\xff" * 32]
    assert backend.get_many([ns + k for k in keys]) == [model.get(k) for k in keys]
    assert sorted(backend.scan(ns)) == sorted(ns + k for k in model)


def test_every_medium_takes_a_tenant_label_and_those_that_count_add_it_up(backend):
    assert backend.put_many([(b"a", b"1" * 100), (b"b", b"2" * 50)], tenant=b"tenant-1") == [True, True]
    assert backend.put_many([(b"c", b"3" * 10)]) == [True]
    assert backend.get_many([b"a", b"c"]) == [b"1" * 100, b"3" * 10]
    usage = backend.tenant_usage()
    if usage is None:  # Redis: the label is accepted, not kept
        assert not bounded(backend)
        return
    assert usage == {b"tenant-1": 150, b"": 10} and sum(usage.values()) == backend.stats().used_bytes
    assert {t: n.entries for t, n in backend.tenant_totals().items()} == {b"tenant-1": 2, b"": 1}
