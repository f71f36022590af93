"""DeepSeek V2 / V3 natively (issue 42, item 2): multi-head latent attention over a latent cache.

Tiny checkpoints written by transformers' `DeepseekV2Config` / `DeepseekV3Config` and
`save_pretrained` (weights redrawn so greedy picks are not near-ties, V3's correction bias
included) must give transformers' greedy tokens and logprobs through `EngineCore`, with chunked
prefill (16-token steps: later chunks attend over the latents earlier ones cached), a prefix-cache
hit and a forced preemption (test_transformers_backend.py's `engine_greedy`). The cases cover V2
without a q LoRA (V2-Lite) and with one, greedy and group-limited routing, a dense MLP with biases,
v_head_dim != qk_nope_head_dim, V3's grouped sigmoid routing with YaRN (its mscale_all_dim in the
softmax scale) and without interleaved rotary dims, and the multi-token-prediction layers a V3
checkpoint carries after the decoder's.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from test_transformers_backend import assert_parity, engine_greedy, hf_greedy, prompts
from tinymodel import build_tokenizer, write_tokenizer

from triollm.engine.config import EngineArgs
from triollm.engine.execution.models.deepseek import DeepseekForCausalLM, route_group_limited
from triollm.engine.loading.model_config import ModelConfig

_BASE: dict[str, Any] = {
    "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4, "intermediate_size": 96,
    "moe_intermediate_size": 32, "n_routed_experts": 8, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
    "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 12, "q_lora_rank": 24,
    "rms_norm_eps": 1e-5,
}  # fmt: skip
# name -> (config class, fields over _BASE)
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "v2-lite": ("DeepseekV2Config", {"q_lora_rank": None, "topk_method": "greedy", "n_shared_experts": 2}),
    "v2-group-limited": ("DeepseekV2Config", {
        "topk_method": "group_limited_greedy", "n_group": 2, "topk_group": 1, "routed_scaling_factor": 1.5,
        "mlp_bias": True, "n_shared_experts": 1,
    }),
    "v3-yarn": ("DeepseekV3Config", {
        "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5, "n_shared_experts": 1,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
                            "mscale_all_dim": 1.0, "original_max_position_embeddings": 128},
    }),
    "v3-plain-rope": ("DeepseekV3Config", {
        "q_lora_rank": None, "rope_interleave": False, "n_group": 1, "topk_group": 1, "norm_topk_prob": False,
        "first_k_dense_replace": 2,
    }),
}  # fmt: skip


def make_deepseek(path: Path, case: str, seed: int = 0) -> Path:
    import transformers

    eos = write_tokenizer(path)
    config_class, fields = CASES[case]
    if config_class == "DeepseekV3Config":
        fields = {"num_key_value_heads": 4, **fields}  # its default, 128, is V3's head count, not ours
    cfg = getattr(transformers, config_class)(
        vocab_size=build_tokenizer().get_vocab_size(), max_position_embeddings=512, bos_token_id=None,
        eos_token_id=eos, pad_token_id=None, tie_word_embeddings=False, dtype="float32", **{**_BASE, **fields},
    )  # fmt: skip
    cfg.architectures = [config_class.replace("Config", "ForCausalLM")]
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if p.ndim == 1 and name.endswith("weight"):  # norms' scales
                p.copy_(1 + 0.1 * noise)
            elif p.ndim == 1:
                p.copy_(0.1 * noise)
            else:
                p.copy_(noise * (0.5 if "embed" in name or "lm_head" in name else 0.2))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # V3's: a choice it changes
                b.copy_(0.5 * torch.randn(b.shape, generator=g))
    model.save_pretrained(path)
    return path


@pytest.mark.parametrize("case", list(CASES))
def test_deepseek_gives_transformers_tokens(tmp_path: Path, case: str) -> None:
    path = make_deepseek(tmp_path / case, case, seed=len(case))
    cfg = ModelConfig.from_pretrained(path, max_model_len=96)
    assert cfg.model_impl == "triollm" and cfg.mla is not None  # auto: the native class
    ids = prompts()
    ours, core = engine_greedy(path, ids)
    model = core.executor.model
    assert isinstance(model, DeepseekForCausalLM)
    assert_parity(ours, hf_greedy(path, ids))
    stats = core.statistics()
    assert stats.prefix_cache_hit_rate > 0 and stats.num_preemptions > 0
    # The cache holds one latent per token and layer: kv_lora_rank + qk_rope_head_dim values in one
    # "head" (K and V each), not num_heads x (qk_nope + qk_rope) and num_heads x v_head_dim.
    kv = core.executor.runner.kv  # type: ignore[attr-defined]
    latent = _BASE["kv_lora_rank"] + _BASE["qk_rope_head_dim"]
    assert len(kv.k) == len(kv.v) == _BASE["num_hidden_layers"]
    assert tuple(kv.k[0].shape) == (1, kv.num_blocks, latent, 16)
    assert tuple(kv.v[0].shape) == (1, kv.num_blocks, 16, latent)
    assert core.executor.bytes_per_block() == 2 * 3 * 16 * latent * 4


def test_backend_gives_the_native_tokens_and_skipped_mtp_layers(tmp_path: Path) -> None:
    """The Transformers backend (k and v expanded per head) gives the native path's tokens; the
    native loader skips a checkpoint's multi-token-prediction layer (index num_hidden_layers)."""
    path = make_deepseek(tmp_path / "v3", "v3-yarn", seed=5)
    mtp = {f"model.layers.3.{n}": torch.randn(64, 64) for n in ("eh_proj.weight", "self_attn.o_proj.weight")}
    save_file(mtp, str(path / "mtp.safetensors"))  # read by triollm's loader (every *.safetensors), not by transformers
    ids = prompts()
    native, _ = engine_greedy(path, ids)
    backend, core = engine_greedy(path, ids, model_impl="transformers")
    assert not isinstance(core.executor.model, DeepseekForCausalLM)
    assert_parity(backend, native)


def test_group_limited_routing_keeps_the_best_groups() -> None:
    """V2's group-limited choice: the experts outside the best groups (by their best expert) are
    never picked, even where their scores beat the kept groups' second best."""
    logits = torch.tensor([[5.0, 0.0, 4.9, 4.8, 0.0, 0.0, 1.0, 0.5]])  # groups of 2: best 5.0, 4.9, 0.0, 1.0
    weights, ids = route_group_limited(logits, 2, 4, 1, 2.0, torch.float32)
    assert sorted(ids[0].tolist()) == [0, 1]  # group 0 only: expert 1 (score 0) beats experts 2, 3 elsewhere
    probs = logits.softmax(-1)[0]
    assert torch.allclose(weights[0].sort().values, (2.0 * probs[[1, 0]]).sort().values)
    _, greedy = route_group_limited(logits, 2, 1, 1, 1.0, torch.float32)
    assert sorted(greedy[0].tolist()) == [0, 2]


def _config(tmp_path: Path, config_class: str, **fields: Any) -> Path:
    base = {**_BASE, "vocab_size": 384, "architectures": [config_class.replace("Config", "ForCausalLM")]}
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps({**base, **fields}))
    return tmp_path


REFUSED = [
    ("DeepseekV2Config", {"topk_method": "noaux_tc"}, r"topk_method: 'noaux_tc' is not supported"),
    ("DeepseekV2Config", {"topk_method": "group_limited_greedy"}, r"n_group: required"),
    ("DeepseekV2Config", {"norm_topk_prob": True}, r"norm_topk_prob: true"),
    ("DeepseekV2Config", {"moe_layer_freq": 2}, r"moe_layer_freq: 2"),
    ("DeepseekV2Config", {"scoring_func": "sigmoid"}, r"scoring_func: 'sigmoid'"),
    ("DeepseekV3Config", {"n_group": 3}, r"n_group: 3 groups"),
    ("DeepseekV3Config", {"n_group": None}, r"n_group: expected an integer"),
    ("DeepseekV3Config", {"num_key_value_heads": 2}, r"num_key_value_heads: 2"),
    ("DeepseekV3Config", {"kv_lora_rank": 0}, r"kv_lora_rank: expected an integer >= 1"),
    ("DeepseekV3Config", {"qk_rope_head_dim": 7}, r"qk_rope_head_dim: RoPE needs an even"),
    ("DeepseekV3Config", {"hidden_act": "gelu"}, r"hidden_act: 'gelu'"),
    ("DeepseekV3Config", {"num_experts_per_tok": 8, "n_group": 4, "topk_group": 1}, r"num_experts_per_tok: 8"),
    ("DeepseekV3Config", {"quantization_config": {"quant_method": "fp8"}}, r"quantization_config:"),
    ("DeepseekV3Config", {"rope_parameters": {"rope_type": "su"}}, r"rope_type: 'su' is not supported"),
]  # fmt: skip


@pytest.mark.parametrize(("config_class", "fields", "match"), REFUSED, ids=[m.split(":")[0] for *_, m in REFUSED])
def test_malformed_configs_are_refused_at_load(
    tmp_path: Path, config_class: str, fields: dict[str, Any], match: str
) -> None:
    groups = {"n_group": 1, "topk_group": 1} if "V3" in config_class else {}
    path = _config(tmp_path, config_class, **{**groups, **fields})
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_pretrained(path, max_model_len=64)


def test_the_parsed_config_sizes_the_cache_by_the_latent(tmp_path: Path) -> None:
    """One KV head as wide as the latent plus the rotary dims; YaRN's mscale_all_dim squared in the
    softmax scale; V3's default of one shared expert where config.json is silent."""
    path = _config(tmp_path, "DeepseekV3Config", num_hidden_layers=5, n_group=1, topk_group=1,
                   rope_parameters={"rope_type": "yarn", "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                                    "original_max_position_embeddings": 4096})  # fmt: skip
    cfg = ModelConfig.from_pretrained(path, max_model_len=64)
    assert (cfg.num_kv_heads, cfg.head_dim, cfg.rotary_dim) == (1, 40, 8)
    mscale = 0.1 * torch.log(torch.tensor(40.0)).item() + 1.0
    assert cfg.mla is not None and cfg.mla.softmax_scale == pytest.approx(24**-0.5 * mscale**2)
    assert cfg.moe is not None and cfg.moe.sparse_layers == (False, True, True, True, True)
    assert cfg.moe.scoring == "sigmoid" and cfg.moe.shared_intermediate_size == 32


@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "int8"])
def test_a_narrower_latent_cache_keeps_the_tokens(tmp_path: Path, kv_cache_dtype: str) -> None:
    """The latent written as a bf16 or int8 cache holds it (one int8 scale per token spans c_kv and
    k_pe): the first two prompts' tokens as with the fp32 cache, and the cache of that dtype."""
    path = make_deepseek(tmp_path / "v3", "v3-yarn", seed=3)
    exact, _ = engine_greedy(path, prompts())
    narrow, core = engine_greedy(path, prompts(), kv_cache_dtype=kv_cache_dtype)
    assert core.executor.runner.kv.k[0].dtype == getattr(torch, kv_cache_dtype)  # type: ignore[attr-defined]
    assert [t for t, _ in narrow[:2]] == [t for t, _ in exact[:2]]


def test_lora_is_refused(tmp_path: Path) -> None:
    path = make_deepseek(tmp_path / "v2", "v2-lite")
    with pytest.raises(ValueError, match=r"enable_lora: LoRA adapters are not supported for DeepseekV2ForCausalLM"):
        EngineArgs(model=str(path), max_model_len=96, enable_lora=True).create_engine_config()


# The released configs' fields (DeepSeek-V2-Lite's and DeepSeek-V3's config.json, V3 without its
# FP8 quantization_config), the remote-code spellings included.
V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"], "hidden_size": 2048, "intermediate_size": 10944,
    "moe_intermediate_size": 1408, "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16,
    "n_shared_experts": 2, "n_routed_experts": 64, "num_experts_per_tok": 6, "first_k_dense_replace": 1,
    "moe_layer_freq": 1, "n_group": 1, "topk_group": 1, "topk_method": "greedy", "scoring_func": "softmax",
    "norm_topk_prob": False, "routed_scaling_factor": 1.0, "q_lora_rank": None, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "max_position_embeddings": 163840,
    "rope_theta": 10000, "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707,
                                          "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096,
                                          "type": "yarn"},
    "vocab_size": 102400, "rms_norm_eps": 1e-6, "aux_loss_alpha": 0.001, "seq_aux": True, "ep_size": 1,
}  # fmt: skip
V3 = {
    **V2_LITE, "architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 7168, "intermediate_size": 18432,
    "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
    "n_shared_experts": 1, "n_routed_experts": 256, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
    "n_group": 8, "topk_group": 4, "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True,
    "routed_scaling_factor": 2.5, "q_lora_rank": 1536, "num_nextn_predict_layers": 1, "vocab_size": 129280,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
}  # fmt: skip


@pytest.mark.parametrize("raw", [V2_LITE, V3], ids=["DeepSeek-V2-Lite", "DeepSeek-V3"])
def test_the_released_configs_parse(tmp_path: Path, raw: dict[str, Any]) -> None:
    """576 values per token and layer (not heads x 320), the released routing and scale."""
    (tmp_path / "config.json").write_text(json.dumps(raw))
    cfg = ModelConfig.from_pretrained(tmp_path, max_model_len=4096)
    assert cfg.mla is not None and cfg.moe is not None
    assert (cfg.num_kv_heads, cfg.head_dim, cfg.rotary_dim) == (1, 576, 64)
    mscale = 0.1 * raw["rope_scaling"]["mscale_all_dim"] * math.log(40) + 1
    assert cfg.mla.softmax_scale == pytest.approx(192**-0.5 * mscale**2)
    assert cfg.rope.rope_type == "yarn" and cfg.rope.attention_factor == pytest.approx(1.0)
    v3 = raw is V3
    assert (cfg.moe.scoring, cfg.moe.groups, cfg.moe.topk_groups) == (("sigmoid", 8, 4) if v3 else ("softmax", 1, 1))
    assert cfg.moe.sparse_layers.index(True) == (3 if v3 else 1)
    assert cfg.mla.q_lora_rank == (1536 if v3 else None)


def test_the_triton_kernels_are_refused_at_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the Triton kernels would run (here forced on the CPU), the 40-wide latent head is
    refused when the model loads, naming the way out, not at the first step."""
    path = make_deepseek(tmp_path / "v2", "v2-lite")
    monkeypatch.setenv("TRIOLLM_KERNELS", "triton")
    with pytest.raises(ValueError, match=r"device: DeepseekV2ForCausalLM's latent attention .* TRIOLLM_KERNELS=torch"):
        engine_greedy(path, prompts())


def test_int8_keeps_the_projections_with_whole_blocks(tmp_path: Path) -> None:
    """Weight-only int8 at load: the latent attention's projections and the dense and shared MLPs
    whose input width is whole 32-wide blocks become quantized layers; kv_b_proj (read per head)
    and those without whole blocks (q_b_proj over a 24-wide q_lora_rank, o_proj over 4 x 12 values)
    stay dense. The first step's chosen-token log-probs stay near the dense model's."""
    from triollm.engine.execution.layers.linear import Linear
    from triollm.engine.execution.layers.quantized import QuantLinear

    path = make_deepseek(tmp_path / "v3", "v3-yarn", seed=5)
    ids = prompts()
    dense, _ = engine_greedy(path, ids)
    ours, core = engine_greedy(path, ids, quantization="int8")
    model = core.executor.model
    for layer in model.layers:
        attn = layer.self_attn
        assert isinstance(attn.q_a_proj, QuantLinear) and isinstance(attn.kv_a_proj_with_mqa, QuantLinear)
        assert type(attn.q_b_proj) is Linear and type(attn.o_proj) is Linear
    assert isinstance(model.layers[0].mlp.gate_up_proj, QuantLinear)
    assert isinstance(model.layers[0].mlp.down_proj, QuantLinear)
    for (tokens, logprobs), (dense_tokens, dense_logprobs) in zip(ours, dense, strict=True):
        assert len(tokens) == len(dense_tokens)
        assert abs(logprobs[0] - dense_logprobs[0]) < 0.3
