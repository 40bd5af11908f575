"""Chained content keys of full token blocks (tiered_kv.keys)."""

from __future__ import annotations

import dataclasses
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import xxhash

from tiered_kv.errors import ConfigError, TokenError
from tiered_kv.keys import HASHES, KEY_BYTES, KeyChain, Namespace, block_keys
from tiered_kv.kv_groups import KVGroup

REPO = Path(__file__).resolve().parents[2]
BS = 16


def make_ns(**changes) -> Namespace:
    base = dict(model_id="meta-llama/Llama-3.1-8B", dtype="bfloat16", num_layers=32, num_kv_heads=8,
                head_dim=128, block_size=BS, revision="abc123", tp_rank=0, tp_size=2)
    base.update(changes)
    return Namespace(**base)


NS = make_ns()
PROMPT = [(i * 7919 + 13) % 128_256 for i in range(10 * BS)]  # 10 full blocks


# -- stability ---------------------------------------------------------------------------------

_CHILD = """
from tiered_kv.keys import Namespace, block_keys
ns = Namespace("meta-llama/Llama-3.1-8B", "bfloat16", 32, 8, 128, 16, revision="abc123", tp_size=2)
toks = [(i * 7919 + 13) % 128256 for i in range(160)]
for k in block_keys(ns, toks) + block_keys(ns, toks, lora="adapter-7", extras={3: b"img"}):
    print(k.hex())
print(ns.digest().hex())
"""


def _keys_in_child(hashseed: str) -> list[str]:
    env = {**os.environ, "PYTHONHASHSEED": hashseed, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", _CHILD], env=env, cwd=REPO, capture_output=True,
                         text=True, timeout=60, check=True).stdout
    return out.split()


def test_keys_are_identical_across_processes_with_different_hash_seeds():
    first, second = _keys_in_child("1"), _keys_in_child("2")
    here = [k.hex() for k in block_keys(NS, PROMPT) + block_keys(NS, PROMPT, lora="adapter-7",
                                                                      extras={3: b"img"})]
    here.append(NS.digest().hex())
    assert len(first) == 2 * 10 + 1
    assert first == second == here


def test_key_of_plain_blocks_follows_the_documented_formula():
    # key_0 = H(namespace_digest || tokens_0 as LE int32), key_i = H(key_{i-1} || tokens_i)
    keys = block_keys(NS, PROMPT[: 2 * BS])
    k0 = xxhash.xxh3_128_digest(NS.digest() + struct.pack(f"<{BS}i", *PROMPT[:BS]))
    k1 = xxhash.xxh3_128_digest(k0 + struct.pack(f"<{BS}i", *PROMPT[BS : 2 * BS]))
    assert keys == [k0, k1]


def test_token_sequence_type_does_not_change_keys():
    expected = block_keys(NS, PROMPT)
    assert block_keys(NS, tuple(PROMPT)) == expected
    assert block_keys(NS, np.asarray(PROMPT, dtype=np.int64)) == expected
    assert block_keys(NS, np.asarray(PROMPT, dtype=np.int32)) == expected


# -- what goes into a key -------------------------------------------------------------------

# one other valid value per Namespace field; a new field without an entry here fails the test
_OTHER_VALUE = {
    "model_id": "meta-llama/Llama-3.1-70B",
    "dtype": "float16",
    "num_layers": 33,
    "num_kv_heads": 4,
    "head_dim": 64,
    "block_size": 32,
    "revision": "def456",
    "layout": "KLTHD",
    "tp_rank": 1,
    "tp_size": 4,
    "cache_salt": "tenant-a",
    "hash_algo": "blake2b_128",
    "token_bytes": 8,
    "format_version": 2,
    "groups": (KVGroup("full", 32, (2, 8, 128), "bfloat16", 16), KVGroup("state", 4, (64,), "bfloat16", 16)),
}


def test_other_value_table_covers_every_namespace_field():
    assert set(_OTHER_VALUE) == {f.name for f in dataclasses.fields(Namespace)}


@pytest.mark.parametrize("field", sorted(_OTHER_VALUE))
def test_changing_any_namespace_field_changes_digest_and_every_key(field):
    other = dataclasses.replace(NS, **{field: _OTHER_VALUE[field]})
    assert other != NS
    assert other.digest() != NS.digest()
    mine, theirs = block_keys(NS, PROMPT), block_keys(other, PROMPT)
    assert theirs and not set(mine) & set(theirs)


def test_equal_namespaces_share_keys():
    twin = make_ns()
    assert twin == NS and twin is not NS
    assert twin.digest() == NS.digest()
    assert block_keys(twin, PROMPT) == block_keys(NS, PROMPT)


def test_cache_salt_separates_tenants():
    a, b = make_ns(cache_salt="tenant-a"), make_ns(cache_salt="tenant-b")
    assert not set(block_keys(a, PROMPT)) & set(block_keys(b, PROMPT))
    assert not set(block_keys(a, PROMPT)) & set(block_keys(NS, PROMPT))


def test_lora_changes_every_key_and_different_loras_differ():
    plain = block_keys(NS, PROMPT)
    l1, l2 = block_keys(NS, PROMPT, lora="adapter-1"), block_keys(NS, PROMPT, lora="adapter-2")
    assert len({*plain, *l1, *l2}) == 3 * len(plain)
    assert block_keys(NS, PROMPT, lora="adapter-1") == l1


def test_lora_and_extras_cannot_collide_by_concatenation():
    # regression: lora and extras were concatenated unframed, so lora "a" + extras b"b" on a block
    # hashed like lora "ab", and extras b"lora:x" like lora "x": two adapters shared a key
    toks = PROMPT[:BS]
    variants = [
        block_keys(NS, toks, lora="a", extras={0: b"b"}),
        block_keys(NS, toks, lora="ab"),
        block_keys(NS, toks, extras={0: b"lora:x"}),
        block_keys(NS, toks, lora="x"),
        block_keys(NS, toks, extras={0: b"ab"}),
        block_keys(NS, toks, lora=""),
        block_keys(NS, toks),
    ]
    assert len({v[0] for v in variants}) == len(variants)


def test_extras_on_a_block_change_that_key_and_the_ones_after_only():
    plain = block_keys(NS, PROMPT)
    with_image = block_keys(NS, PROMPT, extras={5: b"\x01" * 16})
    assert with_image[:5] == plain[:5]
    assert all(a != b for a, b in zip(with_image[5:], plain[5:], strict=True))
    other_image = block_keys(NS, PROMPT, extras={5: b"\x02" * 16})
    assert other_image[:5] == plain[:5] and other_image[5] != with_image[5]


def test_empty_extras_count_as_no_extras():
    assert block_keys(NS, PROMPT, extras={2: b""}) == block_keys(NS, PROMPT)
    assert block_keys(NS, PROMPT, extras={}) == block_keys(NS, PROMPT)


def test_extras_that_are_not_bytes_raise_token_error():
    with pytest.raises(TokenError):
        block_keys(NS, PROMPT, extras={0: "an image"})


def test_extras_beyond_the_full_blocks_are_ignored():
    assert block_keys(NS, PROMPT, extras={10: b"late"}) == block_keys(NS, PROMPT)


# -- blocks and chaining -----------------------------------------------------------------------

def test_partial_tail_block_gets_no_key():
    assert block_keys(NS, PROMPT[: BS - 1]) == []
    assert block_keys(NS, []) == []
    full = block_keys(NS, PROMPT[: 3 * BS])
    assert len(full) == 3
    assert block_keys(NS, PROMPT[: 3 * BS + BS - 1]) == full
    assert NS.num_full_blocks(3 * BS + BS - 1) == 3


def test_every_key_is_16_bytes_and_distinct():
    keys = block_keys(NS, [0] * (10 * BS))  # same tokens in every block: chaining still separates
    assert all(isinstance(k, bytes) and len(k) == KEY_BYTES == 16 for k in keys)
    assert len(set(keys)) == len(keys)


@pytest.mark.parametrize("block", [0, 4, 9])
def test_changing_a_token_in_block_i_changes_keys_from_i_on_only(block):
    plain = block_keys(NS, PROMPT)
    edited = list(PROMPT)
    edited[block * BS + 3] += 1
    keys = block_keys(NS, edited)
    assert keys[:block] == plain[:block]
    assert all(a != b for a, b in zip(keys[block:], plain[block:], strict=True))


def test_token_in_partial_tail_does_not_change_any_key():
    toks = PROMPT[: 3 * BS] + [1, 2, 3]
    edited = toks[:-1] + [4]
    assert block_keys(NS, edited) == block_keys(NS, toks)


@pytest.mark.parametrize("extras", [None, {3: b"img", 7: b"audio"}])
def test_keychain_update_token_by_token_equals_one_shot(extras):
    chain = KeyChain(NS, lora="adapter-1", extras=extras)
    for n in range(len(PROMPT) + 1):
        keys = chain.update(PROMPT[:n])
        assert len(keys) == n // BS
    assert chain.keys == block_keys(NS, PROMPT, lora="adapter-1", extras=extras)


def test_keychain_update_in_uneven_chunks_equals_one_shot():
    chain = KeyChain(NS)
    for n in (5, 16, 17, 47, 48, 100, 160):
        chain.update(PROMPT[:n])
    assert chain.keys == block_keys(NS, PROMPT)


@pytest.mark.parametrize("split", [1, 5, 9])
def test_parent_and_start_block_continuation_equals_one_shot(split):
    extras = {2: b"a", 6: b"b"}
    whole = block_keys(NS, PROMPT, lora=3, extras=extras)
    head = block_keys(NS, PROMPT[: split * BS], lora=3, extras=extras)
    tail = block_keys(NS, PROMPT[split * BS :], parent=head[-1], start_block=split, lora=3,
                      extras=extras)
    assert head + tail == whole


def test_parent_without_start_block_or_vice_versa_is_refused():
    key = block_keys(NS, PROMPT[:BS])[0]
    with pytest.raises(TokenError):
        block_keys(NS, PROMPT[BS:], parent=key)
    with pytest.raises(TokenError):
        block_keys(NS, PROMPT[BS:], start_block=1)


# -- hash algorithms and token widths ----------------------------------------------------------

def test_every_hash_algo_gives_16_byte_keys_that_differ_between_algos():
    per_algo = {}
    for algo in HASHES:
        keys = block_keys(make_ns(hash_algo=algo), PROMPT)
        assert len(keys) == 10 and all(len(k) == 16 for k in keys)
        per_algo[algo] = keys
    assert set(per_algo) == {"xxh3_128", "blake2b_128", "sha256_128"}
    all_keys = [k for keys in per_algo.values() for k in keys]
    assert len(set(all_keys)) == len(all_keys)


@pytest.mark.parametrize("token", [2**31, -(2**31) - 1, 2**40])
def test_token_ids_outside_int32_raise_token_error(token):
    toks = list(PROMPT[:BS])
    toks[7] = token
    with pytest.raises(TokenError):
        block_keys(NS, toks)


def test_int32_limits_are_valid_token_ids():
    toks = [2**31 - 1, -(2**31)] * (BS // 2)
    assert len(block_keys(NS, toks)) == 1


def test_token_bytes_8_accepts_large_token_ids():
    wide = make_ns(token_bytes=8)
    toks = list(PROMPT[:BS])
    toks[7] = 2**40
    keys = block_keys(wide, toks)
    assert len(keys) == 1 and len(keys[0]) == 16
    toks[7] = 2**40 + 1
    assert block_keys(wide, toks) != keys
    toks[7] = 2**63
    with pytest.raises(TokenError):
        block_keys(wide, toks)


def test_non_integer_token_ids_raise_token_error():
    with pytest.raises(TokenError):
        block_keys(NS, [1.5] * BS)
    with pytest.raises(TokenError):
        block_keys(NS, ["a"] * BS)


# -- namespace validation ----------------------------------------------------------------------

@pytest.mark.parametrize("changes, named", [
    ({"num_layers": 0}, "num_layers"),
    ({"num_kv_heads": -1}, "num_kv_heads"),
    ({"head_dim": 1.5}, "head_dim"),
    ({"block_size": 0}, "block_size"),
    ({"block_size": "16"}, "block_size"),
    ({"tp_size": 0}, "tp_size"),
    ({"tp_rank": 2, "tp_size": 2}, "tp_rank"),
    ({"tp_rank": -1}, "tp_rank"),
    ({"model_id": ""}, "model_id"),
    ({"hash_algo": "md5"}, "hash_algo"),
    ({"token_bytes": 2}, "token_bytes"),
])
def test_bad_namespace_values_raise_config_error_naming_the_field(changes, named):
    with pytest.raises(ConfigError, match=named):
        make_ns(**changes)


def test_namespace_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        NS.block_size = 32  # type: ignore[misc]


def test_describe_lists_every_field_and_groups_only_when_there_are_some():
    assert NS.describe() == {f.name: getattr(NS, f.name) for f in dataclasses.fields(Namespace) if f.name != "groups"}
    grouped = dataclasses.replace(NS, groups=_OTHER_VALUE["groups"])
    assert grouped.describe()["groups"][1] == {"kind": "state", "layers": 4, "shape": [64], "dtype": "bfloat16",
                                               "block_size": 16}
    assert Namespace.from_dict(grouped.describe()) == grouped
