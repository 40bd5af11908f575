"""Frozen configuration of the reference engine: the model's shape and the engine's limits."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from tiered_kv.errors import ConfigError

DTYPES = ("float32", "bfloat16", "float16")
MODEL_KINDS = ("llama", "hybrid", "mla")
LAYER_CHARS = {"M": "mamba2", "*": "attention"}  # hybrid layer_pattern characters
DEVICES = ("auto", "cpu", "cuda")
KV_KERNELS = ("auto", "triton", "torch")


def _positive(owner: str, obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ConfigError(f"{owner}.{name} must be a positive integer, got {value!r}")


def _positive_float(owner: str, obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ConfigError(f"{owner}.{name} must be a positive number, got {value!r}")


def _choice(owner: str, name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{owner}.{name} must be one of {list(choices)}, got {value!r}")


# fields only one kind of model reads; to_dict() leaves out those another kind ignores, so a
# Llama's dict (and the seeded-weights revision made from it) is what it was before kinds existed
HYBRID_FIELDS = ("layer_pattern", "mamba_num_heads", "mamba_head_dim", "ssm_state_size",
                 "mamba_n_groups", "conv_kernel")
MLA_FIELDS = ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a decoder: Llama-style (RMSNorm, RoPE, GQA, SwiGLU), a hybrid of Mamba2 and such
    attention layers, or DeepSeek-style multi-head latent attention (MLA)."""

    vocab_size: int = 4096  # number of token ids
    hidden_size: int = 512  # width of the residual stream
    num_layers: int = 8  # decoder layers (each has one attention)
    num_heads: int = 8  # query heads
    num_kv_heads: int = 2  # key/value heads (GQA groups); divides num_heads
    head_dim: int = 64  # per-head dimension (even, for RoPE)
    intermediate_size: int = 1408  # SwiGLU inner width
    rope_theta: float = 10000.0  # RoPE base
    rms_eps: float = 1e-5  # RMSNorm epsilon
    dtype: str = "float32"  # weights, activations and KV dtype: float32 | bfloat16 | float16
    max_position: int = 8192  # longest sequence (prompt + generated) the model accepts
    kind: str = "llama"  # llama | hybrid (Mamba2 + attention layers) | mla (latent attention)
    layer_pattern: str = ""  # hybrid: one character per layer, "M" Mamba2, "*" attention (e.g. "M*M*")
    mamba_num_heads: int = 8  # hybrid: Mamba2 heads (each with its own decay A and skip D)
    mamba_head_dim: int = 16  # hybrid: channels per Mamba2 head (d_inner = heads * head_dim)
    ssm_state_size: int = 16  # hybrid: d_state, the SSM state width per channel
    mamba_n_groups: int = 1  # hybrid: groups sharing B and C; divides mamba_num_heads
    conv_kernel: int = 4  # hybrid: causal depthwise conv kernel width K (conv state keeps K-1 inputs)
    kv_lora_rank: int = 64  # mla: width of the compressed latent c_kv kept per token
    qk_rope_head_dim: int = 16  # mla: RoPE'd key part kept per token (shared by all heads); even
    qk_nope_head_dim: int = 32  # mla: per-head query/key part without RoPE (rebuilt from c_kv)
    v_head_dim: int = 32  # mla: per-head value width (rebuilt from c_kv)

    def __post_init__(self) -> None:
        _positive("model", self, "vocab_size", "hidden_size", "num_layers", "num_heads",
                  "num_kv_heads", "head_dim", "intermediate_size", "max_position")
        _positive_float("model", self, "rope_theta", "rms_eps")
        _choice("model", "dtype", self.dtype, DTYPES)
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"model.num_kv_heads ({self.num_kv_heads}) must divide "
                              f"model.num_heads ({self.num_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"model.head_dim must be even for RoPE, got {self.head_dim}")
        _choice("model", "kind", self.kind, MODEL_KINDS)
        _positive("model", self, "mamba_num_heads", "mamba_head_dim", "ssm_state_size", "mamba_n_groups",
                  "conv_kernel", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")
        if self.kind == "hybrid":
            self._check_hybrid()
        elif self.layer_pattern:
            raise ConfigError(f"model.layer_pattern is for kind 'hybrid', not {self.kind!r}")
        if self.kind == "mla" and self.qk_rope_head_dim % 2:
            raise ConfigError(f"model.qk_rope_head_dim must be even for RoPE, got {self.qk_rope_head_dim}")

    def _check_hybrid(self) -> None:
        pattern = self.layer_pattern
        if len(pattern) != self.num_layers or set(pattern) - set(LAYER_CHARS):
            raise ConfigError(f"model.layer_pattern must have one of {sorted(LAYER_CHARS)} per layer "
                              f"({self.num_layers}), got {pattern!r}")
        if "M" not in pattern or "*" not in pattern:
            raise ConfigError(f"model.layer_pattern of a hybrid needs Mamba2 ('M') and attention ('*') "
                              f"layers, got {pattern!r}")
        if self.mamba_num_heads % self.mamba_n_groups:
            raise ConfigError(f"model.mamba_n_groups ({self.mamba_n_groups}) must divide "
                              f"model.mamba_num_heads ({self.mamba_num_heads})")
        if self.conv_kernel < 2:
            raise ConfigError(f"model.conv_kernel must be at least 2 (a conv state of K-1 inputs), "
                              f"got {self.conv_kernel}")

    # ---- derived shapes --------------------------------------------------------------------------
    @property
    def attention_layer_ids(self) -> list[int]:
        """Layers with attention (a hybrid's "*" layers; every layer otherwise)."""
        if self.kind != "hybrid":
            return list(range(self.num_layers))
        return [i for i, c in enumerate(self.layer_pattern) if c == "*"]

    @property
    def mamba_layer_ids(self) -> list[int]:
        return [i for i, c in enumerate(self.layer_pattern) if c == "M"] if self.kind == "hybrid" else []

    @property
    def mamba_conv_dim(self) -> int:
        """Channels of the causal conv: x, B and C (``head_dim*num_heads + 2*n_groups*d_state``)."""
        return self.mamba_head_dim * self.mamba_num_heads + 2 * self.mamba_n_groups * self.ssm_state_size

    @property
    def mla_latent_dim(self) -> int:
        """What an MLA layer caches per token: the latent c_kv and the RoPE'd key part."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @classmethod
    def demo(cls, **overrides: Any) -> ModelConfig:
        """The demo size: a 4,000-token prefill takes a few seconds on two CPU cores."""
        return cls(**overrides)

    @classmethod
    def tiny(cls, **overrides: Any) -> ModelConfig:
        """A very small model for tests."""
        base = dict(vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                    head_dim=16, intermediate_size=128, max_position=4096)
        base.update(overrides)
        return cls(**base)

    @classmethod
    def tiny_hybrid(cls, **overrides: Any) -> ModelConfig:
        """A very small Mamba2 + attention hybrid for tests."""
        base = dict(kind="hybrid", num_layers=4, layer_pattern="M*M*", mamba_num_heads=4,
                    mamba_head_dim=16, ssm_state_size=8, mamba_n_groups=2)
        base.update(overrides)
        return cls.tiny(**base)

    @classmethod
    def tiny_mla(cls, **overrides: Any) -> ModelConfig:
        """A very small MLA model for tests."""
        base = dict(kind="mla", kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)
        base.update(overrides)
        return cls.tiny(**base)

    @classmethod
    def demo_kind(cls, kind: str, **overrides: Any) -> ModelConfig:
        """The demo size of ``kind``: the Llama demo, an 8-layer "M*M*M*M*" hybrid or an MLA model."""
        if kind == "hybrid":
            base: dict[str, Any] = dict(kind="hybrid", layer_pattern="M*M*M*M*", mamba_num_heads=8,
                                        mamba_head_dim=32, ssm_state_size=16, mamba_n_groups=2)
        elif kind == "mla":
            base = dict(kind="mla", kv_lora_rank=128, qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64)
        else:
            base = dict(kind=kind)
        base.update(overrides)
        return cls(**base)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        if self.kind == "llama":
            del out["kind"]
        if self.kind != "hybrid":
            for name in HYBRID_FIELDS:
                del out[name]
        if self.kind != "mla":
            for name in MLA_FIELDS:
                del out[name]
        return out

    def to_hf_config(self) -> dict[str, Any]:
        """A Hugging Face ``LlamaForCausalLM`` config.json of this shape (Llama models only)."""
        if self.kind != "llama":
            raise ConfigError(f"only llama models are written as Hugging Face config.json, not {self.kind!r}")
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_eps,
            "torch_dtype": self.dtype,
            "max_position_embeddings": self.max_position,
            "hidden_act": "silu",
            "tie_word_embeddings": False,
        }

    @classmethod
    def from_hf_config(cls, hf: Mapping[str, Any]) -> ModelConfig:
        """Read a Hugging Face Llama config.json dict; ConfigError names a missing key."""
        try:
            num_heads = int(hf["num_attention_heads"])
            hidden = int(hf["hidden_size"])
            return cls(
                vocab_size=int(hf["vocab_size"]),
                hidden_size=hidden,
                num_layers=int(hf["num_hidden_layers"]),
                num_heads=num_heads,
                num_kv_heads=int(hf.get("num_key_value_heads", num_heads)),
                head_dim=int(hf.get("head_dim") or hidden // num_heads),
                intermediate_size=int(hf["intermediate_size"]),
                rope_theta=float(hf.get("rope_theta", 10000.0)),
                rms_eps=float(hf.get("rms_norm_eps", 1e-5)),
                dtype=str(hf.get("torch_dtype") or "float32"),
                max_position=int(hf.get("max_position_embeddings", 8192)),
            )
        except KeyError as exc:
            raise ConfigError(f"config.json: missing key {exc.args[0]!r}") from None


@dataclass(frozen=True)
class EngineConfig:
    """Limits of the paged KV pool and of the scheduler."""

    block_size: int = 16  # tokens per KV block
    num_blocks: int = 1024  # blocks in the device KV pool
    max_num_seqs: int = 16  # requests holding blocks at once (running + loading)
    max_num_batched_tokens: int = 4096  # tokens computed per step (chunked-prefill budget)
    max_model_len: int | None = None  # prompt + generated limit; None = model.max_position
    enable_prefix_caching: bool = True  # reuse device blocks of equal chained keys
    device: str = "auto"  # auto | cpu | cuda ("auto" = cuda when available)
    kv_kernel: str = "auto"  # store_kvcache implementation: auto | triton | torch
    model_id: str = "tiered-kv/reference-llama"  # namespace model id of the KV blocks
    cache_salt: str = field(default="", repr=False)  # tenant salt folded into the namespace (a secret: in no repr)
    hash_algo: str = "xxh3_128"  # block-key hash (see tiered_kv.keys.HASHES)
    drain_timeout_s: float = 30.0  # generate() waits this long for held blocks to be saved
    # seconds an async load may go unreported before its request recomputes those blocks (on fresh
    # ones: the blocks it loads into stay out of use until the connector reports it); None = wait
    # for ever (vLLM's behaviour); 0 = give up at the first poll that did not report it
    load_timeout_s: float | None = 30.0

    def __post_init__(self) -> None:
        _positive("engine", self, "block_size", "num_blocks", "max_num_seqs", "max_num_batched_tokens")
        if self.max_model_len is not None:
            _positive("engine", self, "max_model_len")
        _choice("engine", "device", self.device, DEVICES)
        _choice("engine", "kv_kernel", self.kv_kernel, KV_KERNELS)
        if not isinstance(self.enable_prefix_caching, bool):
            raise ConfigError(f"engine.enable_prefix_caching must be a bool, got {self.enable_prefix_caching!r}")
        if not self.model_id:
            raise ConfigError("engine.model_id must not be empty")
        if isinstance(self.drain_timeout_s, bool) or not isinstance(self.drain_timeout_s, (int, float)) \
                or self.drain_timeout_s < 0:
            raise ConfigError(f"engine.drain_timeout_s must be >= 0, got {self.drain_timeout_s!r}")
        timeout = self.load_timeout_s
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or not 0 <= timeout < float("inf")):
            raise ConfigError(f"engine.load_timeout_s must be a finite number >= 0 or None, got {timeout!r}")
        from tiered_kv.keys import HASHES

        _choice("engine", "hash_algo", self.hash_algo, tuple(HASHES))

    def resolved_max_model_len(self, model: ModelConfig) -> int:
        return min(self.max_model_len or model.max_position, model.max_position)
