"""Stand-ins for what SGLang hands a HiCache storage backend, for tests that run without SGLang:
its storage config (the fields the adapter reads) and MHA / MLA host pools with SGLang's four
host layouts, their page views and flat data pages (shapes as ``../shared/connectors.md`` and
SGLang 0.5.23's host pools give them). ``tools/check_sglang.sh`` runs the adapter against
SGLang's own classes."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class StorageConfig:
    """The fields of SGLang's ``HiCacheStorageConfig`` the adapter reads."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    attn_cp_rank: int = 0
    attn_cp_size: int = 1
    is_mla_model: bool = False
    model_name: str | None = "test/llama-like"
    extra_config: dict = field(default_factory=dict)
    dcp_size: int = 1
    dcp_rank: int = 0
    logical_page_size: int | None = None

    @property
    def is_storage_writer(self) -> bool:
        return not self.is_mla_model or self.tp_rank == self.dcp_rank


@dataclass
class ServerArgs:
    """The fields of SGLang's ``ServerArgs`` that name a checkpoint's K/V, at SGLang 0.5.23's
    defaults (``ServerArgs(model_path=...)``: checked against the real class)."""

    model_path: str = "test/llama-like"
    revision: str | None = None
    dtype: str = "auto"
    quantization: str | None = None
    quantization_param_path: str | None = None
    kv_cache_dtype: str = "auto"
    json_model_override_args: str = "{}"
    load_format: str = "auto"
    model_loader_extra_config: str = "{}"
    modelopt_quant: str | dict | None = None
    modelopt_checkpoint_restore_path: str | None = None
    rl_quant_profile: str | None = None


class MHAPool:
    """A host pool of ``size`` token slots, K and V for ``layer_num`` layers of ``head_num`` heads."""

    SHAPES = {  # layout -> kv_buffer shape (P = pages)
        "layer_first": lambda L, S, P, ps, H, D: (2, L, S, H, D),
        "page_first": lambda L, S, P, ps, H, D: (2, S, L, H, D),
        "page_first_direct": lambda L, S, P, ps, H, D: (2, P, L, ps, H, D),
        "page_head": lambda L, S, P, ps, H, D: (2, P, H, ps, L, D),
    }

    def __init__(self, layout: str, *, dtype=torch.bfloat16, page_size: int = 4, pages: int = 16,
                 layer_num: int = 3, head_num: int = 2, head_dim: int = 8, seed: int = 0,
                 start_layer: int = 0) -> None:
        self.layout, self.dtype, self.page_size, self.start_layer = layout, dtype, page_size, start_layer
        self.layer_num, self.head_num, self.head_dim, self.v_head_dim = layer_num, head_num, head_dim, head_dim
        self.size = pages * page_size
        shape = self.SHAPES[layout](layer_num, self.size, pages, page_size, head_num, head_dim)
        g = torch.Generator().manual_seed(seed)
        self.kv_buffer = torch.randn(shape, generator=g).to(dtype)

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        if self.layout == "layer_first":
            page = self.kv_buffer[:, :, index : index + self.page_size]
        elif self.layout == "page_first":
            page = self.kv_buffer[:, index : index + self.page_size]
        else:
            p = index // self.page_size
            page = self.kv_buffer[:, p : p + 1]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(2 * self.layer_num * self.page_size * self.head_num * self.head_dim, dtype=self.dtype)

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        page = self.get_data_page(index, flat=False)
        page.copy_(data_page.view(page.shape))

    def page_indices(self, first_page: int, n: int) -> torch.Tensor:
        """Host indices of ``n`` pages from page ``first_page`` on, as SGLang passes them."""
        start = first_page * self.page_size
        return torch.arange(start, start + n * self.page_size)


class MLAPool(MHAPool):
    """A host pool of one latent (+ RoPE part) per token per layer."""

    SHAPES = {
        "layer_first": lambda L, S, P, ps, K: (L, S, 1, K),
        "page_first": lambda L, S, P, ps, K: (S, L, 1, K),
        "page_first_direct": lambda L, S, P, ps, K: (P, L, ps, 1, K),
    }

    def __init__(self, layout: str, *, dtype=torch.bfloat16, page_size: int = 4, pages: int = 16,
                 layer_num: int = 3, kv_lora_rank: int = 16, qk_rope_head_dim: int = 4, seed: int = 0,
                 start_layer: int = 0) -> None:
        self.layout, self.dtype, self.page_size, self.layer_num = layout, dtype, page_size, layer_num
        self.start_layer = start_layer  # (the pipeline stage's first model layer)
        self.kv_lora_rank, self.qk_rope_head_dim = kv_lora_rank, qk_rope_head_dim
        self.kv_cache_dim = kv_lora_rank + qk_rope_head_dim
        self.size = pages * page_size
        shape = self.SHAPES[layout](layer_num, self.size, pages, page_size, self.kv_cache_dim)
        g = torch.Generator().manual_seed(seed)
        self.kv_buffer = torch.randn(shape, generator=g).to(dtype)

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        if self.layout == "layer_first":
            page = self.kv_buffer[:, index : index + self.page_size]
        elif self.layout == "page_first":
            page = self.kv_buffer[index : index + self.page_size]
        else:
            p = index // self.page_size
            page = self.kv_buffer[p : p + 1]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(self.layer_num * self.page_size * self.kv_cache_dim, dtype=self.dtype)
