"""TensorRT-LLM requests whose KV their token ids do not name alone: what of them is folded into
their keys, and the requests no key can name (neither loaded nor saved, counted)."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from tests.integrations.test_trtllm import matched, prompt
from tests.integrations.trtllm_executor import Executor, KvCacheConfig, LlmArgs, LlmRequest, store_llm_args
from tiered_kv.errors import ConfigError
from tiered_kv.integrations.trtllm import TieredKVScheduler, TieredKVWorker
from tiered_kv.integrations.trtllm_requests import request_view


@pytest.fixture
def llm_args(tmp_path, monkeypatch):
    return store_llm_args(tmp_path, monkeypatch)


def _serve(llm_args, rid: int, tokens: list[int], **fields) -> tuple[list[int], tuple[int, bool], int, int]:
    """One engine serving one request with ``fields`` set on it: (its output, what it matched,
    blocks on disk after it, requests counted as not keyed)."""
    sched, worker = TieredKVScheduler(llm_args), TieredKVWorker(llm_args)
    try:
        ex = Executor(sched, worker)
        req = ex.add(rid, tokens)
        for name, value in fields.items():
            setattr(req, name, value)
        out = ex.run()[rid]
        sched.store.flush()
        stored = sched.store.tier("disk").backend.stats().entries
        return out, matched(ex)[rid], stored, sched.store.metrics.snapshot()["events"].get("requests_not_keyed", 0)
    finally:
        sched.close()
        worker.close()


def test_regression_an_unhashed_multimodal_request_filled_the_store_with_blocks_nobody_can_read(llm_args):
    """Media without content hashes were keyed by a mark of this process and request: saved,
    they took room in every tier (evicting blocks that could be read) and were never found."""
    tokens = prompt(24, 3)
    _, _, text_only, _ = _serve(llm_args, 1, tokens)
    media = {"multimodal_positions": [4], "multimodal_lengths": [12]}
    for rid in (2, 3):
        _, match, stored, not_keyed = _serve(llm_args, rid, tokens, **media)
        assert match == (0, False)  # never served the text-only request's blocks
        assert (stored, not_keyed) == (text_only, 1)  # nothing of it was saved; it was counted


def test_regression_a_prompt_tuning_request_was_served_another_prompt_tables_kv(llm_args):
    """Ids past the vocabulary read the request's own prompt-tuning table: two tables behind
    the same ids got the same keys, so the second request was promised the first one's KV."""
    tokens = [1000 + i for i in range(16)] + prompt(8, 2)  # 16 virtual tokens, then text
    first = _serve(llm_args, 1, tokens, prompt_embedding_table="table A", prompt_vocab_size=16)
    second = _serve(llm_args, 2, tokens, prompt_embedding_table="table B", prompt_vocab_size=16)
    assert first[1:] == second[1:] == ((0, False), 0, 1)  # nothing promised, nothing stored, counted


@pytest.mark.parametrize("fields", [
    {"prompt_embedding_table": object()},
    {"multimodal_positions": [0]},
    {"multimodal_lengths": [8]},
    {"py_multimodal_data": {"image": {"pixel_values": object()}}},
    {"multimodal_embedding": object()},  # precomputed embeddings, no hashes
    {"encoder_tokens": [5, 6, 7]},  # an encoder-decoder request: its decoder attends to them
    {"py_encoder_input_features": object()},
    {"position_ids": list(range(8))},  # a rank's slice of a context-parallel prompt
])
def test_a_request_whose_kv_its_ids_do_not_name_has_no_view(fields):
    req = LlmRequest(1, prompt(8, 1), 8, 1)
    for name, value in fields.items():
        setattr(req, name, value)
    assert request_view(req) is None


def test_media_with_hashes_key_the_request_and_a_text_only_request_keeps_its_keys():
    req = LlmRequest(1, prompt(8, 1), 8, 1)
    assert request_view(req).key_extra is None  # (the keys every stored text block has)
    req.multimodal_hashes, req.multimodal_positions, req.multimodal_lengths = [[7] * 8], [2], [4]
    req.py_multimodal_data = {"image": {"pixel_values": object()}}
    assert request_view(req).key_extra == "mm=7-7-7-7-7-7-7-7@2+4"


def _adapter(directory) -> str:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "adapter_model.safetensors").write_bytes(b"L" * 64)
    return str(directory)


def test_regression_key_extra_parts_joined_bare_gave_two_requests_one_key(tmp_path):
    """A ';' inside one part read as the join between two: a LoRA id and an image named the
    same keys as a LoRA id that spelled out that image."""
    spelled = LlmRequest(1, prompt(8, 1), 8, 1)
    spelled.lora_task_id, spelled.py_lora_path = "7;mm=1-1-1-1-1-1-1-1@0+4", _adapter(tmp_path)
    imaged = LlmRequest(2, prompt(8, 1), 8, 1)
    imaged.lora_task_id, imaged.py_lora_path = "7", _adapter(tmp_path)
    imaged.multimodal_hashes, imaged.multimodal_positions, imaged.multimodal_lengths = [[1] * 8], [0], [4]
    assert request_view(spelled).key_extra != request_view(imaged).key_extra


def test_the_key_extra_of_engine_typed_values_is_the_text_stored_blocks_were_keyed_with(tmp_path):
    from tiered_kv.fingerprint import files_fingerprint

    req = LlmRequest(1, prompt(8, 1), 8, 1)
    req.cache_salt_id, req.lora_task_id, req.py_lora_path = 1234567890123, 7, _adapter(tmp_path)
    req.multimodal_hashes, req.multimodal_positions, req.multimodal_lengths = [[1, -2] * 4, [3] * 8], [0, 9], [4, 5]
    assert request_view(req).key_extra == (f"cache_salt_id=1234567890123;lora_task_id=7;"
                                           f"lora_files={files_fingerprint(req.py_lora_path)};"
                                           "mm=1--2-1--2-1--2-1--2@0+4,3-3-3-3-3-3-3-3@9+5")


@dataclass
class _ContextParallelArgs(LlmArgs):
    context_parallel_size: int = 1


def test_regression_a_context_parallel_engine_was_taken_for_one_rank(llm_args):
    """Context parallelism splits a prompt's KV over ranks; every rank's worker would load and
    save its own part under the keys of the whole prompt."""
    args = _ContextParallelArgs(llm_args.model, KvCacheConfig(), context_parallel_size=2)
    with pytest.raises(ConfigError, match="context_parallel_size=2"):
        TieredKVScheduler(args)
    with pytest.raises(ConfigError, match="context_parallel_size=2"):
        TieredKVWorker(args)
    TieredKVScheduler(_ContextParallelArgs(llm_args.model, KvCacheConfig())).close()  # one rank: taken


@pytest.mark.parametrize("sampling", [{"beam_width": 2}, {"beam_width": 1, "beam_width_array": [1, 1, 3]}])
def test_regression_a_beam_search_request_saved_its_generated_blocks_under_beam_zeros_tokens(llm_args, sampling):
    """TensorRT-LLM reports beam 0's tokens and block ids; with several beams the generated ones
    can be rewritten when beams are reordered, and the cache indirection mixes what the beams'
    blocks hold, so their keys named KV no single sequence computed. Only the prompt is saved
    (and served again)."""
    beams = SimpleNamespace(**{"beam_width_array": None, **sampling})
    searched, greedy = prompt(24, 5), prompt(24, 6)  # 6 full blocks of 4 tokens each
    _, _, stored, _ = _serve(llm_args, 1, searched, max_new_tokens=9, sampling_config=beams)
    assert stored == 1 + 6  # the namespace record and the prompt's blocks only
    _, _, stored, _ = _serve(llm_args, 2, greedy, max_new_tokens=9)
    assert stored == 1 + 6 + 8  # one beam: the prompt's 6 blocks and 2 of generated tokens
    _, match, _, _ = _serve(llm_args, 3, searched, max_new_tokens=9, sampling_config=beams)
    assert match[0] == 20  # its prompt is found (but for the block of its last token)


def test_a_beam_search_request_scheduled_anew_with_its_generated_tokens_still_saves_its_prompt_only(llm_args):
    """A request TensorRT-LLM reports as new again (all its tokens in ``new_tokens``, generated
    ones too) keys and saves no block past its prompt when it searches several beams."""
    from tests.integrations.trtllm_executor import BS, RequestData, SchedulerOutput

    sched = TieredKVScheduler(llm_args)
    try:
        tokens = prompt(24, 7)
        req = LlmRequest(1, tokens, len(tokens), 9)
        req.sampling_config = SimpleNamespace(beam_width=2, beam_width_array=None)
        assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
        sched.update_state_after_alloc(req, list(range(8)))
        generated = prompt(8, 8)  # two more blocks' worth, as if resumed after generating them
        step = RequestData(1, tokens + generated, list(range(8)), 0, len(tokens) + len(generated))
        meta = sched.build_connector_meta(SchedulerOutput(new_requests=[step]))
        assert sum(len(s.keys) for s in meta.saves) == len(tokens) // BS  # the prompt's 6 blocks
    finally:
        sched.close()
