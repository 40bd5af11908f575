"""Engine KV layouts: detection, refusal of unknown shapes, gather/scatter round trips."""

from __future__ import annotations

import pytest
import torch

from tiered_kv.connector.layout import make_layout
from tiered_kv.errors import ConfigError
from tiered_kv.keys import Namespace

NS = Namespace(model_id="m", dtype="float32", num_layers=3, num_kv_heads=2, head_dim=8, block_size=4)
L, BS, H, D, NB = 3, 4, 2, 8, 10


def _canonical(n: int) -> torch.Tensor:
    return torch.randn(n, L, 2, BS, H, D)


def _pools():
    return {
        "engine": torch.zeros(2, L, NB, BS, H, D),
        "block_major": torch.zeros(NB, L, 2, BS, H, D),
        "block_major_flat": torch.zeros(NB, L, 2, BS * H * D),
        "layers_nb2": [torch.zeros(NB, 2, BS, H, D) for _ in range(L)],
        "layers_2nb": {f"model.layers.{i}.attn": torch.zeros(2, NB, BS, H, D) for i in range(L)},
    }


@pytest.mark.parametrize("name", list(_pools()))
def test_scatter_then_gather_returns_the_same_blocks_for_every_layout(name):
    kv = _pools()[name]
    layout = make_layout(NS, kv)
    assert layout.name == name.replace("_flat", "")
    ids = torch.tensor([7, 2, 5])
    data = _canonical(3)
    layout.scatter(ids, data)
    assert torch.equal(layout.gather(ids), data)
    assert torch.equal(layout.gather(torch.tensor([2])), data[1:2])
    assert not layout.gather(torch.tensor([0])).any(), "other blocks untouched"


def test_engine_layout_block_b_of_layer_l_is_kv_colon_l_b():
    kv = torch.zeros(2, L, NB, BS, H, D)
    layout = make_layout(NS, kv)
    data = _canonical(1)
    layout.scatter(torch.tensor([4]), data)
    assert torch.equal(kv[0, 1, 4], data[0, 1, 0])  # K of layer 1
    assert torch.equal(kv[1, 2, 4], data[0, 2, 1])  # V of layer 2


@pytest.mark.parametrize("kv", [
    torch.zeros(2, L, NB, BS, H, D + 1),
    torch.zeros(NB, L + 1, 2, BS, H, D),
    [torch.zeros(NB, 3, BS, H, D) for _ in range(L)],
    [torch.zeros(NB, 2, BS, H, D) for _ in range(L + 1)],
])
def test_unknown_layouts_are_refused_with_a_clear_config_error(kv):
    with pytest.raises(ConfigError, match="layout|layers"):
        make_layout(NS, kv)


def test_a_declared_layout_that_does_not_fit_is_refused():
    with pytest.raises(ConfigError):
        make_layout(NS, torch.zeros(2, L, NB, BS, H, D), declared="layers_nb2")


def _span_pools():
    return {**_pools(), "layers_head_major": [torch.zeros(NB, H, BS, 2 * D) for _ in range(L)]}


@pytest.mark.parametrize("name", list(_span_pools()))
def test_a_run_of_blocks_written_from_a_strided_slab_view_equals_the_batched_scatter(name):
    """scatter_span takes a view of host slots (rows wider than a block, a layer range of each)
    and writes exactly what scatter_layers writes for the same consecutive block ids."""
    slab = torch.randn(6, L + 1, 2, BS, H, D)  # slots a layer wider than a block: strided rows
    src = slab[1:5, 1:3]  # slots 1..4, layers 1..2
    by_span, by_ids = make_layout(NS, _span_pools()[name]), make_layout(NS, _span_pools()[name])
    by_span.scatter_span(3, src, 1)
    by_ids.scatter_layers(torch.arange(3, 7), src.contiguous(), 1)
    every = torch.arange(NB)
    assert torch.equal(by_span.gather(every), by_ids.gather(every))
    assert torch.equal(by_span.gather(torch.tensor([4]))[0, 1:3], src[1])
    assert not by_span.gather(torch.tensor([2, 7]))[:, 1:3].any() and not by_span.gather(every)[:, 0].any()


def test_loaded_slots_go_to_the_engine_in_runs_only_when_runs_are_long():
    from storage_backends.host import HostBackend
    from tiered_kv.connector.host_spans import scatter_spans, spans
    from tiered_kv.store.host_copy import HostCopier
    from tiered_kv.store.host_slots import HostSlots

    assert spans([4, 5, 6, 9, 10], [0, 1, 2, 3, 4]) == [(4, 0, 3), (9, 3, 2)]
    assert spans([4, 5, 6], [0, 2, 3]) == [(4, 0, 1), (5, 2, 2)]  # slots must run too
    block = L * 2 * BS * H * D * 4
    host = HostBackend(capacity=40 * (block + 4096), slot_bytes=block + 4096, pinned=False)  # wider slots
    slots = HostSlots(host, NS, HostCopier(1))
    data = _canonical(40)
    slots.fill(range(40), data.view(torch.uint8).view(40, -1))
    kv = torch.zeros(2, L, 40, BS, H, D)
    layout = make_layout(NS, kv)
    assert scatter_spans(layout, slots, [7, 8, 9], [20, 21, 22], (1, 3))  # one run: always
    assert torch.equal(layout.gather(torch.tensor([8]))[0, 1:], data[21, 1:3])
    assert not layout.gather(torch.tensor([8]))[0, 0].any()
    scattered = list(range(0, 32, 2))  # 16 runs of one block
    assert not scatter_spans(layout, slots, scattered, scattered)  # the batched path's job
    assert scatter_spans(layout, slots, list(range(16)) + [30], list(range(17)))  # 2 runs, 17 blocks
    assert torch.equal(layout.gather(torch.arange(16)), data[:16])
    assert torch.equal(layout.gather(torch.tensor([30]))[0], data[16])


def test_regression_fp8_blocks_scattered_into_an_engine_buffer_of_bytes_were_value_converted():
    """An fp8 namespace over an engine buffer of bytes (how engines keep fp8 KV): the batched and
    the layer-wise scatters converted each fp8 value to an integer (1.5 -> 1) instead of
    copying its bits, and the engine got wrong KV; the gather copies bits."""
    ns = Namespace(model_id="m", dtype="float8_e4m3fn", num_layers=L, num_kv_heads=H, head_dim=D, block_size=BS)
    kv = torch.zeros(2, L, NB, BS, H, D, dtype=torch.uint8)
    layout = make_layout(ns, kv)
    assert layout.name == "engine"
    data = (_canonical(2) * 3).to(torch.float8_e4m3fn)
    ids = torch.tensor([7, 2])
    layout.scatter(ids, data)
    assert torch.equal(layout.gather(ids), data.view(torch.uint8))
    kv.zero_()
    layout.scatter_layers(ids, data[:, 1:], 1)
    assert torch.equal(layout.gather(ids)[:, 1:], data[:, 1:].view(torch.uint8))


def test_regression_a_non_contiguous_head_major_layer_after_the_first_crashed_registration_untyped():
    """Only the first per-layer tensor was checked for the head-major layout's memory order; a
    later one of the same shape in another order raised torch's RuntimeError out of
    register_kv_caches. It is refused as an unsupported layout (a ConfigError)."""
    good = torch.zeros(NB, H, BS, 2 * D)
    odd = torch.zeros(NB, BS, H, 2 * D).transpose(1, 2)  # same shape, tokens before heads in memory
    with pytest.raises(ConfigError, match="per-layer KV tensors"):
        make_layout(NS, [good, odd, good])
