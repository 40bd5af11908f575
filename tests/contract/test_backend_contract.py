"""One contract, run unchanged against every storage medium (real LMDB files, a real Redis)."""

from __future__ import annotations

import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from storage_backends.registry import open_backend

CAPACITY = 4 << 20


@pytest.fixture(params=["host", "lmdb", "redis"])
def medium(request, tmp_path):
    """(name, opener) for each medium; the opener gives a fresh, empty backend."""
    name = request.param
    if name == "host":
        return name, lambda: open_backend(f"host://?capacity={2 * CAPACITY}&slot=1MiB")  # 8 slots
    if name == "lmdb":
        counter = iter(range(10**6))
        return name, lambda: open_backend(f"lmdb://{tmp_path}/db{next(counter)}?capacity={CAPACITY}")
    url = request.getfixturevalue("redis_url")
    counter = iter(range(10**6))
    return name, lambda: open_backend(url, prefix=f"contract{next(counter)}:")


@pytest.fixture
def backend(medium):
    b = medium[1]()
    yield b
    b.close()


def _value(i: int, n: int) -> bytes:
    return bytes((i * 31 + j) % 256 for j in range(min(n, 256))) * (n // 256) + bytes(n % 256)


def test_values_round_trip_byte_exact_with_binary_keys(backend):
    items = [(b"\x00key\x00" + bytes([i]), _value(i, n)) for i, n in enumerate([1, 255, 4096, 65536, 1 << 20])]
    assert backend.put_many(items) == [True] * len(items)
    assert backend.get_many([k for k, _ in items]) == [v for _, v in items]


def test_batch_order_is_kept_and_misses_are_none(backend):
    backend.put_many([(b"a", b"1"), (b"c", b"3")])
    assert backend.get_many([b"c", b"b", b"a"]) == [b"3", None, b"1"]


def test_contains_many_answers_presence(backend):
    backend.put_many([(b"a", b"1")])
    assert backend.contains_many([b"a", b"zz"]) == [True, False]
    assert backend.leading_present([b"a", b"zz", b"a"]) == 1


def test_overwrite_replaces_the_value(backend):
    backend.put_many([(b"k", b"old" * 100)])
    backend.put_many([(b"k", b"new")])
    assert backend.get_many([b"k"]) == [b"new"]


def test_delete_many_counts_what_was_present(backend):
    backend.put_many([(b"a", b"1"), (b"b", b"2")])
    assert backend.delete_many([b"a", b"nope"]) == 1
    assert backend.get_many([b"a", b"b"]) == [None, b"2"]


def test_scan_by_prefix_returns_exactly_our_keys(backend):
    backend.put_many([(b"ns1" + bytes([i]), b"x") for i in range(5)] + [(b"ns2*", b"y"), (b"n[s", b"z")])
    assert sorted(backend.scan(b"ns1")) == sorted(b"ns1" + bytes([i]) for i in range(5))
    assert list(backend.scan(b"ns2*")) == [b"ns2*"]
    assert len(list(backend.scan())) == 7


def test_visit_many_shows_each_present_value_once(backend):
    backend.put_many([(b"a", b"alpha"), (b"b", b"beta")])
    seen = {}
    found = backend.visit_many([b"b", b"missing", b"a"], lambda i, buf: seen.__setitem__(i, bytes(buf)))
    assert found == [True, False, True]
    assert seen == {0: b"beta", 2: b"alpha"}


def test_stats_move_with_use(backend):
    before = backend.stats()
    backend.put_many([(b"a", b"1" * 1000), (b"b", b"2" * 1000)])
    backend.get_many([b"a", b"x"])
    after = backend.stats()
    assert after.entries == before.entries + 2
    assert after.puts - before.puts == 2
    assert after.gets - before.gets == 2 and after.hits - before.hits == 1
    if backend.name != "redis":  # Redis reports server memory, not our bytes
        assert after.used_bytes - before.used_bytes == 2000


def test_empty_batches_are_fine(backend):
    assert backend.get_many([]) == []
    assert backend.put_many([]) == []
    assert backend.contains_many([]) == []
    assert backend.delete_many([]) == 0


def test_close_is_idempotent(medium):
    b = medium[1]()
    b.close()
    b.close()


def test_concurrent_puts_and_gets_from_several_threads(backend):
    errors = []

    def work(t: int) -> None:
        try:
            for i in range(20):
                key = f"t{t}-{i}".encode()
                assert backend.put_many([(key, _value(i, 3000))]) == [True]
                assert backend.get_many([key]) == [_value(i, 3000)]
        except Exception as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_over_capacity_keeps_the_most_recently_used(backend):
    if backend.name == "redis":
        pytest.skip("Redis evicts by its own maxmemory policy")
    value = b"v" * (512 << 10)
    for i in range(12):  # 6 MiB into 4 MiB
        assert backend.put_many([(bytes([i]), value)]) == [True]
        backend.get_many([bytes([0])])  # keep key 0 hot
    present = backend.contains_many([bytes([i]) for i in range(12)])
    assert present[0] and present[11]
    assert not all(present)
    assert backend.stats().used_bytes <= CAPACITY


def test_a_value_larger_than_the_whole_capacity_is_refused_not_raised(backend):
    if backend.name == "redis":
        pytest.skip("Redis has no per-backend capacity")
    assert backend.put_many([(b"huge", b"x" * (CAPACITY + 1)), (b"ok", b"y")]) == [False, True]
    assert backend.stats().put_rejected >= 1


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.tuples(st.sampled_from([b"a", b"b", b"\x00", b"k" * 40]),
                              st.binary(min_size=0, max_size=2048)), max_size=12))
def test_any_sequence_of_puts_reads_back_like_a_dict(medium, ops):
    b = medium[1]()
    try:
        model = {}
        for key, value in ops:
            assert b.put_many([(key, value)]) == [True]
            model[key] = value
        keys = [b"a", b"b", b"\x00", b"k" * 40]
        assert b.get_many(keys) == [model.get(k) for k in keys]
    finally:
        b.close()
