"""Redis key names: in a cluster a key that would form a hash tag is stored behind an empty tag
(so a namespace is never pinned to one slot) and listed back as itself."""

from __future__ import annotations

from redis.crc import key_slot

from storage_backends.redis_names import RedisNames


def test_keys_with_a_brace_get_an_empty_tag_in_a_cluster_and_come_back_as_themselves():
    names = RedisNames(b"tkv:", cluster=True)
    tagged = b"ns\x00{ab}\x01block"
    assert names.name(tagged) == b"tkv:{}" + tagged
    assert names.name(b"plain") == b"tkv:plain"
    for key in (tagged, b"plain", b"{}starts-with-an-empty-tag", b"{", b"}{x}"):
        assert names.key(names.name(key)) == key
    # the empty tag makes Redis hash the whole name: keys of one tag spread over slots
    slots = {key_slot(names.name(b"ns{ab}" + bytes([i]))) for i in range(64)}
    assert len(slots) > 32


def test_a_single_server_or_a_prefix_with_its_own_tag_keeps_names_as_they_are():
    for names in (RedisNames(b"tkv:", cluster=False), RedisNames(b"{tkv}:", cluster=True)):
        assert names.name(b"a{b}c") == names.prefix + b"a{b}c"
        assert names.key(names.name(b"a{b}c")) == b"a{b}c"


def test_listing_by_prefix_matches_guarded_and_plain_names():
    names = RedisNames(b"tkv:", cluster=True)
    patterns = names.patterns(b"ns{")
    assert len(patterns) == 2 and all(p.endswith(b"*") for p in patterns)
    assert RedisNames(b"tkv:", cluster=False).patterns(b"ns") == [b"tkv:ns*"]
