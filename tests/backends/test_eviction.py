"""The eviction rule on its own, over an in-memory index: what a put of one tenant must evict,
or that it must be refused, before any medium is involved."""

from __future__ import annotations

from storage_backends.eviction import Eviction, Plan
from storage_backends.eviction_lru import LRU
from storage_backends.quotas import Quotas
from storage_backends.recency import RecencyIndex

A, B = b"a", b"b"


def index_of(*entries: tuple[bytes, int, bytes], pinned: tuple[bytes, ...] = ()) -> RecencyIndex:
    index = RecencyIndex(lambda key: key in pinned)
    for key, size, tenant in entries:  # oldest first
        index.add(key, size, tenant)
    return index


def test_a_tenant_over_its_quota_pays_with_its_own_oldest_then_the_capacity_with_anyones():
    index = index_of((b"b1", 10, B), (b"a1", 10, A), (b"a2", 10, A), (b"b2", 10, B))
    eviction = Eviction(LRU, capacity=40, quotas=Quotas(default=25))
    assert eviction.plan(index, A, 10) == Plan(quota=[(b"a1", 10)], capacity=[])
    assert eviction.plan(index, B, 5) == Plan(quota=[], capacity=[(b"b1", 10)])  # the oldest of all
    assert eviction.plan(index, A, 30) is None  # over the quota on its own


def test_pinned_entries_stay_and_a_plan_that_cannot_be_met_evicts_nothing():
    index = index_of((b"a1", 10, A), (b"a2", 10, A), (b"a3", 10, A), pinned=(b"a1",))
    eviction = Eviction(LRU, quotas=Quotas(default=30))
    assert eviction.plan(index, A, 20) == Plan(quota=[(b"a2", 10), (b"a3", 10)])
    assert eviction.plan(index, A, 30) is None


def test_entries_a_quota_takes_are_not_counted_twice_for_the_capacity():
    index = index_of((b"a1", 10, A), (b"b1", 10, B), (b"a2", 10, A))
    eviction = Eviction(LRU, capacity=30, quotas=Quotas(default=20))
    assert eviction.plan(index, A, 20) == Plan(quota=[(b"a1", 10), (b"a2", 10)], capacity=[])
    assert eviction.plan(index, A, 25) is None
    assert Eviction(LRU, capacity=30, quotas=Quotas(default=20)).beyond_capacity(index, 15) == \
        [(b"a1", 10), (b"b1", 10)]


def test_unlabelled_data_has_a_quota_only_when_one_is_named_for_it():
    index = index_of((b"x", 50, b""))
    assert Eviction(LRU, quotas=Quotas(default=10)).plan(index, b"", 50) == Plan()
    assert Eviction(LRU, quotas=Quotas(10, {b"": 60})).plan(index, b"", 20) == Plan(quota=[(b"x", 50)])


def order(index: RecencyIndex, tenant: bytes | None = None) -> list[bytes]:
    return [key for key, _ in index.oldest(tenant)]


def test_touching_the_newest_keys_in_their_order_changes_nothing_and_any_other_touch_reorders():
    index = index_of((b"a1", 10, A), (b"b1", 10, B), (b"a2", 10, A), (b"b2", 10, B))
    index.touch_many([b"a2", b"b2"])  # the newest two, in order: nothing moves
    assert order(index) == [b"a1", b"b1", b"a2", b"b2"]
    index.touch_many([b"b2", b"a2"])  # the newest two, the other way round
    assert order(index) == [b"a1", b"b1", b"b2", b"a2"]
    index.touch_many([b"b1", b"a2"])  # the newest last, but an older one before it
    assert order(index) == [b"a1", b"b2", b"b1", b"a2"]
    assert order(index, A) == [b"a1", b"a2"] and order(index, B) == [b"b2", b"b1"]
    index.touch_many([b"a2", b"a2"])  # a key twice: it ends newest, once
    assert order(index) == [b"a1", b"b2", b"b1", b"a2"]
    index.touch_many([b"zz", b"a1"])  # a key not held is passed over
    assert order(index) == [b"b2", b"b1", b"a2", b"a1"] and order(index, A) == [b"a2", b"a1"]
