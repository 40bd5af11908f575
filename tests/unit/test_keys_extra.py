"""A request's key extra from its parts (tiered_kv.keys.key_extra): one text per set of parts."""

from __future__ import annotations

import itertools

import pytest

from tiered_kv.keys import Namespace, block_keys, key_extra

NS = Namespace(model_id="m", dtype="float16", num_layers=2, num_kv_heads=2, head_dim=4, block_size=4)
TOKENS = list(range(1, 9))


def test_regression_a_semicolon_inside_a_part_read_as_the_join_of_two_parts():
    """Joined bare, ``("a;b",)`` and ``("a", "b")`` were one text, so one set of keys."""
    one = key_extra([("lora", "a;salt=b")])
    two = key_extra([("lora", "a"), ("salt", "b")])
    assert one != two
    assert block_keys(NS, TOKENS, lora=one) != block_keys(NS, TOKENS, lora=two)


def test_tricky_values_never_share_a_text():
    values = ["", "a", "b", ";", "\\", "\\;", ";b", "a;", "a\\", "\\\\;", "a=b", "=", "a;b=c"]
    names = ["x", "y"]
    seen: dict[str, list] = {}
    for n in range(3):
        for parts in itertools.product(itertools.product(names, values), repeat=n):
            seen.setdefault(key_extra(parts) or "", []).append(parts)
    clashes = {text: parts for text, parts in seen.items() if len(parts) > 1}
    assert not clashes


def test_parts_without_escapes_keep_the_text_their_blocks_were_stored_under():
    assert key_extra([("cache_salt_id", 12), ("lora_task_id", 7), ("mm", "1-2@0+4")]) == \
        "cache_salt_id=12;lora_task_id=7;mm=1-2@0+4"
    assert key_extra([]) is None


@pytest.mark.parametrize("name", ["", "a=b", "a;b", "a\\b"])
def test_a_name_that_could_be_read_as_a_value_or_a_join_is_refused(name):
    with pytest.raises(ValueError, match="name"):
        key_extra([(name, "v")])
