"""A namespace's digest is over its KV groups' reprs. Groups that name no member layers (SGLang's,
TensorRT-LLM's, the reference engine's) keep the digest they had before ``members`` existed, so
their stored blocks and namespace records stay theirs; groups that name them (vLLM's) differ by
them."""

from dataclasses import replace

from tiered_kv.keys import Namespace
from tiered_kv.kv_groups import KVGroup

GROUPS = (KVGroup("mla", 4, (576,), "bfloat16", 16), KVGroup("sliding", 2, (2, 4, 64), "bfloat16", 16, window=32))


def namespace(groups=GROUPS) -> Namespace:
    return Namespace(model_id="m", dtype="bfloat16", num_layers=4, num_kv_heads=1, head_dim=8, block_size=16,
                     groups=groups)


def test_regression_groups_naming_no_members_changed_the_digest_of_every_grouped_namespace():
    # the digest this namespace had before KV groups could name their members (pinned)
    assert namespace().digest().hex() == "c067a956500db4ab86f1ce8fb85ea2c7"
    assert "members" not in repr(GROUPS[0])


def test_groups_naming_their_members_differ_by_them():
    named = tuple(replace(g, members=f"digest-{i}") for i, g in enumerate(GROUPS))
    other = tuple(replace(g, members=f"other-{i}") for i, g in enumerate(GROUPS))
    assert len({namespace().digest(), namespace(named).digest(), namespace(other).digest()}) == 3
    assert KVGroup.from_dict(named[0].describe()) == named[0]
