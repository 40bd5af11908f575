"""SGLang's cache controllers over its real host pools on CPU, with an L3 backend attached by the
``dynamic`` factory: pages go device -> host -> L3 on SGLang's backup thread, are evicted from the
host pool (whose memory is then wiped), and come back L3 -> host -> device on its prefetch threads.

Matrix: ``HiCacheController`` (the base class; still used by PD-disaggregation decode offload) and
``HybridCacheController`` (what SGLang 0.5.23's radix cache builds for every model, plain MHA
included) x MHA host layouts (layer_first, page_first, page_first_direct, page_head) and MLA ones
(layer_first, page_first, page_first_direct: the MLA host pool has no page_head) x storage
interface v0 (flat data pages) / v1 (zero-copy, ``"interface_v1": 1``) x bf16 / fp16 / fp8 (e4m3,
held as bytes by SGLang's pools).
"""

from __future__ import annotations

import pytest
import torch

from tests.integrations.sglang_real.kv_bits import first_tokens, same_bits
from tests.integrations.sglang_real.rig import MHA_LAYOUTS, MLA_LAYOUTS, PAGE_SIZE, Rig

pytestmark = pytest.mark.sglang

POOLS = [pytest.param("mha", lay, id=f"mha-{lay}") for lay in MHA_LAYOUTS] + [
    pytest.param("mla", lay, id=f"mla-{lay}") for lay in MLA_LAYOUTS]
CONTROLLERS = ["plain", "hybrid"]
DTYPES = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16"),
          pytest.param(torch.float8_e4m3fn, id="fp8")]
INTERFACES = [pytest.param(False, id="v0"), pytest.param(True, id="v1")]
PAGES = 5


def _tokens(start: int = 1000) -> list[int]:
    return list(range(start, start + PAGES * PAGE_SIZE))


@pytest.fixture
def make_rig(backend_spec, tmp_path):
    rigs = []

    def make(controller, attention, layout, dtype, interface_v1):
        if interface_v1 and not backend_spec.has_v1:
            pytest.skip(f"{backend_spec.class_name} implements only the v0 interface (no batch_get_v1)")
        rig = Rig(controller=controller, attention=attention, layout=layout, dtype=dtype,
                  backend=backend_spec, storage_dir=tmp_path, interface_v1=interface_v1)
        rigs.append(rig)
        return rig

    yield make
    for rig in reversed(rigs):
        rig.close()


@pytest.mark.parametrize("interface_v1", INTERFACES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("attention,layout", POOLS)
@pytest.mark.parametrize("controller", CONTROLLERS)
def test_pages_backed_up_evicted_and_prefetched_come_back_bit_exact(make_rig, controller, attention,
                                                                     layout, dtype, interface_v1):
    rig = make_rig(controller, attention, layout, dtype, interface_v1)
    tokens = _tokens()
    slots = rig.fill_device(len(tokens), seed=1)
    want = rig.device_kv(slots)
    host = rig.to_host(slots)
    assert rig.to_storage(host, tokens) == len(tokens)
    rig.evict_host(host)

    got = rig.fetch(tokens)

    assert (got.queried_tokens, got.read_tokens) == (len(tokens), len(tokens))
    assert same_bits(got.kv, want)


@pytest.mark.parametrize("interface_v1", INTERFACES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("attention,layout", POOLS)
@pytest.mark.parametrize("controller", CONTROLLERS)
def test_a_page_never_written_cuts_the_prefetch_at_the_hole(make_rig, controller, attention, layout,
                                                            dtype, interface_v1):
    rig = make_rig(controller, attention, layout, dtype, interface_v1)
    rig.check_cut_at_a_hole(_tokens(), hole=2, seed=2)


@pytest.mark.parametrize("interface_v1", INTERFACES)
@pytest.mark.parametrize("attention,layout", POOLS)
@pytest.mark.parametrize("controller", CONTROLLERS)
def test_storing_the_same_pages_again_is_reported_as_success(make_rig, controller, attention, layout,
                                                             interface_v1):
    rig = make_rig(controller, attention, layout, torch.bfloat16, interface_v1)
    tokens = _tokens()
    host = rig.to_host(rig.fill_device(len(tokens), seed=3))
    assert rig.to_storage(host, tokens) == len(tokens)
    assert rig.to_storage(host, tokens) == len(tokens)


@pytest.mark.parametrize("interface_v1", INTERFACES)
@pytest.mark.parametrize("attention,layout", POOLS)
@pytest.mark.parametrize("controller", CONTROLLERS)
def test_a_corrupted_stored_page_is_a_miss_and_cuts_the_prefetch(request, backend_spec, make_rig, tmp_path,
                                                                 controller, attention, layout,
                                                                 interface_v1):
    if not backend_spec.checks_integrity:
        request.applymarker(pytest.mark.xfail(
            strict=True, reason=f"{backend_spec.class_name} stores raw bytes without checks: a "
                                "corrupted page is read back as KV (SGLang's own backend)"))
    tokens = _tokens()
    bad = 2
    # The producer stores the pages in three sessions, so that the stored objects of page `bad`
    # (alone) are known; each session closes the storage before it is listed.
    producer = make_rig(controller, attention, layout, torch.bfloat16, interface_v1)
    slots = producer.fill_device(len(tokens), seed=4)
    want = producer.device_kv(slots)
    host = producer.to_host(slots)
    assert producer.to_storage(host, tokens, pages=range(0, bad)) == bad * PAGE_SIZE
    producer.close()
    before = backend_spec.objects(tmp_path)
    producer = make_rig(controller, attention, layout, torch.bfloat16, interface_v1)
    host = producer.to_host(_same_kv(producer, want))
    assert producer.to_storage(host, tokens, pages=range(bad, bad + 1)) == PAGE_SIZE
    producer.close()
    page_objects = backend_spec.objects(tmp_path) - before
    assert page_objects, "storing one page left no new stored object"
    producer = make_rig(controller, attention, layout, torch.bfloat16, interface_v1)
    host = producer.to_host(_same_kv(producer, want))
    assert producer.to_storage(host, tokens, pages=range(bad + 1, PAGES)) == (PAGES - bad - 1) * PAGE_SIZE
    producer.close()
    backend_spec.damage(tmp_path, page_objects)

    consumer = make_rig(controller, attention, layout, torch.bfloat16, interface_v1)
    got = consumer.fetch(tokens)

    assert got.read_tokens == bad * PAGE_SIZE
    assert same_bits(got.kv, first_tokens(want, bad * PAGE_SIZE))


def _same_kv(rig: Rig, kv: list[torch.Tensor]) -> torch.Tensor:
    """Fresh device slots of ``rig`` holding exactly ``kv``; returns the slots."""
    from tests.integrations.sglang_real.rig import device_kv_layers

    slots = rig.allocator.alloc(kv[0].shape[0])
    for buf, values in zip(device_kv_layers(rig.device_pool), kv):
        buf[slots] = values
    return slots
