"""What the TensorRT-LLM adapter reads of an ``LlmRequest``: its prompt and what, beside the
token ids, changes the KV they compute (folded into every key of the request).

- ``cache_salt_id``: the tenant's salt (also the request's tenant, for quotas and usage);
- ``lora_task_id`` and the fingerprint of the adapter's files (:func:`lora_fingerprint`): a LoRA
  request nothing names the weights of (no path, weights handed as tensors, or files other than
  those its task id was first loaded from: the engine computes with the first) has no view;
- multimodal inputs: TensorRT-LLM puts placeholder ids in the prompt where an image's
  embeddings go (the same ids for every image), and names the images by
  ``multimodal_hashes`` (one per item, over its content and any UUID, at
  ``multimodal_positions`` for ``multimodal_lengths`` tokens), as its own block keys do.

With beam search (a beam width above one, :func:`beams`), only the prompt's blocks are saved:
its generated tokens are beam 0's as they stand (earlier ones may be rewritten when the beams are
reordered) and its later blocks hold what each beam wrote, which the cache indirection mixes
across beams, so keys of beam 0's tokens would name KV no single sequence computed.

The parts are joined unambiguously (:func:`tiered_kv.keys.key_extra`). A request whose KV its
token ids and these parts do not name (:func:`unkeyed`: media without hashes, a prompt-tuning
table, an encoder input, position ids of its own, a LoRA adapter without files) has no view: it
is neither loaded nor saved.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Any

from tiered_kv.errors import TokenError
from tiered_kv.fingerprint import LORA_FINGERPRINTS
from tiered_kv.integrations.common import RequestView
from tiered_kv.keys import key_extra

log = logging.getLogger(__name__)

# TensorRT-LLM keeps the FIRST weights it loaded for a task id for the life of the process:
# ``LoraManager.load_from_hf`` skips a uid it already holds, and ``PeftCacheManager.add_request_peft``
# reloads an adapter its cache evicted from that same memo (never from the request's new path), while
# a request sent with tensors is served the cached weights when its task is cached. So a task id is
# bound here to what its first request named, for the life of the process (a restart starts afresh).
_LORA_BOUND = 8192  # task ids remembered (an LRU: the engine holds every adapter's weights, far fewer)
_FORGOTTEN_BITS = 1 << 20  # marks of task ids the LRU dropped (128 KiB; a collision only refuses)
_lora_files: OrderedDict[Any, str | None] = OrderedDict()  # task id -> fingerprint of its first files
# (None: its first weights were named by nothing: tensors, no path, a path without weight files)
_forgotten = bytearray(_FORGOTTEN_BITS // 8)  # task ids dropped from _lora_files, by hash
_lora_refused: OrderedDict[Any, None] = OrderedDict()  # task ids warned about (once each; bounded)
_lora_lock = threading.Lock()


def request_view(request: Any) -> RequestView | None:
    """The connector core's view of ``request`` (prompt tokens, key extra, tenant); None for a
    request :func:`unkeyed` names a reason for."""
    if unkeyed(request) is not None:
        return None
    n = int(request.prompt_len)
    tokens = list(request.get_tokens(0))[:n]
    parts = []
    for name in ("cache_salt_id", "lora_task_id"):
        value = getattr(request, name, None)
        if value is not None:
            parts.append((name, value))
    try:
        files = lora_fingerprint(request)
    except TokenError:  # (unkeyed found it named; its files were rewritten since)
        return None
    if files:
        parts.append(("lora_files", files))
    media = multimodal(request)
    if media:
        parts.append(("mm", media))
    salt = getattr(request, "cache_salt_id", None)
    return RequestView(request.request_id, tokens, n, key_extra(parts),
                       None if salt is None else f"cache_salt_id={salt}")


def unkeyed(request: Any) -> str | None:
    """Why the KV of ``request`` is not named by its token ids and key extra (None: it is).
    Placeholder ids past the vocabulary read a prompt-tuning table of the request's own; media
    without hashes (none were computed) are not named at all; a decoder's KV attends to its
    encoder input; position ids of its own (a rank's slice of a context-parallel prompt) move
    every token. Keyed by their ids alone, another such request got this one's KV."""
    if _given(request, "prompt_embedding_table"):
        return "it reads a prompt-tuning table (prompt_embedding_table)"
    if not getattr(request, "multimodal_hashes", None) and (
            getattr(request, "multimodal_positions", None) or getattr(request, "multimodal_lengths", None)
            or getattr(request, "py_multimodal_data", None) or _given(request, "multimodal_embedding")):
        return "its multimodal inputs have no content hashes"
    if _given(request, "encoder_tokens") or _given(request, "py_encoder_input_features"):
        return "its decoder KV attends to an encoder input"
    if _given(request, "position_ids"):
        return "it has position ids of its own"
    try:
        lora_fingerprint(request)
    except TokenError as exc:
        return str(exc)
    return None


def beams(request: Any) -> int:
    """The most beams ``request`` searches with (``sampling_config.beam_width``, or the largest
    of a variable beam width's ``beam_width_array``); 1 when it says none."""
    config = getattr(request, "sampling_config", None)
    widths = [getattr(config, "beam_width", None) or 1, *(getattr(config, "beam_width_array", None) or ())]
    return max(int(w) for w in widths)


def _given(request: Any, name: str) -> bool:
    return getattr(request, name, None) is not None


def multimodal(request: Any) -> str | None:
    """The images (or other media) of a multimodal request, by hash, position and length; None
    for a text-only request."""
    hashes = getattr(request, "multimodal_hashes", None)
    if not hashes:
        return None
    positions = list(getattr(request, "multimodal_positions", None) or ())
    lengths = list(getattr(request, "multimodal_lengths", None) or ())
    items = zip(hashes, positions + [""] * len(hashes), lengths + [""] * len(hashes))
    return ",".join(f"{'-'.join(map(str, h))}@{p}+{n}" for h, p, n in items)


def lora_fingerprint(request: Any) -> str | None:
    """Fingerprint of the files of the LoRA adapter of ``request`` (None without one).

    The task id alone names nothing outside this process: another process (another replica, a
    restart) may load other weights under the same id, and keyed by it they shared blocks. So
    the adapter is named by its files: ``py_lora_path``, which TensorRT-LLM's LLM API sets on
    every request of a ``LoRARequest`` (its ``lora_path``; ``lora_name`` never reaches the
    request), or, for a request without one, the files this process first loaded that task id
    from (a request sent to the executor with a bare task id reuses the adapter loaded then).
    Raises TokenError (warned once per task id) when nothing names the weights the engine
    computes with: no path, a path with no weight files, weights handed as tensors, or files
    other than those the task id was first loaded from (the engine still computes with those)."""
    task = getattr(request, "lora_task_id", None)
    if task is None:
        return None
    path = getattr(request, "py_lora_path", None)
    files = LORA_FINGERPRINTS.get(path) if path else None
    with _lora_lock:
        forgot = False
        if task in _lora_files:
            first = _lora_files[task]
            _lora_files.move_to_end(task)
        else:
            # Dropped from the memo: what the engine holds for it is unknown now, so it is refused
            # rather than bound afresh to whatever this request names.
            forgot = _forgotten_mark(task)
            first = files if path and not forgot else None  # (the engine loads what this one names)
            _bind(task, first)
        if first is not None and (files == first if path else not _given(request, "lora_weights")):
            return first
        warn = task not in _lora_refused
        _remember(_lora_refused, task, None)
    if forgot:
        why = "this process no longer remembers what it first loaded that task id from"
    elif path and files is None:
        why = f"its path {path!r} holds no weight files to fingerprint"
    elif path:
        # Refused, not keyed by the first files: those are what the engine computes with today,
        # but that rests on our first sighting being its first load (the LLM API loads at
        # submission, requests reach us in scheduling order) and on its memo never reloading
        # from a new path; refusing is never wrong and costs only a misconfigured task id's hits.
        why = (f"its files at {path!r} are not what this process first loaded that task id from, and "
               "TensorRT-LLM keeps computing with those (restart, or use a new task id, to serve these)")
    elif _given(request, "lora_weights"):
        why = "its weights came as tensors, without a path"
    else:
        why = "it came without a path and this process loaded no files for that task id"
    reason = f"LoRA task {task}: {why}, so nothing names its weights beyond the task id"
    if warn:
        log.warning("tiered-kv: %s (another process's adapter under that id would share its blocks); "
                    "its requests are neither loaded nor saved: give the adapter by a local path "
                    "(LoRARequest.lora_path)", reason)
    raise TokenError(reason)


def _bind(task: Any, files: str | None) -> None:
    """Binds ``task`` to the files it was first loaded from (under ``_lora_lock``)."""
    dropped = _remember(_lora_files, task, files)
    if dropped is not None:
        h = hash(dropped[0]) % _FORGOTTEN_BITS
        _forgotten[h >> 3] |= 1 << (h & 7)


def _forgotten_mark(task: Any) -> bool:
    h = hash(task) % _FORGOTTEN_BITS
    return bool(_forgotten[h >> 3] & (1 << (h & 7)))


def _remember(memo: OrderedDict, key: Any, value: Any) -> tuple | None:
    """Puts ``key`` last in the bounded LRU ``memo``; the entry it dropped, if any."""
    memo[key] = value
    memo.move_to_end(key)
    return memo.popitem(last=False) if len(memo) > _LORA_BOUND else None
