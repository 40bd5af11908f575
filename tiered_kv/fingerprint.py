"""Fingerprints of weight files, so a persistent store never serves KV computed with other weights.

A fingerprint hashes the names, sizes and modification times (ns) of a directory's weight files
(``*.safetensors``, ``*.bin``, ``*.pt``, ``*.pth``, ``*.gguf``, ``*.engine``) and the *contents*
of its small JSON files (index files, ``config.json``, ``adapter_config.json``, and the
quantization settings ``hf_quant_config.json`` and ``quantize_config.json``, which say how the
weights and the KV cache are quantized: an FP8 KV cache is switched there) and of its Python
files (a model's own modeling code, run with ``trust_remote_code``): replacing a
model's or a LoRA adapter's weights in place (a new download, a fine-tune written over the old
one) changes it without reading a byte of the weights, so computing one is cheap even for a
large checkpoint, while a tool that rewrites an unchanged ``config.json`` does not. Replicas
whose weight files have other mtimes (copied without ``-p``) get other namespaces: set
``model_revision`` to share one store between them. Scheduler-side code uses it: no torch here.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from pathlib import Path

import xxhash

log = logging.getLogger(__name__)

WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf", "*.engine", "*.index.json",
                   "config.json", "adapter_config.json", "hf_quant_config.json", "quantize_config.json",
                   "params.json",  # (a Mistral-format checkpoint's config: vLLM reads it for config.json)
                   "preprocessor_config.json", "processor_config.json",  # (how media become embeddings)
                   "*.py")  # (a model's own code, run with trust_remote_code: it computes the K/V)
CONTENT_HASHED = (".json", ".py")  # small files of these kinds are fingerprinted by content
CONTENT_HASHED_BYTES = 1 << 20  # files of those kinds up to this size are fingerprinted by content
LORA_RECHECK_S = 1.0  # a LoRA path's files are stat'ed again at most this often
HEX40 = re.compile(r"[0-9a-f]{40}")  # a full git commit hash (what the hub cache's refs hold)


def weight_files(directory: str | os.PathLike) -> list[Path]:
    """The weight and config files of ``directory`` (not recursive), sorted by name."""
    root = Path(directory)
    found = {p for pattern in WEIGHT_PATTERNS for p in root.glob(pattern) if p.is_file()}
    return sorted(found)


def files_fingerprint(path: str | os.PathLike) -> str | None:
    """``"files-<hex>"`` over the names, sizes and mtimes of the weight files at ``path`` (a
    directory, or one file); None when ``path`` is not local or holds no weight file."""
    target = Path(path)
    try:
        files = weight_files(target) if target.is_dir() else [target] if target.is_file() else []
    except OSError:
        return None
    digest = xxhash.xxh3_128()
    seen = 0
    for file in files:
        try:
            st = file.stat()
        except OSError:  # removed while we looked: the next look sees the new set
            continue
        if file.suffix in CONTENT_HASHED and st.st_size <= CONTENT_HASHED_BYTES:
            try:
                digest.update(f"{file.name}\0".encode() + file.read_bytes() + b"\n")
            except OSError:
                continue
        else:
            digest.update(f"{file.name}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
        seen += 1
    return f"files-{digest.hexdigest()[:24]}" if seen else None


def local_model(name: object) -> Path | None:
    """``name`` as an existing local directory or file (a GGUF checkpoint), or None (a hub id, a
    URL, nothing)."""
    if not name:
        return None
    try:
        path = Path(str(name)).expanduser()
        return path if path.is_dir() or path.is_file() else None
    except (OSError, ValueError):
        return None


def model_name(model: object) -> str:
    """What a namespace calls ``model``: a local directory (or GGUF file) by its own name (replicas keep their
    copies at other paths, ``/mnt/a/llama-3-8b`` and ``/models/llama-3-8b``, and share one store;
    the weights are named by the revision: :func:`fold_weights` or ``model_revision``), anything
    else (a hub id) as given."""
    directory = local_model(model)
    if directory is None:
        return str(model)
    return directory.resolve().name or str(model)


def fold_weights(revision: str, model: object, *, cache_dir: object = None) -> str:
    """``revision`` with the fingerprint of ``model``'s weight files when it is a local directory
    (or one file: a GGUF checkpoint);
    for a hub id, the commit the Hugging Face cache (``cache_dir``, else the environment's)
    resolves ``revision`` (none: ``main``) to, in its place: a branch names other weights once
    it moves, so replicas that downloaded ``main`` before and after an update must not share KV
    (and ``main``, none and that commit itself name the same weights). Unresolved: ``revision``."""
    directory = local_model(model)
    if directory is None:
        commit = hub_commit(model, revision, cache_dir)
        if commit is None:
            if model and not revision:
                log.info("tiered-kv: %s is not in the Hugging Face cache; its KV is named by the model id "
                         "alone (set model_revision to name the weights)", model)
            return revision
        return commit
    fingerprint = files_fingerprint(directory)
    if fingerprint is None:
        return revision
    log.info("tiered-kv: weights of %s fingerprinted as %s", directory, fingerprint)
    return f"{revision}+{fingerprint}" if revision else fingerprint


def hub_cache(cache_dir: object = None) -> Path:
    """The Hugging Face hub cache: ``cache_dir`` (an engine's ``download_dir``), else
    ``HF_HUB_CACHE``, else ``HUGGINGFACE_HUB_CACHE``, else ``$HF_HOME/hub`` (``HF_HOME``:
    ``$XDG_CACHE_HOME/huggingface``, else ``~/.cache/huggingface``), with ``~`` and ``$VAR``
    expanded, as ``huggingface_hub`` finds it."""
    if cache_dir:
        return Path(str(cache_dir)).expanduser()
    env = os.environ
    home = _expanded(env.get("HF_HOME", os.path.join(env.get("XDG_CACHE_HOME", os.path.join("~", ".cache")),
                                                     "huggingface")))
    return Path(_expanded(env.get("HF_HUB_CACHE", env.get("HUGGINGFACE_HUB_CACHE", os.path.join(home, "hub")))))


def _expanded(path: str) -> str:
    return os.path.expandvars(os.path.expanduser(path))


def hub_commit(model: object, revision: str, cache_dir: object = None) -> str | None:
    """The commit the hub cache holds for ``model`` (a hub id) at ``revision`` (a branch or tag;
    none: ``main``; a full commit hash is returned as it is), or None when it holds none."""
    name = str(model or "")
    if not name or name.startswith(("/", ".", "~")) or name.count("/") > 1 or "\\" in name:
        return None  # (a missing local path, not a hub id)
    if HEX40.fullmatch(revision or ""):
        return revision
    repo = hub_cache(cache_dir) / ("models--" + name.replace("/", "--"))
    try:
        commit = (repo / "refs" / (revision or "main")).read_text().strip()
    except (OSError, ValueError, UnicodeError):
        return None
    return commit if HEX40.fullmatch(commit) and (repo / "snapshots" / commit).is_dir() else None


class PathFingerprints:
    """Fingerprints of LoRA adapter paths for the scheduler's per-request key extras.

    Cheap per call: a path's files are stat'ed at most once per ``recheck_s``; in between the
    cached fingerprint is served without touching the filesystem. A path replaced in place is
    seen at the first call after that interval (vLLM itself keeps a loaded adapter in memory
    until it evicts it, so a swap within a second is not served by vLLM either)."""

    def __init__(self, recheck_s: float = LORA_RECHECK_S, clock=time.monotonic) -> None:
        self.recheck_s, self.clock = recheck_s, clock
        self._cache: dict[str, tuple[float, str | None]] = {}  # path -> (checked at, fingerprint)
        self._lock = threading.Lock()

    def get(self, path: object) -> str | None:
        key = str(path)
        now = self.clock()
        with self._lock:
            entry = self._cache.get(key)
        if entry is not None and now - entry[0] < self.recheck_s:
            return entry[1]
        fingerprint = files_fingerprint(key)
        with self._lock:
            if len(self._cache) > 4096:  # adapters come and go: keep the memo bounded
                self._cache.clear()
            self._cache[key] = (now, fingerprint)
        return fingerprint


LORA_FINGERPRINTS = PathFingerprints()
