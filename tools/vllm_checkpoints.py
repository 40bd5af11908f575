"""Tiny seeded checkpoints, one per model kind vLLM's KV cache manager treats differently.

Each is the Hugging Face class built from a minimal config (so the tensor names are the ones vLLM's
``load_weights`` expects), every tensor of 2+ dims re-drawn from normal(0, 0.08) with a fixed seed
(1-D tensors keep their usual initial values: norms, Mamba ``A_log``/``D``/``dt_bias``, biases),
and saved as safetensors in fp32. Such weights make the generated tokens depend on every KV value,
so a test comparing an engine that loaded KV from a store with one that computed it can fail.

    python tools/vllm_checkpoints.py /tmp/ckpt sliding gemma3 mla hybrid sinks

The kinds (see ``../shared/model-kinds.md``): ``sliding`` (Mistral, window 64), ``gemma3``
(interleaved sliding/full), ``mla`` (DeepSeek-V2 latent attention), ``hybrid`` (Nemotron-H:
Mamba2 + attention), ``sinks`` (gpt-oss: attention sinks, sliding/full).
"""

from __future__ import annotations

import json
import os
import sys

STD = 0.08
VOCAB = 4096
COMMON = {"vocab_size": VOCAB, "hidden_size": 256, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 64, "max_position_embeddings": 2048,
          "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "torch_dtype": "float32"}

KINDS: dict[str, dict] = {
    "sliding": {**COMMON, "architectures": ["MistralForCausalLM"], "model_type": "mistral",
                "num_hidden_layers": 2, "intermediate_size": 512, "sliding_window": 64,
                "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False},
    "gemma3": {**COMMON, "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
               "num_hidden_layers": 4, "intermediate_size": 512, "sliding_window": 64,
               "layer_types": ["sliding_attention", "full_attention"] * 2,
               "query_pre_attn_scalar": 64, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
               "rope_local_base_freq": 10000.0, "tie_word_embeddings": True},
    "mla": {**COMMON, "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
            "num_hidden_layers": 2, "intermediate_size": 512, "num_key_value_heads": 4,
            "q_lora_rank": None, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
            "qk_nope_head_dim": 32, "v_head_dim": 32, "first_k_dense_replace": 2,
            "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 128,
            "n_shared_experts": 1, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
            "tie_word_embeddings": False},
    "hybrid": {**COMMON, "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h",
               "hybrid_override_pattern": "M-*-M*", "num_hidden_layers": 6,
               "intermediate_size": 512, "mamba_num_heads": 8, "mamba_head_dim": 64,
               "expand": 2, "ssm_state_size": 16, "conv_kernel": 4, "n_groups": 1,
               "chunk_size": 64, "layer_norm_epsilon": 1e-5, "mlp_hidden_act": "relu2",
               "use_conv_bias": True, "use_bias": False, "residual_in_fp32": False,
               "tie_word_embeddings": False},
    "sinks": {**COMMON, "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
              "num_hidden_layers": 2, "intermediate_size": 256, "num_local_experts": 4,
              "num_experts_per_tok": 2, "sliding_window": 64,
              "layer_types": ["sliding_attention", "full_attention"], "rms_norm_eps": 1e-5,
              "rope_theta": 150000.0, "tie_word_embeddings": False,
              "rope_scaling": {"rope_type": "yarn", "factor": 1.0, "beta_fast": 32.0,
                               "beta_slow": 1.0, "truncate": False,
                               "original_max_position_embeddings": 2048}},
}

# what the engine needs beside the checkpoint (see model-kinds.md)
ENGINE_ARGS: dict[str, dict] = {
    "sliding": {}, "gemma3": {}, "sinks": {},
    "mla": {"block_size": 16},
    "hybrid": {"enable_prefix_caching": False},
}


def build(kind: str, directory: str, seed: int = 0) -> str:
    """Write the ``kind`` checkpoint into ``directory`` (reused when already there)."""
    marker = os.path.join(directory, "model.safetensors")
    if os.path.exists(marker):
        return directory
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(KINDS[kind])
    model_type = cfg.pop("model_type")
    cfg.pop("architectures")
    config = AutoConfig.for_model(model_type, **cfg)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _name, tensor in sorted(model.state_dict().items()):
            if tensor.dim() >= 2 and tensor.is_floating_point():
                tensor.copy_(torch.randn(tensor.shape, generator=gen) * STD)
        if kind == "gemma3":  # Gemma multiplies embeddings by sqrt(hidden): keep them small
            model.get_input_embeddings().weight.mul_(1 / 16)
    os.makedirs(directory, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    with open(os.path.join(directory, "config.json")) as fh:
        saved = json.load(fh)
    for key, value in KINDS[kind].items():  # keys transformers renamed, as vLLM reads them
        saved.setdefault(key, value)
    saved["architectures"] = KINDS[kind]["architectures"]
    with open(os.path.join(directory, "config.json"), "w") as fh:
        json.dump(saved, fh, indent=1)
    return directory


def main(argv: list[str]) -> int:
    root, kinds = argv[0], argv[1:] or list(KINDS)
    for kind in kinds:
        print(build(kind, os.path.join(root, kind)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
