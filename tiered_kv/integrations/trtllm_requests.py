"""What the TensorRT-LLM adapter reads of an ``LlmRequest``: its prompt and what, beside the
token ids, changes the KV they compute (folded into every key of the request).

- ``cache_salt_id``: the tenant's salt (also the request's tenant, for quotas and usage);
- ``lora_task_id`` and the fingerprint of the adapter's files (:func:`lora_fingerprint`);
- multimodal inputs: TensorRT-LLM puts placeholder ids in the prompt where an image's
  embeddings go (the same ids for every image), and names the images by
  ``multimodal_hashes`` (one per item, at ``multimodal_positions`` for ``multimodal_lengths``
  tokens), as its own block keys do. A multimodal request without hashes (none were computed)
  gets a mark of its own: its blocks are never another request's.
"""

from __future__ import annotations

import uuid
from typing import Any

from tiered_kv.fingerprint import LORA_FINGERPRINTS
from tiered_kv.integrations.common import RequestView

_lora_files: dict[Any, str] = {}  # lora_task_id -> fingerprint of the files it was loaded from
_RUN = uuid.uuid4().hex  # names this process's unhashed multimodal requests


def request_view(request: Any) -> RequestView:
    """The connector core's view of ``request`` (prompt tokens, key extra, tenant)."""
    n = int(request.prompt_len)
    tokens = list(request.get_tokens(0))[:n]
    parts = []
    for name in ("cache_salt_id", "lora_task_id"):
        value = getattr(request, name, None)
        if value is not None:
            parts.append(f"{name}={value}")
    files = lora_fingerprint(request)
    if files:
        parts.append(f"lora_files={files}")
    media = multimodal(request)
    if media:
        parts.append(media)
    salt = getattr(request, "cache_salt_id", None)
    return RequestView(request.request_id, tokens, n, ";".join(parts) or None,
                       None if salt is None else f"cache_salt_id={salt}")


def multimodal(request: Any) -> str | None:
    """The images (or other media) of a multimodal request, by hash, position and length; None
    for a text-only request."""
    hashes = getattr(request, "multimodal_hashes", None)
    positions = getattr(request, "multimodal_positions", None)
    lengths = getattr(request, "multimodal_lengths", None)
    if hashes:
        items = zip(hashes, list(positions or ()) + [""] * len(hashes), list(lengths or ()) + [""] * len(hashes))
        return "mm=" + ",".join(f"{'-'.join(map(str, h))}@{p}+{n}" for h, p, n in items)
    if positions or lengths or getattr(request, "py_multimodal_data", None):
        return f"mm-unhashed={_RUN}:{request.request_id}"
    return None


def lora_fingerprint(request: Any) -> str | None:
    """Fingerprint of a LoRA adapter's files. TensorRT-LLM's PyTorch backend sets
    ``py_lora_path`` only on the requests that load an adapter (the first ones for a task id in
    a process); later requests of that task id reuse what was remembered then. An adapter given
    as tensors (no path) is named by its task id alone."""
    task = getattr(request, "lora_task_id", None)
    if task is None:
        return None
    path = getattr(request, "py_lora_path", None)
    files = LORA_FINGERPRINTS.get(path) if path else None
    if files:
        _lora_files[task] = files
    return _lora_files.get(task)
