"""What the TensorRT-LLM adapter reads of the model: its namespace (``llm_args`` and the model's
config.json) and the attention windows it refuses.

TensorRT-LLM keeps one KV *layer group* per attention window size. A model with several window
sizes (variable sliding-window attention, VSWA: Gemma 2/3, or ``kv_cache_config.
max_attention_window`` with several values) is driven through the per-layer-group connector
calls (``update_state_after_alloc_by_layer_group``, ``request_finished_by_layer_group``) and
``register_kv_cache_layout``, with page indices scoped to a group; a group with a window frees
the pages behind it and reports those blocks as ``-1``. The adapter stores full-attention K/V of
one layer group, so a model with a window is refused when the connector is built: one
ConfigError line naming where the window was found.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from tiered_kv.config import TieredKVConfig
from tiered_kv.dtypes import dtype_name
from tiered_kv.errors import ConfigError
from tiered_kv.fingerprint import fold_weights, model_name
from tiered_kv.keys import Namespace

SOURCE = "TensorRT-LLM tiered-kv settings (TIERED_KV_*)"

WINDOWED = ("the TensorRT-LLM adapter stores the full-attention KV of one layer group; TensorRT-LLM "
            "keeps a layer group per window size and frees the pages behind a window")


def model_config(llm_args: Any) -> dict:
    for candidate in (getattr(llm_args, "model", None), getattr(llm_args, "_hf_model_dir", None)):
        if candidate is None:
            continue
        path = Path(str(candidate)) / "config.json"
        if path.is_file():
            try:
                return json.loads(path.read_text())
            except (OSError, ValueError) as exc:
                raise ConfigError(f"{SOURCE}: cannot read {path}: {exc}") from None
    raise ConfigError(f"{SOURCE}: llm_args.model {getattr(llm_args, 'model', None)!r} is not a local "
                      "directory with a config.json (the namespace needs layers, heads and head size)")


def model_dir(llm_args: Any) -> str | None:
    """The local directory :func:`model_config` reads config.json from."""
    for candidate in (getattr(llm_args, "model", None), getattr(llm_args, "_hf_model_dir", None)):
        if candidate is not None and (Path(str(candidate)) / "config.json").is_file():
            return str(candidate)
    return None


def trtllm_namespace(llm_args: Any, config: TieredKVConfig) -> Namespace:
    """The namespace of this engine's KV blocks, from ``llm_args`` and the model's config.json."""
    tp = int(getattr(llm_args, "tensor_parallel_size", 1) or 1)
    pp = int(getattr(llm_args, "pipeline_parallel_size", 1) or 1)
    if tp != 1 or pp != 1:
        raise ConfigError(f"{SOURCE}: tensor_parallel_size={tp}, pipeline_parallel_size={pp}: the "
                          "TensorRT-LLM adapter supports one rank (load failures on other ranks "
                          "cannot be reported to the engine)")
    hf = model_config(llm_args)
    hf = hf.get("text_config", hf) if "num_hidden_layers" not in hf else hf
    refuse_attention_windows(llm_args, hf)
    try:
        heads = int(hf["num_attention_heads"])
        kv_heads = int(hf.get("num_key_value_heads") or heads)
        head_dim = int(hf.get("head_dim") or int(hf["hidden_size"]) // heads)
        layers = int(hf["num_hidden_layers"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"{SOURCE}: the model's config.json lacks {exc}") from None
    kv_cache_config = getattr(llm_args, "kv_cache_config", None)
    block_size = getattr(kv_cache_config, "tokens_per_block", None) or 32
    dtype = getattr(kv_cache_config, "dtype", None)
    if dtype in (None, "auto"):
        dtype = getattr(llm_args, "dtype", None)
    if dtype in (None, "auto"):
        dtype = hf.get("torch_dtype") or hf.get("dtype") or "bfloat16"
    # model_revision, when set, names the weights (see vllm._revision); else a local model
    # directory's weight files (checkpoint or built engine) are fingerprinted into the revision
    revision = config.model_revision or fold_weights(str(getattr(llm_args, "revision", None) or ""),
                                                      model_dir(llm_args))
    return Namespace(model_id=model_name(llm_args.model), dtype=dtype_name(dtype), num_layers=layers,
                     num_kv_heads=kv_heads, head_dim=head_dim, block_size=int(block_size),
                     revision=revision, cache_salt=config.cache_salt, hash_algo=config.hash_algo)


def refuse_attention_windows(llm_args: Any, hf: dict) -> None:
    """Refuse a model TensorRT-LLM runs with an attention window (one ConfigError line)."""
    found = attention_windows(llm_args, hf)
    if found:
        raise ConfigError(f"{SOURCE}: {found}: {WINDOWED}")


def attention_windows(llm_args: Any, hf: dict) -> str | None:
    """Where a window shows, or None for full attention in every layer.

    ``kv_cache_config.max_attention_window`` (one window per layer, repeated over the layers)
    with several sizes, or one size below ``max_seq_len`` (config.json's ``max_position_embeddings``
    when it is not set); recurrent layers (``hybrid_override_pattern``, ``layers_block_type``, SSM
    sizes); Gemma 2/3 (``model_type``, ``cache_implementation: hybrid``); ``layer_types`` with
    other than full attention, ``sliding_window_pattern`` (Gemma 2/3), ``attention_chunk_size``
    (chunked local attention) or ``use_sliding_window: true``. A bare ``sliding_window`` without
    those is left alone (many configs carry one TensorRT-LLM does not apply); should a window be
    applied after all, the per-layer-group calls, a windowed layout at registration and ``-1``
    page indices are refused when they arrive."""
    windows = getattr(getattr(llm_args, "kv_cache_config", None), "max_attention_window", None)
    if windows:
        sizes = sorted({int(w) for w in windows})
        max_seq_len = getattr(llm_args, "max_seq_len", None) or hf.get("max_position_embeddings")
        if len(sizes) > 1:
            return f"kv_cache_config.max_attention_window={list(windows)} has {len(sizes)} window sizes (VSWA)"
        if max_seq_len and sizes[0] < int(max_seq_len):
            return f"kv_cache_config.max_attention_window={list(windows)} is below max_seq_len={max_seq_len}"
    for key in ("hybrid_override_pattern", "layers_block_type", "mamba_num_heads", "ssm_state_size"):
        if hf.get(key):  # recurrent layers: their state is not stored on this engine
            return f"config.json has {key} (recurrent Mamba/SSM layers)"
    if hf.get("cache_implementation") == "hybrid" or str(hf.get("model_type", "")) in ("gemma2", "gemma3",
                                                                                      "gemma3_text"):
        return f"config.json describes {hf.get('model_type')} (interleaved sliding-window layers)"
    kinds = Counter(str(t) for t in hf.get("layer_types") or ())
    if any(kind != "full_attention" for kind in kinds):
        return "config.json layer_types has " + ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items()))
    for key in ("sliding_window_pattern", "attention_chunk_size"):
        if hf.get(key):
            return f"config.json has {key}={hf[key]}"
    if hf.get("use_sliding_window") and hf.get("sliding_window"):
        return f"config.json has use_sliding_window with sliding_window={hf['sliding_window']}"
    return None
