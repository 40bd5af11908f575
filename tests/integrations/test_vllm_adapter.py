"""``TieredKVConnector`` driven the way vLLM 0.32 drives a KV connector, with stand-ins for the
engine (``vllm_engine``): runs without vllm installed (and against the real base class with it)."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest
import torch

from tests.integrations.vllm_engine import (
    BS,
    LAYERS,
    Engine,
    FullAttentionSpec,
    Request,
    kv_cache_config,
    vllm_config,
)
from tests.store.helpers import rewrite_stored_blocks
from tiered_kv.errors import ConfigError
from tiered_kv.integrations.vllm import KVConnectorRole, TieredKVConnector


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    for name in [n for n in os.environ if n.startswith("TIERED_KV_")]:
        monkeypatch.delenv(name)


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 1000) for _ in range(n)]


SHARED = prompt(22, 0)
PROMPTS = {"a": SHARED + prompt(9, 1), "b": SHARED + prompt(6, 2), "c": prompt(24, 3)}


class Halves:
    """Scheduler-role and worker-role connectors of one engine, as vLLM builds them."""

    def __init__(self, extra: dict) -> None:
        cfg, kvc = vllm_config(extra), kv_cache_config()
        self.worker = TieredKVConnector(cfg, KVConnectorRole.WORKER, kvc)  # the executor comes first
        self.sched = TieredKVConnector(cfg, KVConnectorRole.SCHEDULER, kvc)

    def close(self) -> None:
        self.worker.shutdown()
        self.sched.shutdown()


def extra(tmp_path, **more) -> dict:
    return {"disk": {"url": f"lmdb://{tmp_path}/db"}, "host": {"capacity": "256KiB"}, **more}


def run(extra_cfg: dict | None, prompts: dict, **engine_kw):
    """One engine: (outputs, engine)."""
    halves = Halves(extra_cfg) if extra_cfg is not None else None
    eng = Engine(halves.sched if halves else _Null(), halves.worker if halves else _Null(), **engine_kw)
    for rid, p in prompts.items():
        eng.add(rid, p)
    try:
        return eng.run(), eng
    finally:
        if halves:
            halves.close()


class _Null:
    def get_num_new_matched_tokens(self, request, n):
        return 0, False

    def request_finished(self, request, block_ids):
        return False, None

    def get_finished(self, ids):
        return None, None

    def get_block_ids_with_load_errors(self):
        return set()

    def __getattr__(self, name):
        return lambda *a, **k: None


@pytest.fixture(scope="module")
def reference():
    return run(None, PROMPTS)[0]


def cached_tokens(eng) -> dict[str, int]:
    return {rid: r.num_cached_tokens for rid, r in eng.requests.items()}


def test_second_engine_hits_every_full_block_but_the_last_tokens(tmp_path, reference):
    first, eng1 = run(extra(tmp_path), PROMPTS)
    assert first == reference and set(cached_tokens(eng1).values()) == {0}
    second, eng2 = run(extra(tmp_path), PROMPTS)
    assert second == reference
    assert cached_tokens(eng2) == {"a": 28, "b": 24, "c": 20}  # (n - 1) // 4 * 4
    assert eng2.computed == (31 - 28) + (28 - 24) + (24 - 20) + 3 * 2


def test_several_requests_per_step_share_blocks_saved_in_the_same_run(tmp_path, reference):
    outs, eng = run(extra(tmp_path), {"a": PROMPTS["a"]})
    outs, eng = run(extra(tmp_path), PROMPTS)  # b shares a's first 5 blocks; c is new
    assert outs == reference
    assert cached_tokens(eng) == {"a": 28, "b": 20, "c": 0}


def test_chunked_prefill_saves_each_chunk(tmp_path, reference):
    first, eng1 = run(extra(tmp_path), PROMPTS, budget=7)
    assert first == reference and eng1.steps > 8
    second, eng2 = run(extra(tmp_path), PROMPTS, budget=7)
    assert second == reference and cached_tokens(eng2) == {"a": 28, "b": 24, "c": 20}


def test_async_loads_finish_through_finished_recving(tmp_path, reference):
    run(extra(tmp_path), PROMPTS)
    outs, eng = run(extra(tmp_path, load_async=True), PROMPTS)
    assert outs == reference
    assert {rid: r.external for rid, r in eng.requests.items()} == {"a": 28, "b": 24, "c": 20}


def test_finished_sending_only_after_the_id_was_passed_in_and_blocks_held_until_then(tmp_path):
    halves = Halves(extra(tmp_path))
    try:
        eng = Engine(halves.sched, halves.worker)
        eng.add("a", PROMPTS["a"], max_tokens=1)
        eng.step()  # prefill + the one token: finished, held
        assert eng.held == {"a"} and eng.requests["a"].block_ids
        # the worker saw no finished id yet: nothing to report (the engine asserts the same)
        assert halves.worker.get_finished(set()) == (None, None)
        eng.step()  # finished_req_ids={"a"} reaches the worker: reported, blocks freed
        assert eng.held == set() and eng.requests["a"].block_ids == []
    finally:
        halves.close()


def test_preempted_request_is_resumed_with_its_saved_blocks(tmp_path, reference):
    halves = Halves(extra(tmp_path))
    try:
        eng = Engine(halves.sched, halves.worker)
        for rid, p in PROMPTS.items():
            eng.add(rid, p, max_tokens=3)
        eng.preempt_at = {3: "a"}  # after its prefill and a decode step
        outs = eng.run()
        assert outs == reference
        # resumed: matched anew from the store (its prompt blocks were saved before preemption)
        assert eng.requests["a"].external == 28
    finally:
        halves.close()


def _flip_byte(key: bytes, value: bytes) -> bytes:
    return value[:-5] + bytes([value[-5] ^ 0xFF]) + value[-4:]


@pytest.mark.parametrize("load_async", [False, True])
def test_load_errors_are_reported_and_recomputed(tmp_path, reference, load_async):
    run(extra(tmp_path), PROMPTS)
    assert rewrite_stored_blocks(tmp_path / "db", _flip_byte) > 0
    outs, eng = run(extra(tmp_path, load_async=load_async), PROMPTS)
    assert outs == reference  # every failed block was reported and recomputed
    outs, eng = run(extra(tmp_path), PROMPTS)  # and saved again
    assert outs == reference and cached_tokens(eng) == {"a": 28, "b": 24, "c": 20}


def test_keys_fold_in_lora_and_cache_salt(tmp_path):
    halves = Halves(extra(tmp_path))
    try:
        core = halves.sched._sched
        plain, salted = Request("p", PROMPTS["c"], 1), Request("s", PROMPTS["c"], 1)
        salted.cache_salt = "tenant-1"
        for r in (plain, salted):
            halves.sched.get_num_new_matched_tokens(r, 0)
        assert core.core.keys_of("p")[0] != core.core.keys_of("s")[0]
    finally:
        halves.close()


def test_regression_a_prompt_with_other_embeddings_was_promised_the_first_prompts_kv(tmp_path):
    """Mixed-mode prompts (vLLM 0.32 chat completions with ``prompt_embeds`` parts) carry token
    ids with placeholders where the model reads the embeddings; vLLM folds the embeddings into
    its block hashes, our keys took the ids alone: another request with the same ids and other
    embeddings was promised and loaded the first one's KV. Such prompts are not keyed now."""
    placeholder = 999
    tokens = prompt(2 * BS, seed=1) + [placeholder] * (3 * BS) + prompt(BS + 1, seed=2)

    def mixed(eng, rid):
        req = eng.add(rid, tokens, max_tokens=1)
        req.prompt_embeds = torch.randn(len(tokens), 8)  # (what the model reads at the placeholders)
        req.prompt_is_token_ids = [t != placeholder for t in tokens]
        return req

    halves = Halves(extra(tmp_path))
    try:
        eng = Engine(halves.sched, halves.worker)
        mixed(eng, "a")
        eng.run()
        halves.worker._worker.core.flush_copies()
        assert halves.sched.get_num_new_matched_tokens(mixed(Engine(halves.sched, halves.worker), "b"), 0) == (0, False)
        assert halves.sched.get_num_new_matched_tokens(Request("c", tokens, 1), 0)[0] == 0  # nothing was saved
    finally:
        halves.close()


def test_scheduler_alone_looks_up_the_disk_tier_without_a_host_slab(tmp_path):
    run(extra(tmp_path), PROMPTS)  # engine A wrote the LMDB store and is gone
    sched = TieredKVConnector(vllm_config(extra(tmp_path)), KVConnectorRole.SCHEDULER, kv_cache_config())
    try:
        req = Request("a", PROMPTS["a"], 1)
        assert sched.get_num_new_matched_tokens(req, 0) == (28, False)
        assert sched.get_num_new_matched_tokens(req, 0) == (28, False)  # side-effect free
        from tiered_kv.store.lower_index import LowerTierIndex

        assert isinstance(sched._sched.index, LowerTierIndex)
        sched.update_state_after_alloc(req, ([1, 2, 3, 4, 5, 6, 7, 8],), 28)
        meta = sched.build_connector_meta(
            type("SO", (), {"scheduled_new_reqs": [], "scheduled_cached_reqs":
                            type("C", (), {"req_ids": [], "resumed_req_ids": set()})(),
                            "num_scheduled_tokens": {}, "preempted_req_ids": set()})())
        [load] = meta.meta.loads
        assert load.block_ids == (1, 2, 3, 4, 5, 6, 7) and len(load.keys) == 7
    finally:
        sched.shutdown()


@pytest.mark.parametrize("bad, key", [
    ({"disk": {"urll": "lmdb:///tmp/x"}}, "disk.urll"),
    ({"disk": {"url": "nosuch:///tmp/x"}}, "disk.url"),
    ({"worker": 2}, "worker"),
    ({"load_async": "maybe"}, "load_async"),
    ({"config_file": "/nonexistent/tiered-kv.toml"}, "config file"),
])
def test_misconfiguration_fails_at_construction_naming_the_key(bad, key):
    with pytest.raises(ConfigError, match=key) as err:
        TieredKVConnector(vllm_config(bad), KVConnectorRole.SCHEDULER, kv_cache_config())
    assert "\n" not in str(err.value)
    assert str(err.value).startswith("kv_connector_extra_config")


def test_config_file_plus_overrides(tmp_path):
    (tmp_path / "tkv.toml").write_text(f'[disk]\nurl = "lmdb://{tmp_path}/db"\ncapacity = "64MiB"\n')
    from tiered_kv.integrations.common import parse_settings

    settings = parse_settings({"config_file": str(tmp_path / "tkv.toml"), "disk": {"capacity": "32MiB"},
                               "load_async": True}, source="x")
    assert settings.config.disk.url == f"lmdb://{tmp_path}/db"
    assert settings.config.disk.capacity == 32 << 20 and settings.load_async


def test_regression_a_url_given_beside_a_config_file_was_refused_for_a_setting_nobody_wrote(tmp_path):
    # the file's section came back with every medium setting its URL decided as if written:
    # a new URL saying ?sync=true stopped the engine ("disk.sync ... set it in one place"), and
    # one that did not say it kept the old URL's ?sync=true
    from tiered_kv.integrations.common import parse_settings

    (tmp_path / "tkv.toml").write_text(f'[disk]\nurl = "lmdb://{tmp_path}/a?sync=true"\n')
    moved = parse_settings({"config_file": str(tmp_path / "tkv.toml"),
                            "disk": {"url": f"lmdb://{tmp_path}/b?capacity=64MiB"}}, source="x")
    assert moved.config.disk.sync is False and moved.config.disk.capacity == 64 << 20
    synced = parse_settings({"config_file": str(tmp_path / "tkv.toml")}, source="x",
                            environ={"TIERED_KV_DISK_URL": f"lmdb://{tmp_path}/c?sync=true"})
    assert synced.config.disk.sync is True and synced.config.disk.url.endswith("/c?sync=true")


def test_extra_config_that_is_no_table_is_refused_without_quoting_it():
    from tiered_kv.integrations.common import parse_settings

    with pytest.raises(ConfigError) as err:
        parse_settings("redis://user:hunter2@cache:6379", source="x")  # type: ignore[arg-type]
    assert "hunter2" not in str(err.value)


@pytest.mark.parametrize("spec, kind", [
    (FullAttentionSpec(sliding_window=128), "sliding"),
    (type("MLAAttentionSpec", (FullAttentionSpec,), {})(num_kv_heads=1, head_size=576), "mla"),
])
def test_sliding_window_and_mla_specs_get_a_namespace_naming_their_group(spec, kind, tmp_path):
    worker = TieredKVConnector(vllm_config(extra(tmp_path)), KVConnectorRole.WORKER, kv_cache_config(spec))
    try:
        (group,) = worker.namespace.groups
        assert group.kind == kind and group.num_layers == LAYERS
        assert worker.namespace.tp_size == 1  # MLA latents are the same on every rank; sliding: TP 1 here
    finally:
        worker.shutdown()


@pytest.mark.parametrize("spec, match", [
    (type("CrossAttentionSpec", (FullAttentionSpec,), {})(), "unsupported KV cache spec CrossAttentionSpec"),
    (type("MambaSpec", (), {"block_size": 1024, "mamba_cache_mode": "align", "shapes": ((4, 3),),
                            "dtypes": (torch.float32,), "page_size_bytes": 48})(), "mamba_cache_mode='align'"),
])
def test_specs_one_stored_block_cannot_follow_are_refused_naming_the_reason(spec, match, tmp_path):
    with pytest.raises(ConfigError, match=match):
        TieredKVConnector(vllm_config(extra(tmp_path)), KVConnectorRole.WORKER, kv_cache_config(spec))


@pytest.mark.parametrize("role", [KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER])
def test_regression_a_prefix_lm_model_was_served_blocks_computed_over_another_prompts_later_tokens(
        tmp_path, role):
    # vLLM's PrefillPrefixLMAttention: FullAttentionSpec(non_causal=True). A prefill attends both
    # ways, so block 0's KV depends on the whole prompt; the connector used to store it under
    # block 0's tokens and serve it to any prompt starting with them (vLLM's own prefix cache is
    # turned off for such models)
    spec = FullAttentionSpec()
    spec.non_causal = True
    with pytest.raises(ConfigError, match="non-causal"):
        TieredKVConnector(vllm_config(extra(tmp_path)), role, kv_cache_config(spec))


def test_an_unknown_kv_layout_is_refused_when_caches_are_registered(tmp_path):
    worker = TieredKVConnector(vllm_config(extra(tmp_path)), KVConnectorRole.WORKER, kv_cache_config())
    try:
        caches = {f"l{i}": torch.zeros(16, BS, 2, 2, 4) for i in range(2)}  # [blocks, bs, 2, H, D]
        with pytest.raises(ConfigError, match="unsupported per-layer KV tensors"):
            worker.register_kv_caches(caches)
    finally:
        worker.shutdown()


@pytest.mark.parametrize("device, layerwise", [("cpu", False), ("cuda", True)])
def test_auto_layerwise_loads_follow_vllms_device(tmp_path, device, layerwise):
    config = extra(tmp_path, host={"capacity": "4MiB"}, layer_groups=2)
    sched = TieredKVConnector(vllm_config(config, device=device), KVConnectorRole.SCHEDULER, kv_cache_config())
    assert sched._sched._core().restore.layerwise is layerwise  # what the scheduler predicts
    sched.shutdown()
    # a CUDA graph replay would skip the waits between layers: piecewise graphs when layer-wise
    assert TieredKVConnector.requires_piecewise_for_cudagraph(config) is True  # ("auto": vLLM on a GPU)
    assert TieredKVConnector.requires_piecewise_for_cudagraph({**config, "layerwise_loads": False}) is False


def test_importing_tiered_kv_needs_no_engine():
    code = ("import sys, tiered_kv, tiered_kv.integrations, tiered_kv.integrations.common, "
            "tiered_kv.integrations.trtllm; assert 'vllm' not in sys.modules; "
            "assert 'tensorrt_llm' not in sys.modules or True")
    subprocess.run([sys.executable, "-c", code], check=True)
