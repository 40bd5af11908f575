"""What else names an SGLang server's pages (review ns2): a speculative draft whose layers SGLang
0.5.23 packs into the target's host pages (MTP: ``HiCacheDraftMode.PACKED``), a KV dtype other
than the activations', a decrypted config file by its content and a host pool's own page format;
and what must not: the served name, memory fractions, the DP rank, a restart. A server that sets
none of them keeps the namespace it had."""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest

from tests.integrations.sglang_standins import MHAPool, ServerArgs, StorageConfig
from tests.integrations.test_sglang_adapter import pages_of, sglang_keys
from tests.integrations.test_sglang_identity import namespace_of, plain_namespace, server
from tiered_kv.integrations.numerics import numerics_suffix
from tiered_kv.integrations.sglang_pages import geometry_of, page_namespace

DRAFT_LAYERS = 4  # 3 target layers + 1 packed MTP draft layer per page


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    for name in [n for n in os.environ if n.startswith("TIERED_KV_")]:
        monkeypatch.delenv(name)


@dataclass
class SpecServerArgs(ServerArgs):
    """SGLang 0.5.23's ServerArgs with its speculative, memory and decrypted-config fields (at
    their defaults)."""

    speculative_algorithm: str | None = None
    speculative_draft_model_path: str | None = None
    speculative_draft_model_revision: str | None = None
    speculative_draft_model_quantization: str | None = None
    speculative_draft_kv_cache_dtype: str | None = None
    speculative_draft_load_format: str | None = None
    decrypted_config_file: str | None = None
    decrypted_draft_config_file: str | None = None
    served_model_name: str | None = None
    mem_fraction_static: float | None = None
    hicache_ratio: float = 2.0
    dp_size: int = 1
    enable_dp_attention: bool = False


def packed_pool(seed: int = 0) -> MHAPool:
    return MHAPool("page_first", layer_num=DRAFT_LAYERS, seed=seed)


def mtp(draft: str, **more) -> SpecServerArgs:
    return SpecServerArgs(speculative_algorithm="NEXTN", speculative_draft_model_path=draft, **more)


def test_regression_servers_with_other_mtp_drafts_packed_into_their_pages_shared_one_namespace(tmp_path):
    # two servers of one target with the draft's layers packed into each host page: draft A's
    # pages were served to the server running draft B (same geometry, other draft weights)
    keys, pool = sglang_keys(3), packed_pool(seed=1)
    first = server(tmp_path, mtp("org/mtp-a"), pool=pool)
    assert first.batch_set(keys, pages_of(pool, 0, 3)) is True
    first.close()
    other = server(tmp_path, mtp("org/mtp-b"), pool=packed_pool(seed=2))
    try:
        assert other.batch_exists(keys) == 0
    finally:
        other.close()
    again = server(tmp_path, mtp("org/mtp-a"), pool=packed_pool(seed=3))
    try:
        assert again.batch_exists(keys) == 3  # a restart of the first server finds its pages
    finally:
        again.close()


@pytest.mark.parametrize("setting", [
    {"speculative_draft_model_revision": "refs/pr/3"},
    {"speculative_draft_model_quantization": "fp8"},
    {"speculative_draft_kv_cache_dtype": "fp8_e4m3"},
    {"speculative_draft_load_format": "dummy"},
])
def test_regression_a_drafts_revision_quantization_kv_dtype_or_random_weights_kept_the_namespace(tmp_path, setting):
    pool = packed_pool()
    assert namespace_of(tmp_path, mtp("org/mtp-a", **setting), pool=pool).digest() != \
        namespace_of(tmp_path, mtp("org/mtp-a"), pool=pool).digest()


def test_regression_a_local_draft_checkpoint_replaced_in_place_kept_the_namespace(tmp_path):
    draft = tmp_path / "drafts" / "mtp"
    draft.mkdir(parents=True)
    (draft / "config.json").write_text('{"num_nextn_predict_layers": 1}')
    (draft / "model.safetensors").write_bytes(b"draft weights 1")
    before = namespace_of(tmp_path, mtp(str(draft)), pool=packed_pool())
    (draft / "model.safetensors").write_bytes(b"draft weights two")  # a fine-tune written over it
    assert namespace_of(tmp_path, mtp(str(draft)), pool=packed_pool()).digest() != before.digest()


def test_a_server_without_a_draft_model_keeps_its_namespace(tmp_path):
    assert namespace_of(tmp_path, SpecServerArgs()) == plain_namespace()
    assert namespace_of(tmp_path, SpecServerArgs(speculative_algorithm="NGRAM")) == plain_namespace()


@pytest.mark.parametrize("activations", ["float16", "float32", "auto"])
def test_regression_a_bf16_kv_cache_under_other_activations_shared_the_bf16_servers_namespace(tmp_path, activations):
    # --dtype float16 --kv-cache-dtype bf16 rounds fp16 K/V into the same bf16 pool a bf16
    # server fills with its own K/V: one namespace served each the other's bytes
    bf16 = namespace_of(tmp_path, ServerArgs(dtype="bfloat16", kv_cache_dtype="bf16"))
    assert namespace_of(tmp_path, ServerArgs(dtype=activations, kv_cache_dtype="bf16")).digest() != bf16.digest()


def test_a_kv_cache_dtype_that_is_the_activations_keeps_the_namespace_it_had(tmp_path):
    pool = MHAPool("page_first")
    before = page_namespace(geometry_of(pool, mla=False), StorageConfig(),
                            revision=numerics_suffix({"kv_cache_dtype": "bfloat16"}))
    assert namespace_of(tmp_path, ServerArgs(dtype="bfloat16", kv_cache_dtype="bfloat16")) == before


def test_regression_a_decrypted_config_file_edited_in_place_kept_the_namespace(tmp_path):
    config = tmp_path / "decrypted" / "config.json"
    config.parent.mkdir()
    config.write_text('{"rope_theta": 10000}')
    before = namespace_of(tmp_path, SpecServerArgs(decrypted_config_file=str(config)))
    assert before.digest() != plain_namespace().digest()
    config.write_text('{"rope_theta": 500000}')  # RoPE rotates K before it is cached
    assert namespace_of(tmp_path, SpecServerArgs(decrypted_config_file=str(config))).digest() != before.digest()


class EnvelopePool(MHAPool):
    """A host pool with a page format of its own (SGLang tags its storage model name with it)."""

    storage_format_tag = "unified-token-major"


def test_regression_a_pool_with_its_own_page_format_shared_the_plain_pools_namespace(tmp_path):
    tagged = namespace_of(tmp_path, ServerArgs(), pool=EnvelopePool("page_first"))
    assert tagged.digest() != plain_namespace().digest()
    assert "format=unified-token-major" in tagged.layout


def test_what_does_not_change_the_kv_leaves_the_namespace_alone(tmp_path):
    # the served name is a label; memory sizes, the DP replica count and a restart change no byte
    plain = namespace_of(tmp_path, SpecServerArgs())
    assert plain == plain_namespace()
    assert namespace_of(tmp_path, SpecServerArgs(served_model_name="chat"), served_name="chat") == plain
    sized = SpecServerArgs(mem_fraction_static=0.6, hicache_ratio=4.0, dp_size=4, enable_dp_attention=True)
    assert namespace_of(tmp_path, sized) == plain
    pool = MHAPool("page_first")
    replicas = [StorageConfig(), StorageConfig()]
    replicas[1].dp_rank = 3  # DP attention: the storage config names the attention TP rank, not the replica
    spaces = [page_namespace(geometry_of(pool, mla=False), c, revision="") for c in replicas]
    assert spaces[0] == spaces[1]
    assert namespace_of(tmp_path, SpecServerArgs()) == plain  # a restart
