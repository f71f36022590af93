"""config.json parsing: both transformers generations, every field that changes the numbers.

RoPE is checked against transformers itself: for each variant, the config dict goes through the
installed transformers' config class (`from_dict`, the path `from_pretrained` takes) and its rotary
module; our inverse frequencies, attention factor and cos/sin tables must be bit-identical.
Everything the engine cannot compute exactly must be a ValueError naming the field.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from tinymodel import make_tiny_model

from triollm.engine.config import EngineArgs
from triollm.engine.loading.hf_config import parse_hf_config
from triollm.engine.loading.model_config import ModelConfig
from triollm.kernels.rotary import rotary_tables

BASE: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 384,
    "max_position_embeddings": 512,
}
ARCHS = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def hf(model_type: str = "llama", **fields: Any) -> dict[str, Any]:
    return {"architectures": [ARCHS[model_type]], "model_type": model_type, **BASE, **fields}


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}
ROPES: dict[str, dict[str, Any]] = {
    "absent": {},
    "4.x-theta": {"rope_theta": 100000.0},
    "5.x-theta": {"rope_parameters": {"rope_type": "default", "rope_theta": 100000.0}},
    "5.x-dict-theta-wins": {"rope_theta": 3.0, "rope_parameters": {"rope_type": "default", "rope_theta": 250000.0}},
    "5.x-no-theta-in-dict": {"rope_theta": 70000.0, "rope_parameters": {"rope_type": "default"}},
    "4.x-linear-type": {"rope_theta": 70000.0, "rope_scaling": {"type": "linear", "factor": 2.5}},
    "5.x-linear": {"rope_parameters": {"rope_type": "linear", "factor": 2.5, "rope_theta": 70000.0}},
    "rope_scaling-wins": {
        "rope_scaling": {"rope_type": "linear", "factor": 3.0},
        "rope_parameters": {"rope_type": "default", "rope_theta": 9.0},
    },
    "dynamic": {"rope_parameters": {"rope_type": "dynamic", "factor": 3.0, "rope_theta": 500000.0}},
    "llama3": {
        "rope_parameters": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
            "rope_theta": 500000.0,
        }
    },
    "4.x-llama3": {
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 2.0,
            "high_freq_factor": 8.0,
            "original_max_position_embeddings": 128,
        },
    },
    "yarn": {"rope_parameters": {**YARN, "rope_theta": 50000.0}},
    "yarn-no-truncate-betas": {
        "rope_parameters": {**YARN, "truncate": False, "beta_fast": 8, "beta_slow": 2, "rope_theta": 50000.0}
    },
    "yarn-mscale": {"rope_parameters": {**YARN, "mscale": 0.707, "mscale_all_dim": 1.0}},
    "yarn-attention-factor": {"rope_parameters": {**YARN, "attention_factor": 1.25}},
    "yarn-null-factor": {"rope_parameters": {**YARN, "factor": None}},
    "yarn-default-original": {"rope_parameters": {"rope_type": "yarn", "factor": 2.0}},
    "yarn-top-level-original": {"original_max_position_embeddings": 64, "rope_parameters": {**YARN}},
    "4.x-yarn": {
        "rope_theta": 50000.0,
        "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
    },
}


def transformers_rotary(config: dict[str, Any]) -> torch.nn.Module:
    import transformers
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    from transformers.models.mistral.modeling_mistral import MistralRotaryEmbedding
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

    model_type = config["model_type"]
    config_class = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
    }
    rotary = {"llama": LlamaRotaryEmbedding, "mistral": MistralRotaryEmbedding, "qwen2": Qwen2RotaryEmbedding}
    return rotary[model_type](config_class[model_type].from_dict(json.loads(json.dumps(config))))


# The rope math is shared: the other architectures check only that they read the same fields.
ROPE_CASES = [(rope, "llama") for rope in ROPES] + [
    (rope, model_type)
    for model_type in ("mistral", "qwen2")
    for rope in ("absent", "4.x-theta", "5.x-theta", "4.x-linear-type", "yarn")
]


@pytest.mark.parametrize(("rope", "model_type"), ROPE_CASES)
def test_rope_bit_identical_to_transformers(rope: str, model_type: str) -> None:
    config = hf(model_type, **ROPES[rope])
    ours = parse_hf_config(config).rope
    theirs = transformers_rotary(config)
    inv = ours.inv_freq(16)
    assert torch.equal(inv, theirs.inv_freq), (inv, theirs.inv_freq)
    assert ours.attention_factor == theirs.attention_scaling
    # Positions up to max_position_embeddings (dynamic's exact range).
    cos, sin = theirs(torch.zeros(1), torch.arange(512)[None])
    our_cos, our_sin = rotary_tables(inv, 512, ours.attention_factor)
    assert torch.equal(our_cos, cos[0]) and torch.equal(our_sin, sin[0])


def test_rope_theta_read_from_rope_parameters() -> None:
    # The original defect: a 5.x config fell back to 10000.
    assert parse_hf_config(hf(**ROPES["5.x-theta"])).rope.theta == 100000.0
    assert parse_hf_config(hf(**ROPES["4.x-theta"])).rope.theta == 100000.0
    assert parse_hf_config(hf()).rope.theta == 10000.0


def test_architecture_defaults_follow_transformers() -> None:
    def without(model_type: str, *keys: str, **fields: Any) -> dict[str, Any]:
        config = hf(model_type, **fields)
        for key in keys:
            config.pop(key)
        return config

    llama = parse_hf_config(without("llama", "num_key_value_heads", "max_position_embeddings"))
    assert (llama.num_kv_heads, llama.max_position_embeddings, llama.sliding_window) == (4, 2048, None)
    mistral = parse_hf_config(
        without("mistral", "num_key_value_heads", "max_position_embeddings", num_attention_heads=16)
    )
    assert (mistral.num_kv_heads, mistral.max_position_embeddings, mistral.sliding_window) == (8, 131072, 4096)
    qwen2 = parse_hf_config(without("qwen2", "num_key_value_heads", num_attention_heads=32, hidden_size=256))
    assert (qwen2.num_kv_heads, qwen2.max_position_embeddings, qwen2.sliding_window) == (32, 512, None)
    assert parse_hf_config(hf("mistral", num_key_value_heads=None)).num_kv_heads == 4


def test_biases_head_dim_eps_tie() -> None:
    llama = parse_hf_config(
        hf(attention_bias=True, mlp_bias=True, head_dim=32, rms_norm_eps=1e-5, tie_word_embeddings=True)
    )
    assert (llama.qkv_bias, llama.o_proj_bias, llama.mlp_bias) == (True, True, True)
    assert (llama.head_dim, llama.rms_norm_eps, llama.tie_word_embeddings) == (32, 1e-5, True)
    plain = parse_hf_config(hf())
    assert (plain.qkv_bias, plain.o_proj_bias, plain.mlp_bias, plain.head_dim, plain.rms_norm_eps) == (
        False,
        False,
        False,
        16,
        1e-6,
    )
    # Qwen2 always has q/k/v biases and never o_proj / MLP ones; Mistral none (their modeling code).
    qwen2 = parse_hf_config(hf("qwen2", attention_bias=False, mlp_bias=True))
    assert (qwen2.qkv_bias, qwen2.o_proj_bias, qwen2.mlp_bias) == (True, False, False)
    mistral = parse_hf_config(hf("mistral", attention_bias=True))
    assert (mistral.qkv_bias, mistral.o_proj_bias) == (False, False)
    assert parse_hf_config(hf(hidden_act="swish")).architecture == "LlamaForCausalLM"


def test_dtype_from_either_generation() -> None:
    assert parse_hf_config(hf(torch_dtype="bfloat16")).checkpoint_dtype == torch.bfloat16
    assert parse_hf_config(hf(dtype="float16")).checkpoint_dtype == torch.float16
    assert parse_hf_config(hf(dtype="float16", torch_dtype="bfloat16")).checkpoint_dtype == torch.float16
    assert parse_hf_config(hf()).checkpoint_dtype is None


def test_qwen2_windows_follow_use_sliding_window_and_layer_types() -> None:
    assert parse_hf_config(hf("qwen2", use_sliding_window=False, sliding_window=64)).sliding_window is None
    on = {"use_sliding_window": True, "sliding_window": 64}
    assert parse_hf_config(hf("qwen2", **on, max_window_layers=1)).sliding_window == 64
    assert parse_hf_config(hf("qwen2", **on, max_window_layers=2)).sliding_window is None  # no layer >= 2
    full = ["full_attention", "full_attention"]
    assert parse_hf_config(hf("qwen2", **on, layer_types=full)).sliding_window is None
    assert parse_hf_config(hf("qwen2", **on, layer_types=["sliding_attention", "full_attention"])).sliding_window == 64
    # Llama has no window in its modeling code; Mistral's covers every layer, null = none.
    assert parse_hf_config(hf(sliding_window=64)).sliding_window is None
    assert parse_hf_config(hf("mistral", sliding_window=None)).sliding_window is None


REFUSED: list[tuple[dict[str, Any], str]] = [
    (hf(rope_parameters={"rope_type": "proportional", "factor": 2.0}), r"rope_parameters\.rope_type: 'proportional'"),
    (hf(rope_scaling={"type": "su", "factor": 2.0}), r"rope_scaling\.rope_type: 'su'"),
    (hf(rope_parameters={"rope_type": "proportional", "rope_theta": 1e4}), r"rope_parameters\.rope_type"),
    (
        hf(rope_parameters={"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0}),
        r"rope_parameters\.low_freq_factor",
    ),
    (hf(rope_parameters={"rope_type": "linear"}), r"rope_parameters\.factor"),
    (hf(rope_parameters={"rope_type": "yarn"}), r"rope_parameters\.factor"),
    (hf(rope_parameters={"rope_type": "default", "rope_theta": None}), r"rope_parameters\.rope_theta"),
    (hf(rope_parameters={"full_attention": {"rope_type": "default"}}), r"rope_parameters: per-layer-type"),
    (hf(rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.5}), r"partial_rotary_factor"),
    (hf(partial_rotary_factor=0.25), r"partial_rotary_factor"),
    (hf(hidden_act="quick_gelu"), r"hidden_act: 'quick_gelu'"),
    (hf(quantization_config={"quant_method": "bitsandbytes"}), r"quantization_config.quant_method: 'bitsandbytes'"),
    (hf(num_key_value_heads=3), r"num_key_value_heads"),
    (hf(head_dim=15), r"head_dim"),
    (hf(dtype="float64"), r"dtype: 'float64'"),
    (hf(architectures=["GPT2LMHeadModel"]), r"architectures: 'GPT2LMHeadModel'"),
    (
        hf("qwen2", use_sliding_window=True, sliding_window=64, layer_types=["full_attention", "chunked_attention"]),
        r"layer_types: 'chunked_attention'",
    ),
    (
        hf("qwen2", use_sliding_window=False, layer_types=["sliding_attention", "full_attention"]),
        r"layer_types: .*no window",
    ),
    (hf("qwen2", layer_types=["full_attention"]), r"layer_types: expected a list of 2"),
    (hf("mistral", sliding_window=0), r"sliding_window"),
]


@pytest.mark.parametrize(("config", "match"), REFUSED, ids=[m.split(":")[0].replace("\\", "") for _, m in REFUSED])
def test_unsupported_fields_are_refused(config: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_hf_config(config)


# -------------------------------------------------------- max_model_len vs what can be served


def write(path: Path, config: dict[str, Any]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_dynamic_rope_only_within_max_position_embeddings(tmp_path: Path) -> None:
    path = write(tmp_path, hf(rope_parameters={"rope_type": "dynamic", "factor": 2.0}))
    assert ModelConfig.from_pretrained(path).max_model_len == 512
    with pytest.raises(ValueError, match=r"rope_parameters: rope_type 'dynamic'.*max_model_len <= 512"):
        ModelConfig.from_pretrained(path, max_model_len=513)


def _five_x(path: Path, **fields: Any) -> Path:
    """The tiny checkpoint with its config.json moved to the 5.x spelling, plus `fields`."""
    config = json.loads((path / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": config.pop("rope_theta")}
    config.pop("rope_scaling")
    config["dtype"] = config.pop("torch_dtype")
    config.update(fields)
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize(
    ("fields", "max_model_len", "match"),
    [
        (
            {"rope_parameters": {"rope_type": "proportional", "rope_theta": 1e4}},
            128,
            r"rope_parameters\.rope_type: 'proportional'",
        ),
        ({"hidden_act": "quick_gelu"}, 128, r"hidden_act"),
    ],
    ids=["rope-type", "hidden-act"],
)
def test_engine_refuses_at_load(tmp_path: Path, fields: dict[str, Any], max_model_len: int, match: str) -> None:
    path = _five_x(make_tiny_model(tmp_path / "m"), **fields)
    with pytest.raises(ValueError, match=match):
        EngineArgs(model=str(path), max_model_len=max_model_len).create_engine_config()


def test_a_window_shorter_than_max_model_len_is_served(tmp_path: Path) -> None:
    """Windowed attention is implemented: the window no longer limits max_model_len."""
    fields = {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": 64}
    path = _five_x(make_tiny_model(tmp_path / "m"), **fields)
    config = EngineArgs(model=str(path), max_model_len=128).create_engine_config()
    assert (config.model.max_model_len, config.model.sliding_window) == (128, 64)
    assert EngineArgs(model=str(path)).create_engine_config().model.max_model_len == 512
