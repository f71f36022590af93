"""The native LayerNorm / partial-rotary families (issue 42, item 2): GPT-NeoX, Phi (1, 1.5, 2) and
StableLM against transformers.

Each tiny checkpoint is written by the installed transformers' config class and `save_pretrained`
(fp32, hidden 64, 2 layers, 4 heads of 16), its weights redrawn at scales where greedy picks are
not near-ties (norm scales 1 + 0.1 noise, biases 0.1, matrices 0.2, embeddings and heads 0.5),
with what makes each family itself set away from the defaults where a wrong reading would change
the numbers: both values of the parallel residual, partial rotary factors of 0.25 to 0.5 (NeoX's
default from `rotary_pct`), biases on and off, q/k LayerNorms (Phi's shared by every head,
StableLM's one per head), grouped KV heads. Through the engine core with chunked prefill, a
prefix-cache hit and a forced preemption in one run (test_transformers_backend.engine_greedy),
3 prompts x 16 greedy tokens equal transformers' and the chosen tokens' logprobs are within 1e-3;
where the Transformers backend runs the family (GPT-NeoX, Phi) it gives the native path's tokens.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from test_transformers_backend import assert_parity, engine_greedy, hf_greedy, prompts
from tinymodel import build_tokenizer, write_tokenizer

from triollm.engine.loading.model_config import ModelConfig

# case -> (architecture, config class, its arguments beyond the sizes)
CASES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "neox-parallel": ("GPTNeoXForCausalLM", "GPTNeoXConfig", {"use_parallel_residual": True}),  # rotary_pct 0.25
    "neox-sequential": (
        "GPTNeoXForCausalLM", "GPTNeoXConfig",
        {"use_parallel_residual": False, "attention_bias": False, "rotary_pct": 0.5, "rotary_emb_base": 5000.0},
    ),
    "phi-qk-layernorm": (
        "PhiForCausalLM", "PhiConfig", {"qk_layernorm": True, "num_key_value_heads": 2, "partial_rotary_factor": 0.5}
    ),
    "phi": ("PhiForCausalLM", "PhiConfig", {"partial_rotary_factor": 0.4}),  # 6 of 16 dims rotate
    "stablelm-qk-layernorm": (
        "StableLmForCausalLM", "StableLmConfig",
        {"qk_layernorm": True, "use_qkv_bias": True, "num_key_value_heads": 2, "use_parallel_residual": False},
    ),
    "stablelm-parallel": (
        "StableLmForCausalLM", "StableLmConfig",
        {"use_parallel_residual": True, "qk_layernorm": True, "num_key_value_heads": 4, "partial_rotary_factor": 0.5},
    ),
}  # fmt: skip
# The families the Transformers backend runs too (StableLM's attention bypasses its interface).
BACKEND = ("neox-parallel", "neox-sequential", "phi-qk-layernorm")


def make_model(path: Path, case: str, seed: int) -> Path:
    """A tiny random checkpoint of `case` written by transformers (module note)."""
    import transformers

    eos = write_tokenizer(path)
    arch, config_class, fields = CASES[case]
    cfg = getattr(transformers, config_class)(
        vocab_size=build_tokenizer().get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=512, bos_token_id=None, eos_token_id=eos, pad_token_id=None,
        tie_word_embeddings=False, dtype="float32", **fields,
    )  # fmt: skip
    cfg.architectures = [arch]
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if p.ndim == 1 and "norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.1 * noise)
            elif p.ndim == 1:
                p.copy_(0.1 * noise)
            else:
                big = any(k in name for k in ("embed", "lm_head"))
                p.copy_(noise * (0.5 if big else 0.2))
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {case: make_model(tmp_path_factory.mktemp(case), case, seed=40 + i) for i, case in enumerate(CASES)}


@pytest.mark.parametrize("case", list(CASES))
def test_native_greedy_parity(model_dirs: dict[str, Path], case: str) -> None:
    from triollm.engine.execution.models import MODELS

    path, arch = model_dirs[case], CASES[case][0]
    assert ModelConfig.from_pretrained(path, max_model_len=96).model_impl == "triollm"  # auto: the native class
    ids = prompts()
    ours, core = engine_greedy(path, ids)
    assert type(core.executor.model) is MODELS[arch]
    assert_parity(ours, hf_greedy(path, ids))
    stats = core.statistics()
    assert stats.prefix_cache_hit_rate > 0 and stats.num_preemptions > 0


@pytest.mark.parametrize("case", BACKEND)
def test_native_path_equals_the_transformers_backend(model_dirs: dict[str, Path], case: str) -> None:
    ids = prompts()
    native, _ = engine_greedy(model_dirs[case], ids, model_impl="triollm")
    backend, core = engine_greedy(model_dirs[case], ids, model_impl="transformers")
    assert type(core.executor.model).__name__ != CASES[case][0]  # transformers' module under the backend
    assert_parity(backend, native)


def test_configs_parse_as_transformers_reads_them(model_dirs: dict[str, Path]) -> None:
    neox = ModelConfig.from_pretrained(model_dirs["neox-parallel"], max_model_len=96)
    assert neox.rotary_dim == 4 and neox.parallel_residual and neox.qkv_bias and neox.hidden_act == "gelu"
    seq = ModelConfig.from_pretrained(model_dirs["neox-sequential"], max_model_len=96)
    assert seq.rotary_dim == 8 and not seq.parallel_residual and not seq.qkv_bias and seq.rope.theta == 5000.0
    phi = ModelConfig.from_pretrained(model_dirs["phi-qk-layernorm"], max_model_len=96)
    assert phi.qk_norm == "layernorm" and phi.o_proj_bias and phi.hidden_act == "gelu_tanh" and phi.num_kv_heads == 2
    stable = ModelConfig.from_pretrained(model_dirs["stablelm-qk-layernorm"], max_model_len=96)
    assert stable.qk_norm == "layernorm_head" and stable.qkv_bias and not stable.o_proj_bias and stable.rotary_dim == 4


def _config_dir(tmp_path: Path, arch: str, **fields: Any) -> Path:
    base = {"architectures": [arch], "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "vocab_size": 384, "layer_norm_eps": 1e-5}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(base | fields))
    return tmp_path


def test_neox_transformers4_rotary_spelling(tmp_path: Path) -> None:
    """4.x wrote GPT-NeoX's RoPE as `rotary_pct` and `rotary_emb_base` (what Pythia's configs hold)."""
    cfg = ModelConfig.from_pretrained(
        _config_dir(tmp_path, "GPTNeoXForCausalLM", rotary_pct=0.5, rotary_emb_base=20000), max_model_len=64
    )
    assert cfg.rotary_dim == 8 and cfg.rope.theta == 20000.0


@pytest.mark.parametrize(
    ("arch", "fields", "match"),
    [
        ("PhiForCausalLM", {"tie_word_embeddings": True}, "tie_word_embeddings: PhiForCausalLM's lm_head has a bias"),
        (
            "StableLmForCausalLM",
            {"hidden_act": "gelu", "num_key_value_heads": 4},
            "hidden_act: 'gelu' is not supported for StableLmForCausalLM",
        ),
        ("GPTNeoXForCausalLM", {"rotary_pct": 0.1}, "partial_rotary_factor: 0.1 gives 1 rotary dims"),
        ("GPTNeoXForCausalLM", {"hidden_act": "relu2"}, "hidden_act: 'relu2' is not supported"),
        ("PhiForCausalLM", {"layer_norm_eps": 0}, "layer_norm_eps: expected a positive number"),
        (
            "GPTNeoXForCausalLM",
            {"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128}},
            "quantization_config: quantized GPTNeoXForCausalLM checkpoints are not supported",
        ),
    ],
)
def test_unsupported_fields_are_refused_at_load(tmp_path: Path, arch: str, fields: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_pretrained(_config_dir(tmp_path, arch, **fields), max_model_len=64)


def test_per_head_qk_layernorm_is_not_sharded(tmp_path: Path) -> None:
    from triollm.engine.distributed.sharding import TPShard
    from triollm.engine.execution.models import MODELS

    cfg = ModelConfig.from_pretrained(
        _config_dir(tmp_path, "StableLmForCausalLM", qk_layernorm=True, num_key_value_heads=4), max_model_len=64
    )
    with torch.device("meta"), pytest.raises(ValueError, match="tensor_parallel_size: .*qk_layernorm"):
        MODELS["StableLmForCausalLM"](cfg, TPShard(0, 2))
