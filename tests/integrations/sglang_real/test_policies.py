"""SGLang's HiCache policies with each L3 backend, across processes, through its own radix cache.

Write policies (``--hicache-write-policy``): a producer process inserts a request into the radix
tree and SGLang's trigger for that policy moves the pages to host and then to L3 (radix_serve.py
says which trigger); a consumer process prefetches under ``wait_complete`` and must get the
producer's KV bit for bit.

Prefetch policies (``--hicache-storage-prefetch-policy``), on what ``write_through`` stored:
whether and when the prefetch may stop is SGLang's decision, and how much arrived by then can
depend on thread timing. What is asserted is what does not: whatever arrived is a page-aligned,
bit-exact prefix; a request admitted once its reads landed gets every page; a generous deadline
is as good as waiting.
"""

from __future__ import annotations

import pytest

from tests.integrations.sglang_real.backends import BACKENDS, unavailable_reason
from tests.integrations.sglang_real.role_runs import PAGE_SIZE, job, ok, run_phase, sequence

pytestmark = pytest.mark.sglang

TOKENS = sequence(1, 6)
# Each write policy on its own layout, so the three also spread over the host layouts.
WRITE_POLICIES = {"write_through": "page_first", "write_through_selective": "page_head",
                  "write_back": "layer_first"}
GENEROUS = {"prefetch_timeout_base": 600.0, "prefetch_timeout_per_ki_token": 60.0}
TINY = {"prefetch_timeout_base": 0.0, "prefetch_timeout_per_ki_token": 0.0}
PREFETCHES = {  # consumers of the write_through store: policy, admission, SGLang's timeout keys
    "wait_complete": ("wait_complete", "at_once", {}),
    "best_effort-admitted_at_once": ("best_effort", "at_once", {}),
    "best_effort-admitted_after_landing": ("best_effort", "after_landing", {}),
    "timeout-generous": ("timeout", "at_once", GENEROUS),
    "timeout-tiny": ("timeout", "at_once", TINY),
    "timeout-tiny-admitted_after_landing": ("timeout", "after_landing", TINY),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every backend's write-policy stores, produced in one process; then every consumer (one
    per write policy, one per prefetch case) in another."""
    root = tmp_path_factory.mktemp("policies")
    stores, consumers = {}, {}
    for spec in BACKENDS:
        if unavailable_reason(spec):
            continue
        for policy, layout in WRITE_POLICIES.items():
            name = f"{spec.id}-{policy}"
            stores[(spec.id, policy)] = job(spec, root / name, layout=layout, interface_v1=spec.has_v1,
                                            tokens=TOKENS, expected=root / f"{name}.pt", write_policy=policy)
            consumers[(spec.id, policy)] = stores[(spec.id, policy)]
        source = stores[(spec.id, "write_through")]
        for case, (policy, admit, keys) in PREFETCHES.items():
            consumers[(spec.id, case)] = {**source, "prefetch_policy": policy, "admit": admit, **keys}
    served = dict(zip(stores, run_phase("serve", list(stores.values()), root)))
    consumed = dict(zip(consumers, run_phase("consume", list(consumers.values()), root)))
    return served, consumed


def _stored(runs, spec, policy) -> dict:
    return ok(runs[0][(spec.id, policy)])


def _consumed(runs, spec, case) -> dict:
    result = ok(runs[1][(spec.id, case)])
    assert (result["device_before"], result["host_before"]) == (0, 0)
    return result


def _got_everything(result: dict) -> None:
    assert result["host_hit"] == len(TOKENS)
    assert result["loaded_tokens"] == len(TOKENS)
    assert result["bit_exact"]


def _got_a_bit_exact_prefix(result: dict) -> None:
    """Possibly empty: the stop policy cut the prefetch wherever the I/O threads were."""
    assert result["loaded_tokens"] == result["host_hit"]
    assert result["loaded_tokens"] % PAGE_SIZE == 0 and result["loaded_tokens"] <= len(TOKENS)
    assert result["bit_exact"]


# -- write policies ------------------------------------------------------------------------------
def test_write_through_stores_the_first_request_and_a_new_process_reads_it_back(backend_spec, runs):
    assert _stored(runs, backend_spec, "write_through") == {
        "stored_before_trigger": 6, "stored_pages": 6, "pages": 6}
    _got_everything(_consumed(runs, backend_spec, "write_through"))


def test_write_through_selective_stores_a_prefix_once_it_is_hit_again_and_a_new_process_reads_it_back(
        backend_spec, runs):
    stored = _stored(runs, backend_spec, "write_through_selective")
    assert stored["stored_before_trigger"] == 0  # one request: below SGLang's hit threshold
    assert stored["stored_pages"] == stored["pages"] == 6
    _got_everything(_consumed(runs, backend_spec, "write_through_selective"))  # the first request's KV


def test_write_back_stores_pages_when_they_leave_the_device_and_a_new_process_reads_them_back(
        backend_spec, runs):
    stored = _stored(runs, backend_spec, "write_back")
    assert stored["stored_before_trigger"] == 0  # still only on the device
    assert stored["stored_pages"] == stored["pages"] == 6
    _got_everything(_consumed(runs, backend_spec, "write_back"))


# -- prefetch policies ---------------------------------------------------------------------------
def test_wait_complete_admits_the_request_with_every_stored_page(backend_spec, runs):
    _got_everything(_consumed(runs, backend_spec, "wait_complete"))


def test_best_effort_admitted_at_once_loads_a_bit_exact_prefix_of_what_was_stored(backend_spec, runs):
    _got_a_bit_exact_prefix(_consumed(runs, backend_spec, "best_effort-admitted_at_once"))


def test_best_effort_admitted_after_its_reads_landed_loads_every_page(backend_spec, runs):
    _got_everything(_consumed(runs, backend_spec, "best_effort-admitted_after_landing"))


def test_timeout_with_a_generous_deadline_loads_every_page(backend_spec, runs):
    _got_everything(_consumed(runs, backend_spec, "timeout-generous"))


def test_timeout_with_a_tiny_deadline_loads_a_bit_exact_prefix_of_what_was_stored(backend_spec, runs):
    _got_a_bit_exact_prefix(_consumed(runs, backend_spec, "timeout-tiny"))


def test_timeout_with_a_tiny_deadline_keeps_the_pages_that_already_landed(backend_spec, runs):
    _got_everything(_consumed(runs, backend_spec, "timeout-tiny-admitted_after_landing"))
