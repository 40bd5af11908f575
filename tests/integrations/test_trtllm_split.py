"""The TensorRT-LLM adapter's modules load no torch: TensorRT-LLM imports the connector module by
name (``KvCacheConnectorConfig.connector_module``) and the request and model readers run on the
scheduler's path. Torch is loaded by the worker half (and the store) only when they are built."""

from __future__ import annotations

import subprocess
import sys


def test_importing_the_adapter_and_reading_a_request_loads_no_torch():
    code = (
        "import sys\n"
        "from types import SimpleNamespace\n"
        "import tiered_kv.integrations.trtllm\n"
        "from tiered_kv.integrations.trtllm_requests import request_view\n"
        "view = request_view(SimpleNamespace(request_id=1, prompt_len=2, get_tokens=lambda b: [5, 6],\n"
        "                                    cache_salt_id=3, multimodal_hashes=[[1] * 8],\n"
        "                                    multimodal_positions=[0], multimodal_lengths=[2]))\n"
        "assert view.key_extra == 'cache_salt_id=3;mm=1-1-1-1-1-1-1-1@0+2', view\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
