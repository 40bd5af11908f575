"""Frozen configuration of the reference engine: the model's shape and the engine's limits."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from tiered_kv.errors import ConfigError

DTYPES = ("float32", "bfloat16", "float16")
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


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-style decoder (RMSNorm, RoPE, GQA, SwiGLU)."""

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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_hf_config(self) -> dict[str, Any]:
        """A Hugging Face ``LlamaForCausalLM`` config.json of this shape."""
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
    cache_salt: str = ""  # tenant salt folded into the namespace
    hash_algo: str = "xxh3_128"  # block-key hash (see tiered_kv.keys.HASHES)
    drain_timeout_s: float = 30.0  # generate() waits this long for held blocks to be saved

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
        from tiered_kv.keys import HASHES

        _choice("engine", "hash_algo", self.hash_algo, tuple(HASHES))

    def resolved_max_model_len(self, model: ModelConfig) -> int:
        return min(self.max_model_len or model.max_position, model.max_position)
