#!/usr/bin/env bash
# Real-engine check: SGLang 0.5.23's own HiCache code driving an L3 storage backend on this
# machine's CPU.
#
# Creates (or reuses) a separate venv .venv-sglang: the CPU torch wheel, `sglang==0.5.23` without
# its dependencies (most are CUDA-only), the handful of packages SGLang's imports need on the
# HiCache path, and tiered-kv itself (editable). SGLang also imports a few packages that have no
# CPU build or are not needed here (sgl_kernel, torchvision, datasets): small stand-in modules
# for them (tools/sglang_stubs.py) are copied to $VENV/sglang-stubs and imported by a .pth file,
# never into the repository's packages. Then runs the opt-in tests (`pytest -m sglang tests/integrations/sglang_real`):
# SGLang's storage factory (`dynamic`), its HiCacheController over real MHA/MLA host pools for
# every host layout x storage interface v0/v1 x bf16/fp16, and its radix-cache test kit with a
# producer and a consumer in separate processes on one storage directory (every write policy and
# prefetch policy), or on their own disks sharing one Redis (needs `redis-server` on PATH; those
# scenarios are skipped without it).
#
#   tools/check_sglang.sh              # set up if needed, then run the tests
#   tools/check_sglang.sh -k mla       # extra arguments go to pytest
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${TIERED_KV_SGLANG_VENV:-.venv-sglang}
unset TIERED_KV_SGLANG_VENV  # (not a store setting: the tests' configs read TIERED_KV_* variables)
PY=${PYTHON:-python3}
STAMP="$VENV/.installed"
STUBS="$VENV/sglang-stubs"

# What SGLang 0.5.23 imports on the HiCache / radix-cache path, beyond torch (pinned: checked).
SGLANG_DEPS=(
    'apache-tvm-ffi==0.1.11' 'transformers==5.19.0' 'tokenizers==0.23.2' 'sentencepiece==0.2.1'
    'compressed-tensors==0.18.0' 'openai==2.8.0' 'triton==3.9.0' 'dill==0.4.1' 'gguf==0.19.0'
    'partial-json-parser==0.2.1.1.post7' 'numpy==2.4.6' 'orjson==3.13.0' 'psutil==7.2.2'
    'pybase64==1.5.1' 'requests==2.34.2' 'packaging==26.3' 'pillow==13.0.0' 'msgspec==0.22.0'
    'pydantic==2.14.3' 'pyzmq==27.3.0' 'tqdm==4.70.1' 'aiohttp==3.14.5' 'fastapi==0.165.0'
    'uvicorn==0.54.0' 'uvloop==0.23.0' 'setproctitle==1.3.8' 'einops==0.8.2'
    'huggingface_hub==1.33.0' 'safetensors==0.8.0' 'ipython==9.18.1'
)

write_stubs() {
    # Stand-ins for sgl_kernel (CUDA-only), torchvision and datasets, outside the repository's
    # packages: a module in $STUBS imported at start-up by a .pth file (see tools/sglang_stubs.py).
    mkdir -p "$STUBS"
    cp tools/sglang_stubs.py "$STUBS/tiered_kv_sglang_stubs.py"
    local site
    site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    printf '%s\nimport tiered_kv_sglang_stubs\n' "$(cd "$STUBS" && pwd)" >"$site/tiered_kv_sglang_stubs.pth"
}

if [ ! -f "$STAMP" ] || [ pyproject.toml -nt "$STAMP" ] || [ "$0" -nt "$STAMP" ] ||
    [ tools/sglang_stubs.py -nt "$STAMP" ]; then
    echo "setting up $VENV (sglang 0.5.23 --no-deps + torch 2.13.0 CPU)" >&2
    test -x "$VENV/bin/python" || "$PY" -m venv "$VENV"
    "$VENV/bin/pip" install -q --upgrade pip
    "$VENV/bin/pip" install -q 'torch==2.13.0'
    "$VENV/bin/pip" install -q --no-deps 'sglang==0.5.23'
    "$VENV/bin/pip" install -q "${SGLANG_DEPS[@]}" 'torch==2.13.0'
    "$VENV/bin/pip" install -q -e '.[dev]'
    write_stubs
    "$VENV/bin/python" -c 'import sglang.test.kits.unified_radix_cache.storage' >/dev/null
    touch "$STAMP"
fi

exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider -m sglang tests/integrations/sglang_real "$@"
