"""SGLang HiCache pages as tiered-kv blocks: the namespace a host pool's pages are stored under,
and the key of each page.

A stored block is one page in the byte order SGLang's own flat data page has for the pool's host
layout (``get_data_page(index, flat=True)``: every K part, then every V part, in the layout's
order; MLA pages have one latent part). That order differs between layouts, so the layout, the
pool kind (MHA, MLA) and every page geometry figure are folded into the namespace's ``layout``
field: a page written under one layout is never found under another. TP rank and size go into
the namespace for MHA pools (each rank holds its heads); MLA pages are identical on every rank
and are stored once (rank 0 of 1). Pipeline stages (by rank and first layer: servers with other
layer partitions give one stage other layers), attention context-parallel and DCP shards hold
different bytes and are named in the layout too.

The namespace's block shape ``[L, 2, page_size, 1, d]`` only sizes the block (``d`` = the page's
elements / (2 L page_size)); the real geometry is the one named in ``layout``. SGLang's keys are
its own chained page hashes (sha256 over the page tokens, seeded by ``extra_key`` and
``cache_salt``): a page key is 16 bytes of the namespace's hash of that string.

The model is the checkpoint (``--model-path``: a hub id as given, a local directory by its own
name), not SGLang's storage model name: that is ``--served-model-name``, a label servers of other
checkpoints may share. The revision names what the pages' bytes follow beyond the checkpoint's
name and the pool: the operator's revision (else the server's ``--revision`` and a fingerprint of
a local model directory's weight files) and the server arguments that change the K/V the
checkpoint computes for the same tokens (:data:`NUMERICS`), read from SGLang's server args.

The namespace is fixed when SGLang attaches the backend. Weights updated in place at run time
(``update_weights_from_disk`` / ``_from_tensor`` / ``_from_distributed``, a new
``weight_version``) do not change it, and SGLang's cache flush after an update leaves L3 as it
is: clear the storage then (``POST /hicache/storage-backend/clear``).

Scheduler-free and torch-free: the pool is read through its attributes only.
"""

from __future__ import annotations

import importlib
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tiered_kv.dtypes import dtype_name, itemsize
from tiered_kv.errors import ConfigError
from tiered_kv.fingerprint import files_fingerprint, fold_weights, local_model, model_name
from tiered_kv.integrations.numerics import dummy_weights, numerics_suffix, quantized_kv
from tiered_kv.keys import Namespace

log = logging.getLogger(__name__)

# ServerArgs fields that change the K/V a checkpoint computes for the same tokens beyond its name
# and the host pool's dtype: weights quantized as they load (``--quantization fp8`` of a bf16
# checkpoint, ModelOpt, a FlashRL profile), a ModelOpt checkpoint loaded instead, config overrides
# (RoPE scaling is applied to K before it is cached), the KV cache format (fp8 pools are uint8 on
# the host: e4m3 and e5m2 pages look alike) and its scales. Folded into the revision when set.
NUMERICS = ("quantization", "modelopt_quant", "modelopt_checkpoint_restore_path", "rl_quant_profile",
            "json_model_override_args", "kv_cache_dtype", "quantization_param_path")
QUANTIZING_LOADS = ("bitsandbytes",)  # load formats that quantize the weights as they load
# speculative algorithms without a draft model (no draft layers in the pages)
DRAFTLESS = ("NGRAM", "NONE")
# where a running server publishes its ServerArgs: SGLang 0.5.23, then earlier releases
SERVER_ARGS_SOURCES = (("sglang.srt.runtime_context", "get_server_args"),
                       ("sglang.srt.server_args", "get_global_server_args"))


@dataclass(frozen=True)
class PageGeometry:
    """What SGLang's host pool says about one page."""

    kind: str  # "mha" or "mla"
    layout: str  # SGLang host layout: layer_first, page_first, page_first_direct, page_head
    dtype: str  # element dtype name, e.g. "bfloat16"
    page_size: int  # tokens per page
    layer_num: int  # layers a page carries
    page_elements: int  # elements in one flat data page
    detail: str  # the per-token shape, e.g. "heads=8,head_dim=128,v_head_dim=128" or "kv_dim=576"
    first_layer: int | None = None  # the model layer the pages start at (a pipeline stage's first)

    @property
    def page_bytes(self) -> int:
        return self.page_elements * itemsize(self.dtype)


def geometry_of(pool: Any, *, mla: bool) -> PageGeometry:
    """The geometry of ``pool`` (an SGLang host KV pool; ``mla`` as SGLang's storage config says).
    A page is what the pool's own flat data page holds; a pool whose pages we cannot read and
    write that way (K-only index pools, ``page_unified`` / ``page_first_kv_split`` layouts) is
    refused with ConfigError when it is registered."""
    dtype = dtype_name(pool.dtype)
    itemsize(dtype)  # a dtype we cannot store is refused here
    layout = str(pool.layout)
    page_size, layer_num = int(pool.page_size), int(pool.layer_num)
    try:
        elements = int(pool.get_dummy_flat_data_page().numel())
        view = pool.get_data_page(0, flat=False)
    except Exception as exc:
        raise ConfigError(f"tiered-kv cannot store the pages of SGLang's {type(pool).__name__} with "
                          f"host layout {layout!r}: {exc}") from None
    if elements <= 0 or layer_num <= 0:  # DeepSeek-V4's logical anchor: its KV is in extra pools
        raise ConfigError(f"SGLang's {type(pool).__name__} holds no KV pages of its own (the model's KV "
                          "is in extra host pools): tiered-kv cannot store this model's pages yet")
    if int(view.numel()) != elements:
        raise ConfigError(f"SGLang's {type(pool).__name__} ({layout}) has pages of {view.numel()} "
                          f"elements but flat pages of {elements}: not a layout tiered-kv can store")
    if mla:
        kind = "mla"
        kv_dim = getattr(pool, "kv_cache_dim", None)
        detail = f"kv_dim={kv_dim},kv_lora_rank={getattr(pool, 'kv_lora_rank', None)}," \
                 f"rope={getattr(pool, 'qk_rope_head_dim', None)}"
    else:
        kind = "mha"
        detail = (f"heads={getattr(pool, 'head_num', None)},head_dim={getattr(pool, 'head_dim', None)},"
                  f"v_head_dim={getattr(pool, 'v_head_dim', None)}")
    tag = getattr(pool, "storage_format_tag", None)
    if tag:  # a pool with a page format of its own (SGLang keys its storage by it too)
        detail += f",format={tag}"
    first = getattr(pool, "start_layer", None)
    return PageGeometry(kind, layout, dtype, page_size, layer_num, elements, detail,
                        None if first is None else int(first))


def page_namespace(geometry: PageGeometry, storage_config: Any, *, model_id: str | None = None,
                   revision: str = "", hash_algo: str = "xxh3_128") -> Namespace:
    """The namespace of ``geometry``'s pages for the rank ``storage_config``
    (SGLang's ``HiCacheStorageConfig``) describes; ``model_id`` names the checkpoint
    (:func:`checkpoint_of`), else SGLang's storage model name (the served name) does."""
    model = model_id or getattr(storage_config, "model_name", None)
    if not model:
        raise ConfigError("SGLang did not name the model (HiCacheStorageConfig.model_name); "
                          "give tiered-kv a model_id in the storage backend's extra config")
    g = geometry
    per_part = 2 * g.layer_num * g.page_size
    if g.page_elements % per_part:
        raise ConfigError(f"an SGLang page of {g.page_elements} elements ({g.detail}) does not split "
                          f"into K/V halves of {g.layer_num} layers x {g.page_size} tokens")
    mla = g.kind == "mla"
    shard = [f"pp={_int(storage_config, 'pp_rank', 0)}/{_int(storage_config, 'pp_size', 1)}"]
    if _int(storage_config, "pp_size", 1) > 1:  # a stage's layers follow the partition, not the rank
        if g.first_layer is None:  # (SGLANG_PP_LAYER_PARTITION, SGLang's default split)
            raise ConfigError("SGLang's host pool does not say which model layer this pipeline stage "
                              "starts at (start_layer): its pages cannot be told from another split's")
        shard[0] += f",first_layer={g.first_layer}"
    if _int(storage_config, "attn_cp_size", 1) > 1:
        shard.append(f"attn_cp={storage_config.attn_cp_rank}/{storage_config.attn_cp_size}")
    if _int(storage_config, "dcp_size", 1) > 1:
        shard.append(f"dcp={storage_config.dcp_rank}/{storage_config.dcp_size},"
                     f"tp_size={storage_config.tp_size},logical_page={storage_config.logical_page_size}")
    layout = (f"sglang:{g.kind}:{g.layout}:layers={g.layer_num},page={g.page_size},{g.detail}:"
              + ":".join(shard))
    return Namespace(model_id=model_name(model), dtype=g.dtype, num_layers=g.layer_num, num_kv_heads=1,
                     head_dim=g.page_elements // per_part, block_size=g.page_size, revision=revision,
                     layout=layout, tp_rank=0 if mla else _int(storage_config, "tp_rank", 0),
                     tp_size=1 if mla else _int(storage_config, "tp_size", 1), hash_algo=hash_algo)


def page_key(namespace: Namespace, sglang_key: str) -> bytes:
    """Our 16-byte key of the page SGLang calls ``sglang_key`` (its chained page hash)."""
    return namespace.hasher(b"sglang-page\x00" + sglang_key.encode())


def _int(obj: Any, name: str, default: int) -> int:
    value = getattr(obj, name, None)
    return default if value is None else int(value)


def checkpoint_of(server_args: Any) -> str | None:
    """The checkpoint a server computes its KV with: ``--model-path`` (a hub id or a path; the
    ``--revision`` is folded by :func:`page_revision`); None without server args."""
    path = getattr(server_args, "model_path", None)
    return str(path) if path else None


def server_args_of(kwargs: Mapping[str, Any] | None) -> Any:
    """The ServerArgs of the SGLang server this backend serves: ``kwargs["server_args"]`` when
    the caller hands them over, else those the scheduler process published, else None (logged:
    the namespace then cannot follow ``--quantization`` and the rest of :data:`NUMERICS`)."""
    given = (kwargs or {}).get("server_args")
    if given is not None:
        return given
    installed = False
    for module, getter in SERVER_ARGS_SOURCES:
        try:
            found = getattr(importlib.import_module(module), getter)()
        except ImportError:  # SGLang not installed (tests, tools), or not this release's module
            continue
        except Exception:  # not published in this process yet, or a retired accessor
            installed = True
            continue
        if found is not None:
            return found
    if installed:
        log.warning("tiered-kv SGLang storage: SGLang's server args are not readable in this process, "
                    "so --quantization, --kv-cache-dtype and the other settings that change the KV "
                    "are not in the namespace; give servers that differ in them their own revision")
    return None


def page_revision(revision: str, server_args: Any, model: Any = None) -> str:
    """The namespace revision of a server's pages: ``revision`` (the operator's), else the
    server's ``--revision`` plus a fingerprint of the weight files when the model (``--model-path``,
    else ``model``: SGLang's storage model name) is a local directory (weights replaced in place
    change it, as for vLLM and TensorRT-LLM); then dummy weights and the :data:`NUMERICS` that
    are set, the activation dtype under a KV dtype of its own, a decrypted config file by its
    content and a speculative draft (:func:`_draft`) (none set, or no server args: nothing more)."""
    if not revision:
        local = getattr(server_args, "model_path", None) or model
        revision = fold_weights(str(getattr(server_args, "revision", None) or ""), local,
                                cache_dir=getattr(server_args, "download_dir", None))
    if server_args is None:
        return revision
    fields = {name: getattr(server_args, name, None) for name in NUMERICS}
    fields["json_model_override_args"] = _json_value(fields["json_model_override_args"])  # "{}": unset
    load_format = getattr(server_args, "load_format", None)
    if load_format in QUANTIZING_LOADS:
        fields["load_format"] = load_format
    dtype = getattr(server_args, "dtype", None)
    if quantized_kv(fields["kv_cache_dtype"]):  # the activation dtype the KV was quantized from
        fields["dtype"] = dtype
    elif _float_kv_of_other_dtype(fields["kv_cache_dtype"], dtype):  # ("auto" would count as unset)
        fields["dtype"] = "checkpoint" if dtype in (None, "", "auto") else dtype
    fields["decrypted_config"] = _file_named(getattr(server_args, "decrypted_config_file", None))
    fields["draft"] = _draft(server_args)
    return revision + dummy_weights(load_format) + numerics_suffix(fields)


def _float_kv_of_other_dtype(cache_dtype: Any, dtype: Any) -> bool:
    """Whether a float KV dtype is set other than the activations' (``--dtype float16
    --kv-cache-dtype bf16`` rounds fp16 K/V into a bf16 pool: other bytes than a bf16 server's
    in the same pool; ``auto`` activations, the checkpoint's dtype, may be either)."""
    if cache_dtype in (None, "", "auto"):
        return False
    return dtype_name(str(cache_dtype)) != dtype_name(str(dtype or "auto"))


def _file_named(path: Any) -> Any:
    """A config file by its content (a local file edited in place is another config), else by
    its path."""
    local = local_model(path)
    return (files_fingerprint(local) or str(path)) if local is not None else path


def _draft(server_args: Any) -> dict | None:
    """A speculative draft's settings when the server runs one: SGLang 0.5.23 packs MTP draft
    layers into the target's host pages (``HiCacheDraftMode.PACKED``, and page envelopes that
    carry every draft layer), so the draft checkpoint's weights (a local directory's files, a
    hub id's cached commit), its quantization and KV dtype are part of what a page holds. None
    without a speculative algorithm, or one without a draft model (NGRAM)."""
    algorithm = getattr(server_args, "speculative_algorithm", None)
    if not algorithm or str(algorithm).upper() in DRAFTLESS:
        return None
    path = getattr(server_args, "speculative_draft_model_path", None)
    revision = str(getattr(server_args, "speculative_draft_model_revision", None) or "")
    own = path and path != getattr(server_args, "model_path", None)  # (else the target's files name it)
    return {"algorithm": str(algorithm).upper(),
            "model": model_name(path) if own else None,
            "weights": fold_weights(revision, path, cache_dir=getattr(server_args, "download_dir", None))
            if own else revision or None,
            "quantization": getattr(server_args, "speculative_draft_model_quantization", None),
            "kv_cache_dtype": getattr(server_args, "speculative_draft_kv_cache_dtype", None),
            "load_format": dummy_weights(getattr(server_args, "speculative_draft_load_format", None)) or None,
            "config": _file_named(getattr(server_args, "decrypted_draft_config_file", None))}


def _json_value(value: Any) -> Any:
    """A JSON-text setting by its content (spacing and key order do not split namespaces)."""
    if not isinstance(value, str) or not value.strip():
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value
