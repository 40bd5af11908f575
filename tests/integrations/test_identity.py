"""A persistent store never serves KV of other weights: weight files replaced in place, a LoRA
adapter reused under the same name and id with other files, and fp8 KV caches (their format and
their scales) all change what blocks are keyed by, or stop start-up.

Engines are the stand-ins of ``vllm_engine`` / ``trtllm_executor``; weight files are real files
under ``tmp_path`` whose contents and mtimes the tests change.
"""

from __future__ import annotations

import logging
import os
from types import SimpleNamespace

import pytest
import torch

from tests.integrations.trtllm_executor import KvCacheConfig, LlmArgs, write_model_config
from tests.integrations.vllm_engine import BS, Engine, FullAttentionSpec, kv_cache_config, vllm_config
from tiered_kv.connector.layout import make_layout
from tiered_kv.engine.weights import file_revision
from tiered_kv.errors import ConfigError
from tiered_kv.fingerprint import LORA_RECHECK_S, PathFingerprints
from tiered_kv.integrations.common import parse_settings
from tiered_kv.integrations.trtllm import _view, trtllm_namespace
from tiered_kv.integrations.vllm import KVConnectorRole, TieredKVConnector, vllm_namespace
from tiered_kv.integrations.vllm_scheduler import _key_extra
from tiered_kv.keys import Namespace


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    for name in [n for n in os.environ if n.startswith("TIERED_KV_")]:
        monkeypatch.delenv(name)


def write_weights(directory, files: dict[str, bytes]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (directory / name).write_bytes(data)


def rewrite_same_size(path, *, later_s: float = 10.0) -> None:
    """Other bytes of the same length, written later (a fine-tune copied over the old file)."""
    data = bytes(b ^ 0xFF for b in path.read_bytes())
    path.write_bytes(data)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + int(later_s * 1e9)))


def local_model(tmp_path):
    model = tmp_path / "model"
    write_model_config(model)
    write_weights(model, {"model-00001-of-00002.safetensors": b"A" * 64, "model-00002-of-00002.safetensors": b"B" * 64,
                          "model.safetensors.index.json": b'{"weight_map": {}}'})
    return model


def vllm_ns(model, *, revision: str = "", **cache) -> Namespace:
    cfg = vllm_config({}, model=str(model))
    cfg.load_config = SimpleNamespace(load_format="safetensors")
    if cache:
        cfg.cache_config = SimpleNamespace(block_size=BS, **cache)
    spec = FullAttentionSpec(dtype=torch.uint8) if "cache_dtype" in cache else FullAttentionSpec()
    settings = parse_settings({"model_revision": revision} if revision else {}, source="x")
    return vllm_namespace(cfg, kv_cache_config(spec), settings.config)


@pytest.mark.parametrize("replaced", ["model-00002-of-00002.safetensors", "model.safetensors.index.json",
                                      "config.json"])
def test_replacing_a_local_models_weights_in_place_changes_the_vllm_namespace(tmp_path, replaced):
    model = local_model(tmp_path)
    before = vllm_ns(model)
    assert vllm_ns(model) == before  # the same files: the same namespace, process after process
    rewrite_same_size(model / replaced)
    assert vllm_ns(model).digest() != before.digest()


@pytest.mark.parametrize("name", ["params.json", "preprocessor_config.json"])
def test_regression_a_mistral_params_or_a_media_processor_config_edited_in_place_kept_its_namespace(tmp_path, name):
    # a Mistral-format checkpoint's RoPE theta and window live in params.json, which vLLM reads
    # instead of config.json; a processor's image size changes the embeddings image tokens attend to
    model = local_model(tmp_path)
    (model / name).write_text('{"rope_theta": 1000000.0}')
    before = vllm_ns(model)
    (model / name).write_text('{"rope_theta": 100000000.0}')
    assert vllm_ns(model).digest() != before.digest()


def test_regression_a_models_own_code_edited_in_place_kept_its_namespace(tmp_path):
    # trust_remote_code runs the model directory's modeling_*.py: a fix to its RoPE changes every
    # K, but only weight and JSON files were fingerprinted, so the old KV was served
    model = local_model(tmp_path)
    code = model / "modeling_custom.py"
    code.write_text("def rope(x):\n    return x * 1.0\n")
    before = vllm_ns(model)
    code.write_text("def rope(x):\n    return x * 2.0\n")
    assert vllm_ns(model).digest() != before.digest()


def test_regression_a_gguf_checkpoint_replaced_in_place_kept_its_namespace(tmp_path):
    # only directories were fingerprinted: a model given as one GGUF file was named by its path
    # alone, so a new file written over it was served the old weights' KV (and the same file at
    # another path on a replica shared nothing)
    gguf = tmp_path / "a" / "llama-3-8b.Q4_K_M.gguf"
    write_weights(gguf.parent, {gguf.name: b"G" * 64})
    before = vllm_ns(gguf)
    assert before.model_id == gguf.name and before.revision.startswith("files-")
    rewrite_same_size(gguf)
    assert vllm_ns(gguf).digest() != before.digest()
    copy = tmp_path / "b" / gguf.name
    write_weights(copy.parent, {gguf.name: gguf.read_bytes()})
    os.utime(copy, ns=(gguf.stat().st_atime_ns, gguf.stat().st_mtime_ns))
    assert vllm_ns(copy) == vllm_ns(gguf)


def test_rewriting_an_unchanged_config_json_keeps_the_namespace(tmp_path):
    # examples/vllm_offline.py (and many launchers) write config.json again on every start: a
    # new mtime over the same bytes must not turn every restart into a cold store
    model = local_model(tmp_path)
    before = vllm_ns(model)
    config = model / "config.json"
    data = config.read_bytes()
    config.write_bytes(data)
    st = config.stat()
    os.utime(config, ns=(st.st_atime_ns, st.st_mtime_ns + 10**10))
    assert vllm_ns(model) == before


def test_an_explicit_model_revision_names_the_weights_itself(tmp_path):
    model = local_model(tmp_path)
    before = vllm_ns(model, revision="v7")
    rewrite_same_size(model / "model-00001-of-00002.safetensors")
    assert vllm_ns(model, revision="v7") == before and before.revision == "v7"


def test_replicas_with_copies_of_one_model_at_other_paths_share_a_namespace(tmp_path):
    # two replicas of vLLM sharing a Redis found nothing of each other: the namespace named the
    # model by its local path (/tmp/.../a/model against /tmp/.../b/model)
    import shutil

    model = local_model(tmp_path / "a")
    copy = tmp_path / "b" / "model"
    shutil.copytree(model, copy)  # copy2: names, sizes and mtimes kept
    assert vllm_ns(copy) == vllm_ns(model) and vllm_ns(model).model_id == "model"
    rewrite_same_size(copy / "model-00001-of-00002.safetensors")  # other weights, same directory name
    assert vllm_ns(copy).digest() != vllm_ns(model).digest()


def hub_download(cache, repo: str, commit: str, *, ref: str = "main") -> None:
    """What a download of ``repo`` at ``ref`` leaves in a Hugging Face cache: the ref names the
    commit, whose snapshot holds the files."""
    root = cache / ("models--" + repo.replace("/", "--"))
    (root / "snapshots" / commit).mkdir(parents=True, exist_ok=True)
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / ref).write_text(commit)


def hub_vllm_ns(repo: str, *, revision: str | None = None, download_dir=None) -> Namespace:
    cfg = vllm_config({}, model=repo)
    cfg.model_config = SimpleNamespace(model=repo, revision=revision)
    cfg.load_config = SimpleNamespace(load_format="safetensors", download_dir=download_dir)
    return vllm_namespace(cfg, kv_cache_config(), parse_settings({}, source="x").config)


def test_regression_replicas_that_downloaded_main_before_and_after_an_update_shared_kv(tmp_path, monkeypatch):
    # a hub model served without --revision was named by its id alone: a replica that downloaded
    # main after the weights were updated was served the KV of the old weights by the others
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "old"))
    hub_download(tmp_path / "old", "org/model", "a" * 40)
    hub_download(tmp_path / "new", "org/model", "b" * 40)
    before = hub_vllm_ns("org/model")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "new"))
    after = hub_vllm_ns("org/model")
    assert before.revision == "a" * 40 and after.digest() != before.digest()


def test_main_no_revision_and_the_commit_itself_name_the_same_hub_weights(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    hub_download(tmp_path / "hub", "org/model", "c" * 40)
    hub_download(tmp_path / "hub", "org/model", "c" * 40, ref="v1.0")
    names = {hub_vllm_ns("org/model", revision=r) for r in (None, "main", "v1.0", "c" * 40)}
    assert len(names) == 1


def test_a_hub_model_is_resolved_in_the_engines_download_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    hub_download(tmp_path / "hub", "org/model", "a" * 40)
    hub_download(tmp_path / "weights", "org/model", "d" * 40)
    assert hub_vllm_ns("org/model", download_dir=str(tmp_path / "weights")).revision == "d" * 40


def test_regression_a_cache_path_naming_a_variable_was_not_where_huggingface_hub_downloads(tmp_path, monkeypatch):
    # huggingface_hub expands $VARS in HF_HOME and HF_HUB_CACHE (a service manager passes them
    # unexpanded); the literal path held nothing, so the hub model was named by its id alone again
    monkeypatch.setenv("TKV_HF_ROOT", str(tmp_path))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", "$TKV_HF_ROOT/hf")
    hub_download(tmp_path / "hf" / "hub", "org/model", "e" * 40)
    assert hub_vllm_ns("org/model").revision == "e" * 40
    monkeypatch.setenv("HF_HUB_CACHE", "${TKV_HF_ROOT}/hub")
    hub_download(tmp_path / "hub", "org/model", "f" * 40)
    assert hub_vllm_ns("org/model").revision == "f" * 40


def test_a_hub_model_not_in_the_cache_keeps_its_revision_as_given(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    with caplog.at_level(logging.INFO, logger="tiered_kv.fingerprint"):
        assert hub_vllm_ns("org/model").revision == ""
    assert "model_revision" in caplog.text  # says how to name the weights
    assert hub_vllm_ns("org/model", revision="v2").revision == "v2"


def vllm_ns_with(model, *, cache_dtype: str = "", **model_config) -> Namespace:
    """The namespace of a vLLM engine on ``model`` whose model_config also sets ``model_config``."""
    cfg = vllm_config({}, model=str(model))
    cfg.load_config = SimpleNamespace(load_format="safetensors")
    cfg.model_config = SimpleNamespace(model=str(model), revision=None, **model_config)
    spec = FullAttentionSpec()
    if cache_dtype:
        cfg.cache_config = SimpleNamespace(block_size=BS, cache_dtype=cache_dtype)
        spec = FullAttentionSpec(dtype=torch.uint8)
    return vllm_namespace(cfg, kv_cache_config(spec), parse_settings({}, source="x").config)


def yarn(config):  # a callable hf_overrides, as vLLM allows
    return config


@pytest.mark.parametrize("setting", [
    {"quantization": "fp8"},  # a bf16 checkpoint's weights quantized as they load
    {"quantization_config": {"activation_scheme": "dynamic"}},
    {"hf_overrides": {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}},  # RoPE is applied to K
    {"hf_overrides": yarn},
    {"hf_config_path": "/configs/long-context"},
    {"model_weights": "/weights/fine-tuned"},
])
def test_regression_online_quantization_or_config_overrides_served_the_plain_models_kv(tmp_path, setting):
    # two vLLM engines on one checkpoint, one with --quantization fp8 (or a RoPE override), got
    # one namespace and read each other's blocks: their K/V differ for the same tokens
    model = local_model(tmp_path)
    plain = vllm_ns_with(model, quantization=None, hf_overrides={})
    assert vllm_ns_with(model, **setting).digest() != plain.digest()
    assert vllm_ns_with(model, **setting) == vllm_ns_with(model, **setting)  # and stable
    assert plain.revision == vllm_ns(model).revision  # nothing set: the namespace is as before


def test_under_an_fp8_kv_cache_the_activation_dtype_names_the_blocks(tmp_path):
    model = local_model(tmp_path)
    bf16 = vllm_ns_with(model, cache_dtype="fp8_e4m3", dtype="bfloat16")
    assert bf16.digest() != vllm_ns_with(model, cache_dtype="fp8_e4m3", dtype="float16").digest()
    assert vllm_ns_with(model, dtype="bfloat16") == vllm_ns_with(model, dtype="float16") == vllm_ns_with(model)


def test_a_second_engine_on_replaced_weights_gets_no_blocks_of_the_old_ones(tmp_path):
    model = local_model(tmp_path)
    extra = {"disk": {"url": f"lmdb://{tmp_path}/db"}, "host": {"capacity": "256KiB"}}
    prompt = list(range(1, 30))

    def cached_tokens() -> int:
        cfg, kvc = vllm_config(extra, model=str(model)), kv_cache_config()
        worker = TieredKVConnector(cfg, KVConnectorRole.WORKER, kvc)
        sched = TieredKVConnector(cfg, KVConnectorRole.SCHEDULER, kvc)
        try:
            eng = Engine(sched, worker)
            eng.add("a", prompt)
            eng.run()
            return eng.requests["a"].num_cached_tokens
        finally:
            worker.shutdown()
            sched.shutdown()

    assert cached_tokens() == 0
    assert cached_tokens() == 28  # same weights: every full block but the last token's
    rewrite_same_size(model / "model-00001-of-00002.safetensors")
    assert cached_tokens() == 0  # other weights: nothing of the old store is served


def test_replacing_a_local_models_weights_in_place_changes_the_trtllm_namespace(tmp_path):
    model = local_model(tmp_path)
    args = LlmArgs(model=str(model), kv_cache_config=KvCacheConfig())
    config = parse_settings(None, source="x").config
    before = trtllm_namespace(args, config)
    assert trtllm_namespace(args, config) == before
    rewrite_same_size(model / "model-00002-of-00002.safetensors")
    assert trtllm_namespace(args, config).digest() != before.digest()


def test_the_reference_engines_revision_follows_weight_contents(tmp_path):
    model = tmp_path / "ref"
    write_weights(model, {"config.json": b"{}", "model.safetensors": b"W" * 128})
    before = file_revision(model)
    st = (model / "model.safetensors").stat()
    rewrite_same_size(model / "model.safetensors", later_s=0)
    os.utime(model / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns))  # even with the old mtime
    assert file_revision(model) != before


def lora_request(path, name: str = "support-bot", lora_id: int = 1):
    return SimpleNamespace(lora_request=SimpleNamespace(lora_name=name, lora_int_id=lora_id, lora_path=str(path)),
                           cache_salt=None, mm_features=None)


def lora_adapter(tmp_path):
    adapter = tmp_path / "adapter"
    write_weights(adapter, {"adapter_config.json": b'{"r": 8}', "adapter_model.safetensors": b"L" * 256})
    return adapter


class StoppedClock:
    """A clock that moves only when the test moves it."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def lora_clock(monkeypatch) -> StoppedClock:
    """The scheduler halves' LoRA fingerprints (vLLM's and TensorRT-LLM's) re-stat an adapter's
    files on this clock: a test moves it past ``LORA_RECHECK_S`` instead of sleeping."""
    from tiered_kv.integrations import trtllm_requests, vllm_scheduler

    clock = StoppedClock()
    fingerprints = PathFingerprints(clock=clock)
    monkeypatch.setattr(vllm_scheduler, "LORA_FINGERPRINTS", fingerprints)
    monkeypatch.setattr(trtllm_requests, "LORA_FINGERPRINTS", fingerprints)
    return clock


def test_a_lora_adapter_replaced_under_the_same_name_and_id_gets_other_keys(tmp_path, lora_clock):
    adapter = lora_adapter(tmp_path)
    before = _key_extra(lora_request(adapter))
    assert before.startswith("lora=support-bot:1:files-")
    lora_clock.now += LORA_RECHECK_S
    assert _key_extra(lora_request(adapter)) == before  # untouched files: the same keys
    rewrite_same_size(adapter / "adapter_model.safetensors")
    lora_clock.now += LORA_RECHECK_S / 2
    assert _key_extra(lora_request(adapter)) == before  # within the recheck interval: the cached files
    lora_clock.now += LORA_RECHECK_S / 2
    after = _key_extra(lora_request(adapter))
    assert after != before and after.startswith("lora=support-bot:1:files-")


def test_lora_lookups_do_not_stat_the_adapter_every_time(tmp_path, lora_clock):
    adapter = lora_adapter(tmp_path)
    first = _key_extra(lora_request(adapter))
    assert ":files-" in first
    for f in adapter.iterdir():
        f.unlink()
    adapter.rmdir()
    assert _key_extra(lora_request(adapter)) == first  # served from the cache, no filesystem call


def test_trtllm_lora_adapter_rewritten_under_its_task_id_is_refused_while_the_engine_keeps_the_first(
        tmp_path, lora_clock):
    """TensorRT-LLM computes a task id with the weights it first loaded for the life of the
    process: files rewritten in place name weights it never loads, so their requests are refused;
    requests by the bare task id keep the first files' keys."""
    adapter = lora_adapter(tmp_path)

    def request(rid: int, path):
        return SimpleNamespace(request_id=rid, prompt_len=4, get_tokens=lambda beam: [1, 2, 3, 4],
                               lora_task_id=77, py_lora_path=path)

    loading = _view(request(1, str(adapter))).key_extra
    assert "lora_task_id=77" in loading and "lora_files=files-" in loading
    assert _view(request(2, None)).key_extra == loading  # later requests reuse the loaded adapter
    rewrite_same_size(adapter / "adapter_model.safetensors")
    lora_clock.now += LORA_RECHECK_S
    assert _view(request(3, str(adapter))) is None
    assert _view(request(4, None)).key_extra == loading


def test_fp8_kv_namespaces_name_the_fp8_format_not_the_uint8_container(tmp_path):
    model = local_model(tmp_path)
    e4m3 = vllm_ns(model, cache_dtype="fp8_e4m3", calculate_kv_scales=False)
    e5m2 = vllm_ns(model, cache_dtype="fp8_e5m2", calculate_kv_scales=False)
    assert (e4m3.dtype, e5m2.dtype) == ("float8_e4m3fn", "float8_e5m2")
    assert vllm_ns(model, cache_dtype="fp8", calculate_kv_scales=False).dtype == "float8_e4m3fn"


def test_fp8_kv_with_scales_computed_at_run_time_is_refused_at_start_up(tmp_path, caplog):
    cfg = vllm_config({}, model=str(local_model(tmp_path)))
    cfg.cache_config = SimpleNamespace(block_size=BS, cache_dtype="fp8", calculate_kv_scales=True)
    with caplog.at_level(logging.ERROR), pytest.raises(ConfigError, match="calculate_kv_scales") as err:
        TieredKVConnector(cfg, KVConnectorRole.SCHEDULER, kv_cache_config(FullAttentionSpec(dtype=torch.uint8)))
    assert "\n" not in str(err.value)
    assert [r.getMessage() for r in caplog.records] == [f"tiered-kv: {err.value}"]


def test_fp8_kv_held_in_uint8_tensors_round_trips_bit_exact():
    ns = Namespace(model_id="m", dtype="float8_e4m3fn", num_layers=2, num_kv_heads=2, head_dim=4, block_size=4)
    caches = {f"l{i}": torch.zeros(8, 2, 4, 2, 4, dtype=torch.uint8) for i in range(2)}  # vLLM's fp8 caches
    layout = make_layout(ns, caches)
    blocks = torch.randint(0, 255, (3, 2, 2, 4, 2, 4), dtype=torch.uint8)
    blocks[blocks == 0x7F] = 0  # no NaN patterns: compare bits, not values
    ids = torch.tensor([5, 1, 6])
    layout.scatter(ids, blocks.view(torch.float8_e4m3fn))  # what a load hands over: namespace dtype
    assert torch.equal(caches["l1"][5], blocks[0, 1])  # the same bytes, not converted values
    assert torch.equal(layout.gather(ids).view(torch.uint8), blocks)


def phi3_ns(max_model_len: int, **rope) -> Namespace:
    """A Phi-3 (LongRoPE) engine whose ``max_model_len`` is ``max_model_len``."""
    cfg = vllm_config({}, model="microsoft/Phi-3-mini-128k-instruct")
    params = {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [4.0],
              "original_max_position_embeddings": 4096, **rope}
    cfg.model_config = SimpleNamespace(model="microsoft/Phi-3-mini-128k-instruct", revision=None,
                                       max_model_len=max_model_len,
                                       hf_text_config=SimpleNamespace(rope_parameters=params))
    return vllm_namespace(cfg, kv_cache_config(), parse_settings({}, source="x").config)


def test_regression_longrope_engines_with_short_and_long_max_model_len_shared_a_namespace():
    # vLLM rotates K with LongRoPE's long factors iff max_model_len > original_max_position_embeddings:
    # an engine at --max-model-len 4096 and one at 131072 got one namespace and each other's K
    assert phi3_ns(4096).digest() != phi3_ns(131072).digest()
    assert phi3_ns(8192) == phi3_ns(131072)  # both on the long factors: one namespace
    assert phi3_ns(2048) == phi3_ns(4096)
    assert "+numerics-" not in vllm_ns_with("tiny", max_model_len=4096, hf_text_config=SimpleNamespace(
        rope_parameters={"rope_type": "default"})).revision  # other RoPE: the namespace is as before


def mm_request(pixels: str):
    """A request with one image that vLLM named by its counter, as it does with its caches off."""
    image = SimpleNamespace(identifier="renderer0-mm-1-image-0", mm_hash="renderer0-mm-1-image-0",
                            mm_position=SimpleNamespace(offset=2, length=8), data=pixels)
    return SimpleNamespace(request_id="r1", prompt_token_ids=[1, 2] + [9] * 8 + [3, 4], num_prompt_tokens=12,
                           prompt_embeds=None, lora_request=None, cache_salt=None, mm_features=[image])


@pytest.mark.parametrize("prefix_caching,processor_cache_gb,keyed", [(False, 0, False), (True, 0, True),
                                                                    (False, 4, True)])
def test_regression_images_named_by_vllms_per_process_counter_got_each_others_kv(prefix_caching,
                                                                                  processor_cache_gb, keyed):
    # with vLLM's prefix caching and processor cache off, an image is named renderer0-mm-1-image-0
    # in every run and replica: the next run's first image (another one) was served this one's KV
    cfg = vllm_config({})
    cfg.model_config.multimodal_config = SimpleNamespace(mm_processor_cache_gb=processor_cache_gb)
    cfg.cache_config = SimpleNamespace(block_size=BS, enable_prefix_caching=prefix_caching)
    sched = TieredKVConnector(cfg, KVConnectorRole.SCHEDULER, kv_cache_config())
    try:
        view = sched._sched._view(mm_request("a cat"))
        assert (view is not None) is keyed
        assert sched._sched.get_num_new_matched_tokens(mm_request("a dog"), 0) == (0, False)
    finally:
        sched.shutdown()


def test_regression_two_hub_lora_adapters_under_one_name_and_id_shared_keys():
    # a lora_path that is not local (a hub id the worker downloads) has no fingerprint: the key
    # named the adapter by name and id only, so run A's org/bot-v1 and run B's org/bot-v2 (both
    # loaded as "bot", id 1) read each other's KV
    def hub(path):
        return SimpleNamespace(lora_request=SimpleNamespace(lora_name="bot", lora_int_id=1, lora_path=path),
                               cache_salt=None, mm_features=None)

    assert _key_extra(hub("org/bot-v1")) != _key_extra(hub("org/bot-v2"))
    assert _key_extra(hub("org/bot-v1")) == _key_extra(hub("org/bot-v1"))


def _vllm_request(salt=None, media=()):
    features = [SimpleNamespace(identifier=ident, mm_position=SimpleNamespace(offset=at)) for ident, at in media]
    return SimpleNamespace(lora_request=None, cache_salt=salt, mm_features=features)


def test_regression_a_chosen_salt_or_media_uuid_named_another_requests_vllm_keys():
    # a salt is the tenant: one holding ";mm=..." gave the key extra of another tenant's image request
    assert _key_extra(_vllm_request("victim;mm=x@0")) != _key_extra(_vllm_request("victim", [("x", 0)]))
    # a caller's multimodal UUIDs (vLLM's multi_modal_uuids) are any text
    assert (_key_extra(_vllm_request(media=[("img-x@5;mm=img-y", 0)]))
            != _key_extra(_vllm_request(media=[("img-x", 5), ("img-y", 0)])))


def test_vllm_key_extras_without_a_semicolon_keep_the_text_stored_blocks_were_keyed_with():
    assert _key_extra(_vllm_request("tenant-a", [("0f3a", 12), ("9bc1", 40)])) == \
        "salt=tenant-a;mm=0f3a@12;mm=9bc1@40"
    assert _key_extra(_vllm_request()) is None


@pytest.mark.parametrize(("cache_dtype", "held_as"), [("fp8_inc", torch.float8_e4m3fn), ("fp8_ds_mla", torch.uint8)])
def test_regression_fp8_formats_no_dtype_names_got_a_namespace_of_an_unknown_dtype(tmp_path, cache_dtype, held_as):
    # fp8_ds_mla packs scales and a RoPE part into uint8 rows; fp8_inc keeps float8 tensors (as
    # vLLM maps it) with scales of its own: its spec's dtype alone looked like plain e4m3
    cfg = vllm_config({}, model=str(local_model(tmp_path)))
    cfg.load_config = SimpleNamespace(load_format="safetensors")
    cfg.cache_config = SimpleNamespace(block_size=BS, cache_dtype=cache_dtype, calculate_kv_scales=False)
    settings = parse_settings({}, source="x")
    with pytest.raises(ConfigError, match=f"cache_dtype={cache_dtype} is not supported"):
        vllm_namespace(cfg, kv_cache_config(FullAttentionSpec(dtype=held_as)), settings.config)
