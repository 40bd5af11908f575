"""The namespace of a vLLM engine's KV blocks, from the KV cache specs vLLM allocates by (no
torch here): one full-attention group keeps the plain namespace; MLA, sliding-window, chunked and
hybrid models name their KV groups (:mod:`tiered_kv.integrations.vllm_groups`). What one stored
block cannot follow (pipeline or context parallelism, runtime fp8 scales, int8 KV, non-causal
attention) is refused with one ConfigError line."""

from __future__ import annotations

from typing import Any

from tiered_kv.dtypes import dtype_name
from tiered_kv.errors import ConfigError
from tiered_kv.fingerprint import files_fingerprint, fold_weights, local_model, model_name
from tiered_kv.integrations.numerics import dummy_weights, numerics_suffix, quantized_kv
from tiered_kv.integrations.vllm_groups import is_replicated, kv_groups
from tiered_kv.keys import Namespace

SOURCE = "kv_connector_extra_config"
PLAIN_FP8 = ("fp8", "fp8_e4m3", "fp8_e5m2")  # cache dtypes whose KV is a plain fp8 tensor (in uint8 rows)


# (attribute, what it is): each splits a block's KV over ranks in a way one stored block
# cannot follow. Context parallelism interleaves a block's tokens over ranks (vLLM 0.32:
# ``decode_context_parallel_size``, ``prefill_context_parallel_size``; ``context_parallel_size``
# in some releases); pipeline parallelism gives each rank a share of the layers.
UNSUPPORTED_PARALLELISM = (
    ("pipeline_parallel_size", "pipeline parallelism"),
    ("decode_context_parallel_size", "decode context parallelism"),
    ("prefill_context_parallel_size", "prefill context parallelism"),
    ("context_parallel_size", "context parallelism"),
)

# model_config fields that change the K/V a checkpoint computes for the same tokens beyond its
# weight files and KV dtype: weights quantized as they load (``--quantization fp8`` of a bf16
# checkpoint), config overrides (RoPE scaling is applied to K before it is cached), another
# config or weights path. Folded into the revision when set (unset: the namespace is as before).
# ``model_class_overrides`` runs another class (other code) on the checkpoint; ``code_revision``
# names the hub revision of a trust_remote_code model's code apart from its weights'.
NUMERICS = ("quantization", "quantization_config", "hf_overrides", "hf_config_path", "model_weights",
            "model_class_overrides", "code_revision")


def vllm_namespace(vllm_config: Any, kv_cache_config: Any, settings_config: Any, *,
                   tp_rank: int = 0) -> Namespace:
    """The namespace of this engine's KV blocks, from the KV cache specs vLLM allocates by: one
    full-attention group keeps the plain namespace; anything else names its KV groups
    (:mod:`tiered_kv.integrations.vllm_groups`)."""
    pc = vllm_config.parallel_config
    _refuse_parallelism(pc)
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    if not groups:
        raise ConfigError(f"{SOURCE}: vLLM passed no KV cache groups (a model without KV cache?)")
    if any(getattr(g.kv_cache_spec, "non_causal", False) is True for g in groups):
        # Prefix LM: a prefill attends both ways, so a block's KV depends on the tokens after it
        # (vLLM turns its own prefix caching off for the same reason)
        raise ConfigError(f"{SOURCE}: non-causal (Prefix LM) attention is not supported: a block's KV "
                          "depends on the tokens after it, and tiered-kv keys a block by those before it")
    if not _plain(groups):
        return _grouped_namespace(vllm_config, groups, settings_config, tp_rank)
    spec = _full_attention_spec(groups)
    _refuse_other_block_size(vllm_config, spec)
    mc = vllm_config.model_config
    return Namespace(
        model_id=model_name(mc.model), dtype=_kv_dtype(vllm_config, spec), num_layers=len(groups[0].layer_names),
        num_kv_heads=int(spec.num_kv_heads), head_dim=int(spec.head_size), block_size=int(spec.block_size),
        revision=_revision(vllm_config, settings_config), tp_rank=tp_rank,
        tp_size=int(getattr(pc, "tensor_parallel_size", 1) or 1),
        cache_salt=settings_config.cache_salt, hash_algo=settings_config.hash_algo)


def _plain(groups: list) -> bool:
    spec = groups[0].kv_cache_spec
    return (len(groups) == 1 and type(spec).__name__ == "FullAttentionSpec"
            and not getattr(spec, "sliding_window", None) and not getattr(spec, "attention_chunk_size", None))


def _grouped_namespace(vllm_config: Any, groups: list, settings_config: Any, tp_rank: int) -> Namespace:
    ours, _ = kv_groups(groups, lambda spec: _kv_dtype(vllm_config, spec), SOURCE)
    token = [g for g in ours if not g.is_state]
    tp_size = int(getattr(vllm_config.parallel_config, "tensor_parallel_size", 1) or 1)
    if is_replicated(ours):  # MLA: every rank holds the same latents; stored once for all
        tp_rank, tp_size = 0, 1
    first = token[0]
    return Namespace(
        model_id=model_name(vllm_config.model_config.model), dtype=first.dtype,
        num_layers=sum(g.num_layers for g in ours), num_kv_heads=first.shape[-2] if len(first.shape) == 3 else 1,
        head_dim=first.shape[-1], block_size=first.block_size, revision=_revision(vllm_config, settings_config),
        tp_rank=tp_rank, tp_size=tp_size, cache_salt=settings_config.cache_salt,
        hash_algo=settings_config.hash_algo, groups=ours)


def _refuse_parallelism(pc: Any) -> None:
    for attr, what in UNSUPPORTED_PARALLELISM:
        size = int(getattr(pc, attr, 1) or 1)
        if size != 1:
            raise ConfigError(f"{SOURCE}: {what} is not supported by tiered-kv ({attr}={size}): "
                              "a stored block must hold every token and layer of its block on one rank")


def _full_attention_spec(groups: list) -> Any:
    if len(groups) != 1:
        raise ConfigError(f"{SOURCE}: the model has {len(groups)} KV cache groups (hybrid or "
                          "multi-spec); tiered-kv supports one full-attention group")
    spec = groups[0].kv_cache_spec
    kind = type(spec).__name__
    head_v = getattr(spec, "head_size_v", None)
    if (kind != "FullAttentionSpec" or getattr(spec, "sliding_window", None)
            or getattr(spec, "attention_chunk_size", None) or head_v not in (None, spec.head_size)):
        raise ConfigError(f"{SOURCE}: unsupported KV cache spec {kind} (MLA, sliding-window, "
                          "chunked or uneven K/V heads); tiered-kv stores full-attention K/V")
    return spec


def _refuse_other_block_size(vllm_config: Any, spec: Any) -> None:
    """Keys cover ``spec.block_size`` tokens; vLLM pages by the group's spec, which it may raise
    above ``cache_config.block_size`` (hybrid models): then the two disagree and we stop."""
    configured = getattr(getattr(vllm_config, "cache_config", None), "block_size", None)
    if configured and int(configured) != int(spec.block_size):
        raise ConfigError(f"{SOURCE}: the KV cache group has {spec.block_size} tokens per block but "
                          f"cache_config.block_size is {configured}; tiered-kv needs one block size")


def _kv_dtype(vllm_config: Any, spec: Any) -> str:
    """The dtype of the KV bytes. vLLM keeps fp8 KV in uint8 tensors (``spec.dtype`` uint8 for
    both fp8 formats): the format comes from ``cache_config.cache_dtype`` then."""
    cc = getattr(vllm_config, "cache_config", None)
    cache_dtype = str(getattr(cc, "cache_dtype", None) or "auto")
    name = dtype_name(spec.dtype)
    if cache_dtype.startswith("fp8"):
        if cache_dtype not in PLAIN_FP8:  # fp8_inc (float8 tensors, scales of its own), fp8_ds_mla (packed rows)
            raise ConfigError(f"{SOURCE}: cache_dtype={cache_dtype} is not supported (its KV bytes are no "
                              "plain fp8 tensor tiered-kv can name); use cache_dtype auto, fp8_e4m3 or fp8_e5m2")
        if getattr(cc, "calculate_kv_scales", False):
            raise ConfigError(f"{SOURCE}: cache_dtype={cache_dtype} with calculate_kv_scales=True is not "
                              "supported: the fp8 scales are computed at run time, so stored KV would be "
                              "read with other scales; use the checkpoint's static scales or cache_dtype=auto")
        # static scales come from the checkpoint (k_scale / v_scale next to the weights): the
        # weights fingerprint in the revision covers them, as it covers the weights
        return name if name.startswith("float8") else dtype_name(cache_dtype)
    if name in ("uint8", "int8"):
        raise ConfigError(f"{SOURCE}: a {name} KV cache (cache_dtype={cache_dtype}) holds quantized values "
                          "tiered-kv cannot name; use cache_dtype auto, fp8_e4m3 or fp8_e5m2")
    return name


def _revision(vllm_config: Any, settings_config: Any) -> str:
    """What names the weights: ``model_revision`` when set (the operator names them: needed to
    share a store between machines whose copies of a local model differ in mtimes), else the
    model's revision plus a fingerprint of its weight files when the model is a local directory
    (files replaced in place change the namespace), or the commit a hub id's revision resolves
    to in the Hugging Face cache vLLM downloaded it to (:func:`fold_weights`)."""
    mc, load = vllm_config.model_config, getattr(vllm_config, "load_config", None)
    revision = settings_config.model_revision
    if not revision:
        revision = fold_weights(str(getattr(mc, "revision", None) or ""), mc.model,
                                cache_dir=getattr(load, "download_dir", None))
    revision += dummy_weights(getattr(load, "load_format", ""))
    return revision + _numerics(vllm_config)


def _numerics(vllm_config: Any) -> str:
    """``+numerics-<hex>`` over the :data:`NUMERICS` fields that are set (and the activation
    dtype under an fp8 KV cache, which the KV dtype does not name), or "" when none is."""
    mc = vllm_config.model_config
    fields = {name: getattr(mc, name, None) for name in NUMERICS}
    config_dir = local_model(fields["hf_config_path"])
    if config_dir is not None:  # (its path names it, not its config.json: one edited in place did not count)
        fields["hf_config_files"] = files_fingerprint(config_dir)
    cache_dtype = getattr(getattr(vllm_config, "cache_config", None), "cache_dtype", None)
    if quantized_kv(cache_dtype) or (cache_dtype not in (None, "", "auto")
                                     and dtype_name(cache_dtype) != dtype_name(getattr(mc, "dtype", None))):
        # a KV cache of another dtype than the activations (float32 or float16 computed, bfloat16
        # cached) holds other bytes than one of that dtype computed natively
        fields["dtype"] = getattr(mc, "dtype", None)
    fields["longrope"] = _long_rope(mc)
    fields["draft"] = _draft(vllm_config)
    return numerics_suffix(fields)


def _draft(vllm_config: Any) -> dict | None:
    """A speculative decoder's own checkpoint (EAGLE heads, a draft model): its attention layers
    page their KV in the target's groups, so its weights are part of what a block holds. None
    without one, or when the draft layers come from the target's checkpoint (MTP)."""
    spec = getattr(vllm_config, "speculative_config", None)
    draft = getattr(spec, "draft_model_config", None)
    target = getattr(vllm_config.model_config, "model", None)
    if draft is None or getattr(draft, "model", None) in (None, target):
        return None
    return {"method": getattr(spec, "method", None), "model": model_name(draft.model),
            "weights": fold_weights(str(getattr(draft, "revision", None) or ""), draft.model),
            "quantization": getattr(draft, "quantization", None)}


def _long_rope(mc: Any) -> str | None:
    """Which LongRoPE factors rotate K (Phi-3): vLLM takes the long ones at every position when
    ``max_model_len`` exceeds ``original_max_position_embeddings``, else the short ones, so one
    checkpoint's K differ between the two. None without LongRoPE."""
    config = getattr(mc, "hf_text_config", None) or getattr(mc, "hf_config", None)
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if not isinstance(params, dict):
        return None
    nested = "rope_type" not in params and "type" not in params  # one per layer type
    for p in params.values() if nested else (params,):
        if isinstance(p, dict) and p.get("rope_type", p.get("type")) == "longrope":
            original = p.get("original_max_position_embeddings") or getattr(
                config, "original_max_position_embeddings", None)
            max_len = getattr(mc, "max_model_len", None)
            if original and max_len:
                return "long" if int(max_len) > int(original) else "short"
            return f"max_model_len={max_len}"
    return None
