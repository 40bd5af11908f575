"""vLLM 0.33's own scheduler with tiered-kv attached, on CPU, with fabricated model outputs.

What is real: ``VllmConfig`` (its connector checks included), ``KVCacheConfig`` /
``KVCacheGroupSpec`` / ``FullAttentionSpec``, ``KVConnectorFactory`` building both roles of our
connector from ``kv_transfer_config``, ``Scheduler`` (``schedule()`` / ``update_from_output()``,
its KV cache manager, prefix cache and request state machine), ``Request`` with vLLM's block
hasher, ``ModelRunnerOutput`` / ``KVConnectorOutput``. What is fabricated: the forward pass. Per
scheduled token it writes a KV value that depends on every token up to it into the block vLLM
assigned, and a sampled token is a function of the KV of the whole sequence read back from those
blocks, so a wrong or missing loaded block changes the output.

The worker half runs in the scheduler's process (vLLM's uniproc executor): its calls come in the
model runner's order (``bind_connector_metadata`` -> ``start_load_kv`` -> forward ->
``wait_for_save`` -> ``get_finished`` -> ``get_block_ids_with_load_errors`` ->
``clear_connector_metadata``).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

LAYERS, HEADS, KV_HEADS, DIM, BS = 2, 4, 2, 32, 16
VOCAB = 1000
NUM_BLOCKS = 64


def write_model(path: Path) -> Path:
    """A model directory with a config.json only (vLLM reads the architecture and geometry)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HEADS * DIM,
        "intermediate_size": 256, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
        "head_dim": DIM, "num_hidden_layers": LAYERS, "vocab_size": VOCAB, "max_position_embeddings": 2048,
        "torch_dtype": "float32", "rms_norm_eps": 1e-5}))
    return path


def vllm_config(model: Path, extra: dict | None, *, budget: int = 256, sleep_mode: bool = False):
    """vLLM's config with our connector attached by ``kv_transfer_config`` (``extra`` None: none)."""
    from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig

    mc = ModelConfig(model=str(model), skip_tokenizer_init=True, dtype="float32", max_model_len=512,
                     enable_sleep_mode=sleep_mode)
    transfer = None if extra is None else KVTransferConfig(
        kv_connector="TieredKVConnector", kv_connector_module_path="tiered_kv.integrations.vllm",
        kv_role="kv_both", kv_connector_extra_config=extra, kv_load_failure_policy="recompute")
    cfg = VllmConfig(
        model_config=mc, cache_config=CacheConfig(block_size=BS, enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=512,
                                         is_encoder_decoder=False, enable_chunked_prefill=True),
        kv_transfer_config=transfer)
    cfg.cache_config.num_gpu_blocks = NUM_BLOCKS
    return cfg


def kv_cache_config(sliding_window: int | None = None):
    """A full-attention group over every layer, or with ``sliding_window`` two groups: layer 0
    full attention, layer 1 a sliding window (vLLM's hybrid allocator, one block pool)."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
        SlidingWindowSpec,
    )

    geometry = {"block_size": BS, "num_kv_heads": KV_HEADS, "head_size": DIM, "dtype": torch.float32}
    if sliding_window is None:
        groups = [([layer_name(i) for i in range(LAYERS)], FullAttentionSpec(**geometry))]
    else:
        groups = [([layer_name(0)], FullAttentionSpec(**geometry)),
                  ([layer_name(1)], SlidingWindowSpec(**geometry, sliding_window=sliding_window))]
    specs = [KVCacheGroupSpec(names, spec) for names, spec in groups]
    page = specs[0].kv_cache_spec.page_size_bytes
    tensors = [KVCacheTensor(size=page * NUM_BLOCKS, layers=[name], layer_stride=page * NUM_BLOCKS, block_stride=page)
               for g in specs for name in g.layer_names]
    return KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=tensors, kv_cache_groups=specs)


def layer_name(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


def kv_of(tokens: list[int], pos: int) -> torch.Tensor:
    """``[2, KV_HEADS, DIM]`` KV of one layer-independent position: depends on tokens[:pos + 1]."""
    state = 7
    for t in tokens[: pos + 1]:
        state = (state * 31 + t) % 1_000_003
    base = torch.arange(2 * KV_HEADS * DIM, dtype=torch.float32).view(2, KV_HEADS, DIM)
    return base * 0.01 + float(state % 9973)


class Engine:
    """vLLM's ``Scheduler`` plus a worker-role connector over per-layer KV tensors."""

    def __init__(self, config, kvc=None, *, worker: bool = True) -> None:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager

        self.config, self.kvc = config, kvc or kv_cache_config()
        # the worker first, as vLLM's executor starts before the engine core builds its scheduler
        worker = worker and config.kv_transfer_config is not None
        self.worker = (KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, self.kvc)
                       if worker else None)
        # per layer [num_blocks, 2, block_size, heads, dim] (FlashAttention's layout)
        self.kv = {name: torch.zeros(NUM_BLOCKS, 2, BS, KV_HEADS, DIM)
                   for g in self.kvc.kv_cache_groups for name in g.layer_names}
        if self.worker is not None:
            self.worker.register_kv_caches(self.kv)
        self.scheduler = Scheduler(vllm_config=config, kv_cache_config=self.kvc,
                                   structured_output_manager=StructuredOutputManager(config),
                                   block_size=BS, hash_block_size=BS)
        hash_fn = get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self.hasher = get_request_block_hasher(BS, hash_fn)
        self.outputs: dict[str, list[int]] = {}
        self.metas: list = []  # every step's connector metadata
        self.matched: dict[str, list[tuple]] = {}  # request -> what get_num_new_matched_tokens answered
        self.finished_ids: set[str] = set()
        self.steps = self.computed = 0
        if self.connector is not None:
            self._record_matches(self.connector)

    def _record_matches(self, connector) -> None:
        """Keep what the scheduler-role connector answered vLLM's scheduler (calls pass through)."""
        ask = connector.get_num_new_matched_tokens

        def recorded(request, num_computed_tokens):
            answer = ask(request, num_computed_tokens)
            self.matched.setdefault(request.request_id, []).append(answer)
            return answer

        connector.get_num_new_matched_tokens = recorded

    def loads(self) -> dict[str, list[int]]:
        """Request -> vLLM block ids our connector loaded into (every step's metadata)."""
        out: dict[str, list[int]] = {}
        for meta in self.metas:
            for spec in (meta.meta.loads if meta is not None else ()):
                out.setdefault(spec.request_id, []).extend(spec.block_ids)
        return out

    @property
    def connector(self):
        """The scheduler-role connector vLLM's scheduler built."""
        return self.scheduler.connector

    def add(self, rid: str, prompt: list[int], max_tokens: int = 3):
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        req = Request(rid, list(prompt), params, None, block_hasher=self.hasher)
        self.scheduler.add_request(req)
        self.outputs[rid] = []
        return req

    def step(self) -> None:
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        self.steps += 1
        so = self.scheduler.schedule()
        self.metas.append(so.kv_connector_metadata)
        sending, recving, invalid = None, None, set()
        w = self.worker
        if w is not None:
            w.handle_preemptions(so.kv_connector_metadata)
            w.bind_connector_metadata(so.kv_connector_metadata)
            w.start_load_kv(None)
        sampled = self._forward(so)
        self.computed += sum(so.num_scheduled_tokens.values())
        if w is not None:
            w.wait_for_save()
            sending, recving = w.get_finished(so.finished_req_ids)
            invalid = w.get_block_ids_with_load_errors()
            w.clear_connector_metadata()
        req_ids = list(so.num_scheduled_tokens)
        out = ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[sampled.get(r, []) for r in req_ids],
            kv_connector_output=KVConnectorOutput(finished_sending=sending, finished_recving=recving,
                                                  invalid_block_ids=invalid))
        for outputs in self.scheduler.update_from_output(so, out).values():
            for o in outputs.outputs:
                self.outputs[o.request_id].extend(o.new_token_ids)
                if o.finished:
                    self.finished_ids.add(o.request_id)

    def _forward(self, so) -> dict[str, list[int]]:
        """Write the scheduled tokens' KV into each group's blocks; sample a token where the
        prompt is complete."""
        sampled = {}
        for rid, n in so.num_scheduled_tokens.items():
            req = self.scheduler.requests[rid]
            tables = self.scheduler.kv_cache_manager.get_block_ids(rid)
            tokens = req.all_token_ids
            end = req.num_computed_tokens  # already advanced by this step's tokens
            for group, blocks in zip(self.kvc.kv_cache_groups, tables):
                for pos in range(end - n, end):
                    for name in group.layer_names:
                        self.kv[name][blocks[pos // BS], :, pos % BS] = kv_of(tokens, pos)
            if end >= req.num_tokens:
                sampled[rid] = [self._next_token(tokens, tables)]
        return sampled

    def _next_token(self, tokens: list[int], tables) -> int:
        """A token from the KV the last position attends to: every position in a full-attention
        group, the last ``sliding_window`` ones in a sliding-window group."""
        acc = 0
        for group, blocks in zip(self.kvc.kv_cache_groups, tables):
            window = getattr(group.kv_cache_spec, "sliding_window", None) or len(tokens)
            for pos in range(max(0, len(tokens) - window), len(tokens)):
                b, o = blocks[pos // BS], pos % BS
                assert b != 0, "read vLLM's null block"
                total = sum(self.kv[name][b, :, o].sum().item() for name in group.layer_names)
                acc = (acc * 131 + int(total * 100)) % 1_000_000_007
        return 1 + acc % (VOCAB - 1)

    def run(self, timeout: float = 60.0) -> dict[str, list[int]]:
        deadline = time.monotonic() + timeout
        while self.scheduler.has_requests():
            computed = self.computed
            self.step()
            if self.computed == computed:  # waiting on transfers: an idle engine step takes real time
                time.sleep(0.005)
            assert time.monotonic() < deadline, "no progress"
        return dict(self.outputs)

    def close(self) -> None:
        self.scheduler.shutdown()
        if self.worker is not None:
            self.worker.shutdown()
