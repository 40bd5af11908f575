"""Persistence across processes with SGLang's own radix cache: a producer process fills L3
through a real ``UnifiedRadixCache`` (HiCache on, ``dynamic`` backend) and exits; a consumer
process on the same storage prefetches the sequence, loads it to the device, and gets the
producer's KV bit for bit. Both sides are driven by SGLang's radix-cache test kit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.sglang

PAGE_SIZE = 4
REPO = Path(__file__).resolve().parents[3]


def _run(phase: str, settings_file: Path) -> dict:
    proc = subprocess.run([sys.executable, "-m", "tests.integrations.sglang_real.radix_roles", phase,
                           str(settings_file)], cwd=REPO, capture_output=True, text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"{phase} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(lines[-1][len("RESULT "):])


# Each case is two fresh Python processes importing SGLang (~15 s each), so the layouts here are
# the two extremes; test_controller_roundtrip covers every layout in-process. Only wait_complete:
# under best_effort the scheduler cuts a prefetch at its first poll, so how much arrives depends
# on thread timing (the kit's pump polls at once), which a scenario must not assert on.
@pytest.mark.parametrize("layout,interface_v1,prefetch_policy", [
    pytest.param("layer_first", False, "wait_complete", id="layer_first-v0-wait_complete"),
    pytest.param("page_head", False, "wait_complete", id="page_head-v0-wait_complete"),
    pytest.param("layer_first", True, "wait_complete", id="layer_first-v1-wait_complete"),
    pytest.param("page_head", True, "wait_complete", id="page_head-v1-wait_complete"),
])
def test_a_new_process_reads_back_what_another_process_stored(backend_spec, tmp_path, layout,
                                                             interface_v1, prefetch_policy):
    if interface_v1 and not backend_spec.has_v1:
        pytest.skip(f"{backend_spec.class_name} implements only the v0 interface (no batch_get_v1)")
    tokens = list(range(1, 1 + 6 * PAGE_SIZE))
    settings = {"backend": backend_spec.id, "storage_dir": str(tmp_path / "store"), "page_size": PAGE_SIZE,
                "layout": layout, "interface_v1": interface_v1, "prefetch_policy": prefetch_policy,
                "write_policy": "write_through", "tokens": tokens, "expected": str(tmp_path / "expected.pt")}
    settings_file = tmp_path / "settings.json"
    settings_file.write_text(json.dumps(settings))

    produced = _run("produce", settings_file)
    assert produced == {"stored_pages": 6, "pages": 6}

    consumed = _run("consume", settings_file)
    assert (consumed["device_before"], consumed["host_before"]) == (0, 0)
    assert consumed["host_hit"] == len(tokens)
    assert consumed["loaded_tokens"] == len(tokens)
    assert consumed["bit_exact"]
