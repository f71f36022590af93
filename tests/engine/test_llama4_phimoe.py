"""Native Llama 4 (text) and Phi-MoE (issue 42, item 2): transformers' tokens without the backend.

Tiny checkpoints written by the installed transformers' `Llama4TextConfig` / `PhimoeConfig` and
`save_pretrained` (fp32, hidden 64), weights redrawn as test_transformers_backend.py redraws them,
each family's distinguishing fields set where a wrong reading changes the tokens:
- Llama 4: a chunked RoPE layer (chunks of 8: every prompt crosses several), a NoPE layer with
  temperature tuning (floor_scale 4: the factor changes every 4 positions), q/k L2 norms, an MoE
  layer after a dense one (`interleave_moe_layer_step` 2); a variant with the norms and the tuning
  off, two experts a token and attention biases;
- Phi-MoE: attention and head biases, a window shorter than the prompts (and none), LongRoPE with distinct
  short and long mscales, and a `router_jitter_noise` large enough that the sparsemixer's
  softmax spans several experts.
Through the engine core with chunked prefill, a prefix-cache hit and a forced preemption, 3
prompts x 16 greedy tokens must be transformers' (logprobs within 1e-3), and the Transformers
backend must give the native tokens. Malformed fields are refused at load, naming the field.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from test_transformers_backend import assert_parity, engine_greedy, hf_greedy, prompts
from tinymodel import build_tokenizer, write_tokenizer

from triollm.engine.config import EngineArgs
from triollm.engine.loading.model_config import ModelConfig

_COMMON = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "intermediate_size": 48, "rms_norm_eps": 1e-5, "num_local_experts": 4}  # fmt: skip
LLAMA4 = {**_COMMON, "head_dim": 16, "attention_chunk_size": 8, "no_rope_layers": [1, 0], "floor_scale": 4,
          "attn_scale": 0.5, "intermediate_size_mlp": 96, "interleave_moe_layer_step": 2,
          "num_experts_per_tok": 1}  # fmt: skip
LLAMA4_PLAIN = {**LLAMA4, "use_qk_norm": False, "attn_temperature_tuning": False, "num_experts_per_tok": 2,
                "attention_bias": True}  # fmt: skip
_HALF = 8  # head_dim 16: LongRoPE's factors are per half-dim
PHIMOE = {**_COMMON, "attention_bias": True, "lm_head_bias": True, "num_experts_per_tok": 2,
          "router_jitter_noise": 0.3, "rope_parameters": {
              "rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 128,
              "short_factor": [1.0 + 0.25 * i for i in range(_HALF)], "long_factor": [4.0] * _HALF,
              "short_mscale": 1.2, "long_mscale": 1.5}}  # fmt: skip


def make_model(path: Path, config_class: str, arch: str, fields: dict[str, Any], seed: int) -> Path:
    import transformers

    eos = write_tokenizer(path)
    cfg = getattr(transformers, config_class)(
        vocab_size=build_tokenizer().get_vocab_size(), max_position_embeddings=512, bos_token_id=None,
        eos_token_id=eos, pad_token_id=None, tie_word_embeddings=False, dtype="float32", **fields,
    )  # fmt: skip
    cfg.architectures = [arch]
    model = getattr(transformers, arch)(cfg).to(torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if p.ndim == 1:
                p.copy_(1 + 0.1 * noise if name.endswith("weight") else 0.1 * noise)  # norms' scales; biases
            else:
                p.copy_(noise * (0.5 if "embed" in name or "lm_head" in name else 0.2))
    model.save_pretrained(path)
    return path


def _native_and_backend(path: Path, cls: type, *, backend: bool = True) -> None:
    ids = prompts()
    native, core = engine_greedy(path, ids)
    assert isinstance(core.executor.model, cls)
    assert_parity(native, hf_greedy(path, ids))
    stats = core.statistics()
    assert stats.prefix_cache_hit_rate > 0 and stats.num_preemptions > 0
    if backend:
        through_backend, _ = engine_greedy(path, ids, model_impl="transformers")
        assert_parity(through_backend, native)


@pytest.mark.parametrize("fields", [LLAMA4, LLAMA4_PLAIN], ids=["nope-tuned-qknorm", "plain-top2-bias"])
def test_native_llama4_gives_transformers_and_the_backends_tokens(tmp_path: Path, fields: dict[str, Any]) -> None:
    from triollm.engine.execution.models.llama4 import Llama4ForCausalLM

    path = make_model(tmp_path / "llama4", "Llama4TextConfig", "Llama4ForCausalLM", fields, seed=4)
    cfg = ModelConfig.from_pretrained(path, max_model_len=96)
    assert cfg.llama4 is not None and cfg.llama4.chunks == (8, None) and cfg.llama4.rope_layers == (True, False)
    assert cfg.moe is not None and cfg.moe.sparse_layers == (False, True)
    _native_and_backend(path, Llama4ForCausalLM)
    with pytest.raises(ValueError, match=r"enable_lora: LoRA adapters are not supported for Llama4ForCausalLM"):
        EngineArgs(model=str(path), max_model_len=96, enable_lora=True).create_engine_config()


@pytest.mark.parametrize("window", [40, None], ids=["window", "no-window"])
def test_native_phimoe_gives_transformers_and_the_backends_tokens(tmp_path: Path, window: int | None) -> None:
    """With a window, against transformers only: transformers' PhimoeAttention leaves its window to
    the mask, which the backend does not build, so the backend refuses such a checkpoint at load."""
    from triollm.engine.execution.models.phimoe import PhimoeForCausalLM

    fields = {**PHIMOE, "sliding_window": window}
    path = make_model(tmp_path / "phimoe", "PhimoeConfig", "PhimoeForCausalLM", fields, seed=7)
    cfg = ModelConfig.from_pretrained(path, max_model_len=96)
    assert cfg.lm_head_bias and cfg.sliding_window == window and cfg.rope.attention_factor == 1.2
    _native_and_backend(path, PhimoeForCausalLM, backend=window is None)
    if window is not None:  # the backend refuses it at load rather than attend past the window
        with pytest.raises(ValueError, match=r"layer 0 has a sliding window \(sliding_window\) that its attention"):
            engine_greedy(path, prompts(), model_impl="transformers")


def test_sparsemixer_weights_mask_the_first_expert_for_the_second() -> None:
    """The second weight is a softmax over the logits near the second-best, the first masked out."""
    from triollm.engine.execution.models.phimoe import sparsemixer

    logits = torch.tensor([[2.0, 1.9, 1.85, -3.0], [1.0, 5.0, 0.0, 4.9]])
    weights, ids = sparsemixer(logits, eps=0.05)  # near: (max - s) / max(|s|, max) <= 0.1
    assert ids.tolist() == [[0, 1], [1, 3]]
    first = torch.softmax(torch.tensor([2.0, 1.9, 1.85]), 0)[0]
    second = torch.softmax(torch.tensor([1.9, 1.85]), 0)[0]
    assert torch.allclose(weights[0], torch.stack([first, second]))
    assert torch.allclose(weights[1], torch.stack([torch.softmax(torch.tensor([5.0, 4.9]), 0)[0], torch.tensor(1.0)]))


_TEXT = {**_COMMON, "head_dim": 16, "vocab_size": 384, "max_position_embeddings": 512}
REFUSED = [
    ("Llama4ForCausalLM", {"no_rope_layers": [1, 2]}, r"no_rope_layers: expected at least 2 entries of 0 or 1"),
    ("Llama4ForCausalLM", {"moe_layers": [0, 2]}, r"moe_layers: expected a list of layer indices in \[0, 2\)"),
    ("Llama4ForCausalLM", {"layer_types": ["sliding_attention", "full_attention"]},
     r"layer_types: expected 2 of full_attention, chunked_attention"),
    ("Llama4ForCausalLM", {"attention_chunk_size": None, "layer_types": ["chunked_attention", "full_attention"]},
     r"attention_chunk_size: None for 'chunked_attention' layers"),
    ("Llama4ForCausalLM", {"floor_scale": 0}, r"floor_scale: expected a positive number"),
    ("Llama4ForCausalLM", {"attn_temperature_tuning": "yes"}, r"attn_temperature_tuning: expected true or false"),
    ("Llama4ForCausalLM", {"num_experts_per_tok": 5}, r"num_experts_per_tok: 5 exceeds num_local_experts 4"),
    ("Llama4ForCausalLM", {"quantization_config": {"quant_method": "fp8"}}, r"quantization_config: quantized Llama4"),
    ("PhimoeForCausalLM", {"num_experts_per_tok": 1}, r"num_experts_per_tok: PhimoeForCausalLM's sparsemixer routes"),
    ("PhimoeForCausalLM", {"router_jitter_noise": -0.1}, r"router_jitter_noise: expected a number >= 0"),
    ("PhimoeForCausalLM", {"lm_head_bias": True, "tie_word_embeddings": True}, r"lm_head_bias: a biased lm_head"),
    ("PhimoeForCausalLM", {"hidden_act": "gelu"}, r"hidden_act: 'gelu' is not supported for PhimoeForCausalLM"),
    ("PhimoeForCausalLM", {"rope_parameters": {**PHIMOE["rope_parameters"], "long_mscale": None}},
     r"rope_parameters.long_mscale: required for Phi-MoE's longrope"),
]  # fmt: skip


@pytest.mark.parametrize(("arch", "fields", "match"), REFUSED, ids=[f"{a}-{next(iter(f))}" for a, f, _ in REFUSED])
def test_malformed_fields_are_refused_at_load(tmp_path: Path, arch: str, fields: dict[str, Any], match: str) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": [arch], **_TEXT, **fields}))
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_pretrained(tmp_path, max_model_len=64)


def test_phimoe_longrope_takes_the_long_mscale_past_the_original_length() -> None:
    """Past `original_max_position_embeddings`, transformers scales by `long_mscale` but keeps the
    short factors' frequencies: so does a longer engine."""
    from triollm.engine.loading.hf_config import parse_hf_config

    spec = parse_hf_config({"architectures": ["PhimoeForCausalLM"], **_TEXT, **PHIMOE})
    short_cos, _ = spec.rope.tables(16, 96)
    long_cos, _ = spec.rope.tables(16, 256)
    assert torch.allclose(long_cos[:96] / 1.5, short_cos / 1.2)


def test_native_llama4_on_the_triton_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA code path under the interpreter: the fused Triton rotary and cache write (the NoPE
    layer's identity tables too), then the Triton attention with chunks."""
    from triollm.engine.execution.models.llama4 import Llama4ForCausalLM

    monkeypatch.setenv("TRIOLLM_KERNELS", "triton")
    path = make_model(tmp_path / "llama4", "Llama4TextConfig", "Llama4ForCausalLM", LLAMA4, seed=4)
    ids = prompts()
    ours, core = engine_greedy(path, ids, dtype="float32")
    assert isinstance(core.executor.model, Llama4ForCausalLM) and core.executor.model.triton
    assert_parity(ours, hf_greedy(path, ids))


def test_phimoe_loads_transformers_5s_stacked_experts_too(tmp_path: Path) -> None:
    """The released names (`block_sparse_moe.experts.N.w1`, `gate`) and transformers 5's own
    (`mlp.experts.gate_up_proj`, `mlp.router`) give the same model."""
    import transformers

    from triollm.engine.execution.models import load_model

    original = make_model(tmp_path / "original", "PhimoeConfig", "PhimoeForCausalLM", PHIMOE, seed=7)
    stacked = tmp_path / "stacked"
    hf = transformers.AutoModelForCausalLM.from_pretrained(original, dtype=torch.float32)
    hf.save_pretrained(stacked, save_original_format=False)
    from safetensors import safe_open

    with safe_open(str(stacked / "model.safetensors"), framework="pt") as f:
        assert {"model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.router.weight"} <= set(f.keys())
    a, b = (load_model(ModelConfig.from_pretrained(p, max_model_len=64)) for p in (original, stacked))
    x = torch.randn(3, 64)
    for la, lb in zip(a.layers, b.layers, strict=True):
        assert torch.equal(la.mlp.experts.w13, lb.mlp.experts.w13) and torch.equal(la.mlp.experts.w2, lb.mlp.experts.w2)
        assert torch.equal(la.mlp.gate.forward(x), lb.mlp.gate.forward(x))


def test_llama4_reads_4x_spellings_of_temperature_tuning() -> None:
    """transformers 4.x wrote `attn_temperature_tuning` as an int it read as truthy, and a float
    `floor_scale` divides as well; null or false turn the tuning off."""
    from triollm.engine.loading.hf_config import parse_hf_config

    def temperature(**fields: Any) -> Any:
        spec = parse_hf_config({"architectures": ["Llama4ForCausalLM"], **_TEXT, **fields}).llama4
        assert spec is not None
        return spec.temperature

    assert temperature(attn_temperature_tuning=4, floor_scale=2.0, attn_scale=0.2) == (2.0, 0.2)
    assert temperature() == (8192.0, 0.1)
    assert temperature(attn_temperature_tuning=None) is None and temperature(attn_temperature_tuning=False) is None


@pytest.mark.parametrize("arch", ["Llama4ForCausalLM", "PhimoeForCausalLM"])
def test_tensor_parallelism_is_refused(tmp_path: Path, arch: str) -> None:
    from triollm.engine.distributed.sharding import TPShard
    from triollm.engine.execution.models import MODELS

    (tmp_path / "config.json").write_text(json.dumps({"architectures": [arch], **_TEXT}))
    cfg = ModelConfig.from_pretrained(tmp_path, max_model_len=64)
    with (
        pytest.raises(ValueError, match=r"tensor_parallel_size: .* \(routed experts\) is not supported"),
        torch.device("meta"),
    ):
        MODELS[arch](cfg, TPShard(0, 2))
