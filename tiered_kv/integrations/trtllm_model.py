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

The payload is TensorRT-LLM's own head-major pages (:func:`pages_layout`), named in the namespace.
The KV dtype follows what TensorRT-LLM's PyTorch backend (the one with connectors) applies:
``kv_cache_config.dtype`` when set, else the checkpoint's KV cache quantization (its
``hf_quant_config.json`` or config.json ``quantization_config``): FP8 pages are
``float8_e4m3fn``, INT8 ones ``int8``; else the model's dtype. Folded into the revision, when
set: random weights (``load_format`` dummy), ``model_kwargs``, ``force_dynamic_quantization``, a
``sparse_attention_config`` (RocketKV, DSA: later layers' K/V follow the tokens attended), a
``quant_config`` that quantizes (that backend takes quantization from the checkpoint, whose
files are fingerprinted, and ignores one set by hand: folding it only keeps such engines
apart), and the activation dtype under a quantized KV cache.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tiered_kv.config import TieredKVConfig
from tiered_kv.dtypes import dtype_name
from tiered_kv.errors import ConfigError
from tiered_kv.fingerprint import fold_weights, model_name
from tiered_kv.integrations.numerics import dummy_weights, numerics_suffix
from tiered_kv.keys import Namespace

SOURCE = "TensorRT-LLM tiered-kv settings (TIERED_KV_*)"

KV_QUANT_DTYPES = {"FP8": "float8_e4m3fn", "INT8": "int8"}  # quantized KV pages TensorRT-LLM keeps as one pool
QUANTIZED_KV = ("float8_e4m3fn", "float8_e5m2", "int8")  # KV dtypes whose values follow the activation dtype
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
    # (context parallelism splits a prompt's KV over ranks, each keyed by the whole prompt)
    sizes = {f"{name}_parallel_size": int(getattr(llm_args, f"{name}_parallel_size", 1) or 1)
             for name in ("tensor", "pipeline", "context")}
    if set(sizes.values()) != {1}:
        raise ConfigError(f"{SOURCE}: " + ", ".join(f"{k}={v}" for k, v in sizes.items()) + ": the "
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
    kv_algo = kv_cache_quant_algo(llm_args, hf)
    dtype = kv_dtype(llm_args, hf, kv_algo)
    # model_revision, when set, names the weights (see vllm._revision); else a local model
    # directory's weight files (checkpoint or built engine) are fingerprinted into the revision
    revision = config.model_revision or fold_weights(str(getattr(llm_args, "revision", None) or ""),
                                                      model_dir(llm_args))
    revision += quantization_suffix(llm_args, dtype)
    return Namespace(model_id=model_name(llm_args.model), dtype=dtype, num_layers=layers,
                     num_kv_heads=kv_heads, head_dim=head_dim, block_size=int(block_size),
                     revision=revision, layout=pages_layout(llm_args), cache_salt=config.cache_salt,
                     hash_algo=config.hash_algo)


def pages_layout(llm_args: Any) -> str:
    """The layout of the blocks' payload: TensorRT-LLM's pages as its attention backend keeps
    them, copied as they are. Its attention writes a block head-major, ``[layers, K/V, heads,
    tokens, dim]`` (its ``KVBlockArray``; ``kv_layout`` HND), not the canonical ``[layers, K/V,
    tokens, heads, dim]`` of vLLM's and our engine's blocks: named apart, the two never share a
    block (sharing the canonical name handed each engine the other's KV with heads and tokens
    transposed)."""
    backend = str(getattr(llm_args, "attn_backend", None) or "TRTLLM").upper()
    return f"trtllm:LKHTD:{backend}"


def kv_cache_quant_algo(llm_args: Any, hf: dict) -> str | None:
    """The KV cache quantization TensorRT-LLM's PyTorch backend applies (``"FP8"``, ``"INT8"``,
    ``"NVFP4"``, ...): ``kv_cache_config.dtype`` when set (``fp8``, ``nvfp4``; a plain dtype:
    None), else the checkpoint's (``hf_quant_config.json``, config.json's
    ``quantization_config``; for a layout of them not read here, ``quant_config``, into which
    TensorRT-LLM copies what it read of a quantized checkpoint: a ``quant_config`` the user set
    on a plain checkpoint is ignored by that backend, and so here)."""
    explicit = getattr(getattr(llm_args, "kv_cache_config", None), "dtype", None)
    if explicit not in (None, "auto"):
        name = str(explicit).upper()
        return name if name in ("FP8", "INT8") or name.startswith(("NVFP", "MXFP", "FP4")) else None
    checkpoint = _hf_quant_config(llm_args).get("quantization") or {}
    inline = hf.get("quantization_config") or {}
    algo = checkpoint.get("kv_cache_quant_algo") or inline.get("kv_cache_quant_algo")
    scheme = inline.get("kv_cache_scheme") or {}
    if algo is None and scheme.get("num_bits") == 8 and scheme.get("type") == "float":  # llm-compressor
        algo = "FP8"
    if algo is None and (checkpoint or inline):  # quantized: TensorRT-LLM's reading of it
        algo = getattr(getattr(llm_args, "quant_config", None), "kv_cache_quant_algo", None)
    return None if algo is None else str(getattr(algo, "value", algo)).upper()


def kv_dtype(llm_args: Any, hf: dict, kv_algo: str | None) -> str:
    """The dtype of the KV pages (see the module text)."""
    if kv_algo is not None:
        if kv_algo not in KV_QUANT_DTYPES:
            raise ConfigError(f"{SOURCE}: a KV cache quantized as {kv_algo} keeps scales beside its "
                              f"pages; the adapter stores {sorted(KV_QUANT_DTYPES)} KV caches or unquantized ones")
        return KV_QUANT_DTYPES[kv_algo]
    dtype = getattr(getattr(llm_args, "kv_cache_config", None), "dtype", None)
    if dtype in (None, "auto"):
        dtype = getattr(llm_args, "dtype", None)
    if dtype in (None, "auto"):
        dtype = hf.get("torch_dtype") or hf.get("dtype") or "bfloat16"
    return dtype_name(dtype)


def quantization_suffix(llm_args: Any, dtype: str) -> str:
    """Random weights (``load_format`` dummy: a profiling run's KV is nobody's), then
    ``+numerics-<hex>`` over what changes the K/V of the same checkpoint files when set: a
    ``quant_config`` that quantizes weights or KV (its declared fields that are set),
    ``model_kwargs`` (config overrides), ``force_dynamic_quantization`` and, when the KV pages
    (``dtype``) are quantized, the activation dtype they were quantized from, and a
    ``sparse_attention_config`` (its kind and declared fields that are set); "" for a plain
    engine."""
    quant = getattr(llm_args, "quant_config", None)
    fields: dict[str, Any] = {"model_kwargs": _declared(getattr(llm_args, "model_kwargs", None)),
                              "force_dynamic_quantization": getattr(llm_args, "force_dynamic_quantization", None) or None}
    if getattr(quant, "quant_algo", None) is not None or getattr(quant, "kv_cache_quant_algo", None) is not None:
        fields["quant_config"] = _declared(quant)
    if dtype in QUANTIZED_KV:
        fields["dtype"] = getattr(llm_args, "dtype", None)
    sparse = getattr(llm_args, "sparse_attention_config", None)
    if sparse is not None:  # (attention over chosen tokens: the K/V of every later layer follow it)
        fields["sparse_attention"] = {"kind": type(sparse).__name__, "fields": _declared(sparse)}
    return dummy_weights(getattr(llm_args, "load_format", None)) + numerics_suffix(fields)


def _declared(value: Any) -> Any:
    """A config object by its declared fields that are set (a dataclass's, or a pydantic
    model's), nested configs too: ``cached_property`` values, which land in an object's
    ``__dict__`` once read, are left out (the namespace must not follow what TensorRT-LLM has
    read of its own config)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        names = [f.name for f in dataclasses.fields(value)]
    elif isinstance(getattr(type(value), "model_fields", None), Mapping):  # pydantic (TensorRT-LLM's StrictBaseModel)
        names = list(type(value).model_fields)
    elif isinstance(value, Mapping):
        return {str(name): _declared(item) for name, item in value.items()}
    elif isinstance(value, (list, tuple)):
        return [_declared(item) for item in value]
    else:
        return getattr(value, "value", value)  # a QuantAlgo by its name
    found = {name: _declared(getattr(value, name, None)) for name in names}
    return {name: item for name, item in found.items() if item not in (None, False, [], (), {})}


def _hf_quant_config(llm_args: Any) -> dict:
    """A ModelOpt checkpoint's ``hf_quant_config.json`` (empty when there is none)."""
    directory = model_dir(llm_args)
    path = Path(directory) / "hf_quant_config.json" if directory else None
    if path is None or not path.is_file():
        return {}
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{SOURCE}: cannot read {path}: {exc}") from None
    return found if isinstance(found, dict) else {}


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


def one_group(groups: Sequence, request_id: Any, call: str) -> list[int]:
    """The block ids of the one layer group the adapter follows."""
    if len(groups) != 1:
        raise ConfigError(f"{SOURCE}: TensorRT-LLM called {call} for request {request_id} with "
                          f"{len(groups)} KV layer groups (one per attention window): {WINDOWED}")
    return list(groups[0])


def pages(block_ids: Sequence[int], request_id: Any, call: str) -> None:
    """A block without a page (``-1``, behind a window) would index the pool's last page."""
    missing = [i for i, b in enumerate(block_ids) if b < 0]
    if missing:
        raise ConfigError(f"{SOURCE}: {call} for request {request_id}: blocks {missing} have no page "
                          f"(-1), so the KV cache runs an attention window: {WINDOWED}")


def target_pool(llm_args: Any, pool: Any, namespace: Namespace) -> Any:
    """``pool`` (``[blocks, layers, 2, block elements]``), checked; a pool with more layers than
    the model under a ``speculative_config`` is refused by name: one-model speculative decoding
    (MTP, EAGLE3 one-model) puts its draft layers in the target's KV pool, whose blocks then hold
    KV no config.json layer count names (keyed as the model's, other engines would read the
    draft's layers as its own)."""
    shape = tuple(getattr(pool, "shape", ()))
    spec = getattr(llm_args, "speculative_config", None)
    if spec is None or len(shape) < 2 or shape[1] <= namespace.num_layers:
        return pool  # (any other shape mismatch is named by the layout check)
    kind = getattr(spec, "decoding_type", None) or type(spec).__name__
    raise ConfigError(f"{SOURCE}: the KV pool has {shape[1]} layers, the model {namespace.num_layers}: the "
                      f"{shape[1] - namespace.num_layers} more are draft layers of one-model speculative "
                      f"decoding (speculative_config: {kind}; MTP or EAGLE3 one-model keep them in the "
                      "target's pool), which the adapter does not store: run the engine without that "
                      "speculative_config to use tiered-kv, or without the tiered-kv connector")
