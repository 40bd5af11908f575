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
