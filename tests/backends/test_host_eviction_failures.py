"""The host tier when what runs around an eviction fails: a hook raising (an Exception, or what
is none: KeyboardInterrupt, SystemExit), a reservation raising after it evicted, a length that
cannot be charged; and many threads storing, reading, withdrawing and evicting at once, each
read seeing its own key's bytes. Real slabs, real threads, nothing mocked."""

from __future__ import annotations

import hashlib
import random
import threading

import pytest

from storage_backends.host import HostBackend
from tests.backends.test_host_stats_counters import assert_exact

SLOT = 1024
A, B = b"tenant-a", b"tenant-b"


class Interrupt(BaseException):
    """What a hook may raise that is no Exception (as KeyboardInterrupt or SystemExit)."""


def value_of(key: bytes, n: int = SLOT) -> bytes:
    return (hashlib.sha256(key).digest() * (n // 32 + 1))[:n]


def test_regression_a_hook_interrupted_on_one_victim_lost_the_others_and_held_the_reservations_for_good():
    # "k1"'s hook raised a BaseException: "k2" (evicted by the same call) never reached the
    # hook and stayed pending for good (once withdrawn, every later evicted copy of it read as
    # withdrawn), and the call's reservations "n1", "n2" (its caller got the error, never the
    # slots) stayed reserved for good: two slots lost, never committed, aborted or evicted
    seen: list[bytes] = []

    def hook(key, value, tenant):
        seen.append(key)
        if key == b"k1":
            raise Interrupt()

    h = HostBackend(capacity=2 * SLOT, slot_bytes=SLOT, pinned=False, on_evict=hook)
    h.put_many([(b"k1", b"1"), (b"k2", b"2")])
    with pytest.raises(Interrupt):
        h.reserve_many([b"n1", b"n2"])
    assert seen == [b"k1", b"k2"], "an evicted block reached no hook"
    assert h.states_many([b"n1", b"n2"]) == [None, None], "reservations nobody knows of were kept"
    assert h.can_reserve(2) and assert_exact(h)["room"] == 2
    h.retire_many([b"k2"])  # withdrawn long after its eviction ended
    assert h.withdrawn_in_eviction([b"k1", b"k2"]) == [False, False]
    assert None not in h.reserve_many([b"n1", b"n2"])  # both slots are there to be had again


def test_a_hook_raising_an_exception_loses_no_slot_and_the_call_keeps_its_reservations():
    seen: list[bytes] = []

    def hook(key, value, tenant):
        seen.append(key)
        raise RuntimeError("the lower tier refused it")

    h = HostBackend(capacity=2 * SLOT, slot_bytes=SLOT, pinned=False, on_evict=hook)
    h.put_many([(b"k1", b"1"), (b"k2", b"2")])
    slots = h.reserve_many([b"n1", b"n2"])
    assert None not in slots and seen == [b"k1", b"k2"]
    assert h.states_many([b"n1", b"n2"]) == ["reserved", "reserved"]
    h.commit_many([b"n1", b"n2"])
    assert h.stats().evictions == 2 and assert_exact(h)["entries"] == 2


def test_regression_a_reservation_that_raised_after_evicting_did_not_count_its_evictions():
    # "n1" evicted "k1" (told to the listener as removed, handed to the hook), then "n2" had no
    # length: the call raised and the eviction was never counted
    removed: list[bytes] = []
    h = HostBackend(capacity=2 * SLOT, slot_bytes=SLOT, pinned=False, on_evict=lambda k, v, t: None)
    h.listen(lambda change, keys: removed.extend(keys) if change == "removed" else None)
    h.put_many([(b"k1", b"1"), (b"k2", b"2")])
    before = h.stats().evictions
    with pytest.raises(IndexError):
        h.reserve_many([b"n1", b"n2"], lengths=[SLOT])
    assert removed == [b"k1"] and h.contains_many([b"k1"]) == [False]
    assert h.stats().evictions == before + 1, "an eviction that happened was not counted"
    assert assert_exact(h)["entries"] == 1


def test_regression_a_reservation_of_a_negative_length_credited_its_tenant_past_its_quota():
    # a length of -3 slots was taken: the tenant's usage went down by 3 slots, and it then held
    # 5 slots under a quota of 2
    h = HostBackend(capacity=8 * SLOT, slot_bytes=SLOT, pinned=False, tenant_quota=2 * SLOT)
    assert h.reserve_many([b"bad"], lengths=[-3 * SLOT], tenant=A) == [None]
    assert h.reserve_many([b"a1", b"a2", b"a3"], lengths=[SLOT] * 3, tenant=A).count(None) == 1
    assert h.tenant_usage() == {A: 2 * SLOT}
    assert h.reserve_many([b"empty"], lengths=[0], tenant=B) != [None]  # nothing charged: fine


@pytest.mark.parametrize("seed", range(2))
def test_threads_storing_reading_withdrawing_and_evicting_at_once_each_read_sees_its_own_bytes(seed):
    problems: list[tuple] = []
    h = None

    def hook(key, value, tenant):  # sees an evicted block's bytes before its slot is reused
        if bytes(value) != value_of(key, len(value)):
            problems.append(("hook saw another block's bytes", key))
        h.withdrawn_in_eviction([key])  # asks the tier back: no deadlock with its lock
        if len(value) % 5 == 0:
            raise RuntimeError("the lower tier refused it")

    h = HostBackend(capacity=12 * SLOT, slot_bytes=SLOT, pinned=False, on_evict=hook, tenant_quota=5 * SLOT)
    keys = [bytes([i]) * 4 for i in range(30)]

    def worker(n: int) -> None:
        rng = random.Random(seed * 100 + n)
        for _ in range(1500):
            key, tenant, call = rng.choice(keys), rng.choice([A, B, b""]), rng.random()
            if call < 0.35:
                size = rng.randint(0, SLOT)
                h.put_many([(key, value_of(key, size))], tenant=tenant)
            elif call < 0.6:
                got = h.get_many([key])[0]
                if got is not None and got != value_of(key, len(got)):
                    problems.append(("read another block's bytes", key))
            elif call < 0.8:  # the store's way: reserve, fill, commit leased, read the lease, end it
                batch = rng.sample(keys, 3)
                mine = [(k, s) for k, s in zip(batch, h.reserve_many(batch, tenant=tenant)) if s is not None]
                for k, s in mine:
                    h.slot_view(s).numpy()[:] = memoryview(value_of(k))
                h.commit_many([k for k, _ in mine], pin=True)
                for k, s in mine:
                    if bytes(h.slot_view(s).numpy()) != value_of(k):
                        problems.append(("a leased slot was reused", k))
                h.unpin_many([k for k, _ in mine])
            elif call < 0.9:
                h.retire_many([key], withdrawn=rng.random() < 0.5)
            else:
                h.delete_many([key])
            for t, used in h.tenant_usage().items():
                if t and used > 5 * SLOT:
                    problems.append(("over its quota", t, used))

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)  # a hang guard only
    assert not any(t.is_alive() for t in threads), "a thread hung (a deadlock?)"
    assert problems == []
    truth = assert_exact(h)
    assert truth["leased"] == 0 and h.withdrawn_in_eviction(keys) == [False] * len(keys)
    assert h.stats().evictions and h.stats().extra["quota_evictions"]
