"""Persistence across processes with SGLang's own radix cache: a producer process fills L3
through a real ``UnifiedRadixCache`` (HiCache on, ``dynamic`` backend) and exits; a consumer
process on the same storage prefetches the sequence, loads it to the device, and gets the
producer's KV bit for bit. Both sides are driven by SGLang's radix-cache test kit (its backup and
L3-write helpers here; test_policies lets SGLang's write policies decide instead)."""

from __future__ import annotations

import pytest

from tests.integrations.sglang_real.backends import BACKENDS, unavailable_reason
from tests.integrations.sglang_real.role_runs import job, ok, run_phase, sequence

pytestmark = pytest.mark.sglang

# The layouts here are the two extremes; test_controller_roundtrip covers every layout
# in-process. Prefetch policy wait_complete (test_policies covers the others).
CASES = {
    "layer_first-v0": ("layer_first", False),
    "page_head-v0": ("page_head", False),
    "layer_first-v1": ("layer_first", True),
    "page_head-v1": ("page_head", True),
}
TOKENS = sequence(1, 6)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every (backend, case) produced in one process, then consumed in another."""
    root = tmp_path_factory.mktemp("persistence")
    jobs = {}
    for spec in BACKENDS:
        if unavailable_reason(spec):
            continue
        for case, (layout, v1) in CASES.items():
            if v1 and not spec.has_v1:
                continue
            name = f"{spec.id}-{case}"
            jobs[(spec.id, case)] = job(spec, root / name, layout=layout, interface_v1=v1, tokens=TOKENS,
                                        expected=root / f"{name}.pt")
    produced = run_phase("produce", list(jobs.values()), root)
    consumed = run_phase("consume", list(jobs.values()), root)
    return {key: (p, c) for key, p, c in zip(jobs, produced, consumed)}


@pytest.mark.parametrize("case", list(CASES))
def test_a_new_process_reads_back_what_another_process_stored(backend_spec, runs, case):
    if CASES[case][1] and not backend_spec.has_v1:
        pytest.skip(f"{backend_spec.class_name} implements only the v0 interface (no batch_get_v1)")
    produced, consumed = (ok(r) for r in runs[(backend_spec.id, case)])
    assert produced == {"stored_pages": 6, "pages": 6}
    assert (consumed["device_before"], consumed["host_before"]) == (0, 0)
    assert consumed["host_hit"] == len(TOKENS)
    assert consumed["loaded_tokens"] == len(TOKENS)
    assert consumed["bit_exact"]
