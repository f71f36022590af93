"""Random checkpoints of the MoE families given native classes in issue 42 (DeepSeek V3, Llama 4
text, Phi-MoE; with --all also Qwen2-MoE, Qwen3-MoE, OLMoE, Granite MoE, GLM-4.5, gpt-oss), of one
moderate size, for their native path against the Transformers backend at
batch 1 (docs/benchmarks.md):

    python docs/bench/native_checkpoints.py OUT_DIR --tokenizer-from DIR
    triollm bench latency --model OUT_DIR/<family> --model-impl auto|transformers --input-len 64 --output-len 32

Each: hidden 1,024, 8 layers, 16 heads, 8 experts of width 512 (Llama 4: 1 a token, the others 2),
vocabulary 49,152 (DIR's tokenizer: the bundled SmolLM2's import), fp32, transformers' own random
initialisation, written by `save_pretrained`: 204-229M parameters.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path
from typing import Any

COMMON: dict[str, Any] = {
    "vocab_size": 49152, "hidden_size": 1024, "num_hidden_layers": 8, "num_attention_heads": 16,
    "num_key_value_heads": 4, "intermediate_size": 2048, "max_position_embeddings": 4096, "bos_token_id": 1,
    "eos_token_id": 2, "pad_token_id": 2, "tie_word_embeddings": False, "rms_norm_eps": 1e-5,
}  # fmt: skip
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", {
        "num_key_value_heads": 16, "moe_intermediate_size": 512, "n_routed_experts": 8, "num_experts_per_tok": 2,
        "first_k_dense_replace": 1, "kv_lora_rank": 256, "qk_nope_head_dim": 64, "qk_rope_head_dim": 32,
        "v_head_dim": 64, "q_lora_rank": 384, "n_group": 1, "topk_group": 1, "n_shared_experts": 1,
        "rope_interleave": False,
    }),
    "llama4": ("Llama4TextConfig", "Llama4ForCausalLM", {
        "head_dim": 64, "attention_chunk_size": 1024, "no_rope_layers": [1, 1, 1, 0] * 2, "intermediate_size": 512,
        "intermediate_size_mlp": 2048, "interleave_moe_layer_step": 2, "num_local_experts": 8,
        "num_experts_per_tok": 1,
    }),
    "phimoe": ("PhimoeConfig", "PhimoeForCausalLM", {
        "intermediate_size": 512, "num_local_experts": 8, "num_experts_per_tok": 2, "attention_bias": True,
        "lm_head_bias": True,
    }),
    # with --all: the other MoE families issue 42 names
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", {
        "moe_intermediate_size": 512, "num_experts": 8, "num_experts_per_tok": 2,
        "shared_expert_intermediate_size": 1024, "decoder_sparse_step": 1, "mlp_only_layers": [],
    }),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {
        "head_dim": 64, "moe_intermediate_size": 512, "num_experts": 8, "num_experts_per_tok": 2,
        "decoder_sparse_step": 1, "mlp_only_layers": [],
    }),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", {
        "intermediate_size": 512, "num_experts": 8, "num_experts_per_tok": 2,
    }),
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM", {
        "intermediate_size": 512, "num_local_experts": 8, "num_experts_per_tok": 2,
    }),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", {
        "head_dim": 64, "moe_intermediate_size": 512, "n_routed_experts": 8, "num_experts_per_tok": 2,
        "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
    }),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", {
        "head_dim": 64, "intermediate_size": 512, "num_local_experts": 8, "num_experts_per_tok": 2,
        "sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"] * 4,
    }),
}  # fmt: skip
FIRST = ("deepseek_v3", "llama4", "phimoe")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("--tokenizer-from", type=Path, required=True)
    p.add_argument("--all", action="store_true", help="also the other MoE families (else DeepSeek, Llama 4, Phi-MoE)")
    args = p.parse_args()

    import torch
    import transformers

    for name, (config_class, arch, fields) in FAMILIES.items():
        if not args.all and name not in FIRST:
            continue
        if (args.out / name).exists():
            continue
        cfg = getattr(transformers, config_class)(**{**COMMON, **fields})
        cfg.architectures = [arch]
        torch.manual_seed(0)
        model = getattr(transformers, arch)(cfg).to(torch.float32)
        model.save_pretrained(args.out / name)
        for file in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(args.tokenizer_from / file, args.out / name / file)
        print(f"{name}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters")


if __name__ == "__main__":
    main()
