"""Model weights: seeded random init, and Hugging Face-style safetensors directories.

Builds :class:`~tiered_kv.engine.model.LlamaForCausalLM` instances with their parameters:
``seeded_model`` (random, from a seed) and ``load_pretrained`` (from a directory); ``save_pretrained``
writes one out. The model module does not import this one.

A directory holds ``config.json`` (a ``LlamaForCausalLM`` config) and ``model.safetensors``
(or several ``*.safetensors`` shards) with HF tensor names. Weights are also fingerprinted for the
namespace ``revision``, so KV of different weights never mixes.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import replace
from pathlib import Path

import torch
import xxhash

from tiered_kv.dtypes import torch_dtype
from tiered_kv.engine.config import ModelConfig
from tiered_kv.engine.model import LlamaForCausalLM
from tiered_kv.errors import ConfigError

logger = logging.getLogger(__name__)

WEIGHTS_FILE = "model.safetensors"


@torch.no_grad()
def init_weights(model: LlamaForCausalLM, seed: int) -> None:
    """Deterministic init from ``seed`` (drawn in fp32 on CPU, in parameter-name order).

    Linear weights ~ N(0, 1/fan_in) keep every sublayer's output at unit scale; embeddings ~
    N(0, 1); norms = 1; the LM head is separate from the embeddings (a tied head makes greedy
    decoding repeat the current token).
    """
    generator = torch.Generator(device="cpu").manual_seed(seed)
    for name, param in sorted(model.named_parameters()):
        if name.endswith("norm.weight") or name.endswith(".D"):
            values = torch.ones(param.shape)
        elif name.endswith("embed_tokens.weight"):
            values = torch.randn(param.shape, generator=generator)
        elif name.endswith(".A_log"):  # Mamba2 decay rates A = -exp(A_log) in [-16, -1]
            values = torch.log(1 + 15 * torch.rand(param.shape, generator=generator))
        elif name.endswith(".dt_bias"):  # softplus(dt_bias) log-uniform in [1e-3, 1e-1]
            dt = torch.exp(math.log(1e-3) + math.log(100) * torch.rand(param.shape, generator=generator))
            values = dt + torch.log(-torch.expm1(-dt))
        elif name.endswith("conv1d.weight"):  # depthwise [channels, 1, K]
            values = torch.randn(param.shape, generator=generator) / math.sqrt(param.shape[-1])
        elif name.endswith("conv1d.bias"):
            values = 0.1 * torch.randn(param.shape, generator=generator)
        else:
            fan_in = param.shape[1]
            values = torch.randn(param.shape, generator=generator) / math.sqrt(fan_in)
        param.copy_(values)


def model_class(config: ModelConfig) -> type[LlamaForCausalLM]:
    """The model class of ``config.kind``."""
    if config.kind == "hybrid":
        from tiered_kv.engine.hybrid_model import HybridForCausalLM

        return HybridForCausalLM
    if config.kind == "mla":
        from tiered_kv.engine.mla_model import MLAForCausalLM

        return MLAForCausalLM
    return LlamaForCausalLM


def seeded_model(config: ModelConfig, seed: int = 0, device: str | torch.device = "cpu") -> LlamaForCausalLM:
    """The model with :func:`init_weights` parameters, in ``config.dtype`` on ``device``, in eval mode."""
    model = model_class(config)(config)
    init_weights(model, seed)
    return model.to(device=device, dtype=torch_dtype(config.dtype)).eval()


def save_pretrained(model: LlamaForCausalLM, model_dir: str | Path) -> Path:
    from safetensors.torch import save_file

    out = Path(model_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {name: t.detach().to("cpu").contiguous() for name, t in model.state_dict().items()}
    save_file(state, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(model.config.to_hf_config(), indent=2) + "\n")
    logger.info("saved %d tensors to %s", len(state), out)
    return out


def _weight_files(model_dir: Path) -> list[Path]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"model_dir: no *.safetensors file in {model_dir}")
    return files


def read_config(model_dir: str | Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"model_dir: {path} does not exist")
    return ModelConfig.from_hf_config(json.loads(path.read_text()))


@torch.no_grad()
def load_pretrained(model_dir: str | Path, device: str | torch.device = "cpu",
                    dtype: str | None = None) -> LlamaForCausalLM:
    """Build the model from ``config.json`` and load every ``*.safetensors`` file of the directory."""
    from safetensors.torch import load_file

    model_dir = Path(model_dir)
    config = read_config(model_dir)
    if dtype is not None:
        config = replace(config, dtype=dtype)
    state: dict[str, torch.Tensor] = {}
    for path in _weight_files(model_dir):
        state.update(load_file(str(path)))
    if "lm_head.weight" not in state and "model.embed_tokens.weight" in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]  # tied embeddings
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    expected = set(model.state_dict())
    missing, unexpected = expected - set(state), set(state) - expected
    if missing:
        raise ConfigError(f"model_dir: {model_dir} lacks tensors {sorted(missing)[:5]}")
    if unexpected:
        logger.warning("ignoring %d unknown tensors in %s, e.g. %s", len(unexpected), model_dir,
                       sorted(unexpected)[:3])
    target = torch_dtype(config.dtype)
    model.load_state_dict({k: state[k].to(target) for k in expected}, assign=True)
    logger.info("loaded %d tensors from %s (%s)", len(expected), model_dir, config.dtype)
    return model.to(device).eval()


def seeded_revision(config: ModelConfig, seed: int) -> str:
    """Revision of seeded weights: the seed and a digest of the model shape."""
    shape = json.dumps(config.to_dict(), sort_keys=True).encode()
    return f"seed{seed}-{xxhash.xxh3_64_hexdigest(shape)}"


def file_revision(model_dir: str | Path, dtype: str | None = None) -> str:
    """Revision of weights on disk: xxh3-128 of config.json and every safetensors file."""
    model_dir = Path(model_dir)
    digest = xxhash.xxh3_128()
    for path in [model_dir / "config.json", *_weight_files(model_dir)]:
        digest.update(path.name.encode())
        with path.open("rb") as handle:
            while chunk := handle.read(1 << 22):
                digest.update(chunk)
    if dtype is not None:
        digest.update(b"dtype:" + dtype.encode())
    return "xxh3-" + digest.hexdigest()[:32]
