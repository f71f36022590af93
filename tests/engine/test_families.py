"""Every decoder family against transformers: greedy tokens and chosen-token logprobs.

Each tiny model is written by the installed transformers' own config class and `save_pretrained`
(tinymodel.make_transformers_model), with the fields that make the family what it is set away
from their defaults where a wrong reading would change the numbers: q/k norms, Gemma's
soft-capping and scalars, Granite's multipliers, Phi-3's partial rotary and LongRoPE, windows
shorter than the prompts, routed experts with renormalisation on and off. The engine runs with
chunked prefill, prefix-cache hits and preemption in the mix (test_parity.REGIMES).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from test_parity import assert_parity, engine_greedy, hf_greedy, tiny_prompts
from tinymodel import make_transformers_model

from triollm.engine.loading.model_config import ModelConfig

MOE = {"num_experts_per_tok": 2, "num_local_experts": 8}
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3": ("Qwen3ForCausalLM", {"head_dim": 32, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}),
    "qwen3-window": (
        "Qwen3ForCausalLM",
        {"head_dim": 16, "use_sliding_window": True, "sliding_window": 12, "max_window_layers": 1, "layer_types": None},
    ),
    "qwen3-moe": ("Qwen3MoeForCausalLM", {"moe_intermediate_size": 48, "norm_topk_prob": True, **MOE}),
    "qwen3-moe-unnormalized": (
        "Qwen3MoeForCausalLM",
        {"moe_intermediate_size": 48, "norm_topk_prob": False, "mlp_only_layers": [1], **MOE},
    ),
    "mixtral": ("MixtralForCausalLM", {"intermediate_size": 48, "sliding_window": None, **MOE}),
    "gemma": ("GemmaForCausalLM", {"head_dim": 16, "tie_word_embeddings": True}),
    "gemma2": (
        "Gemma2ForCausalLM",
        {
            "head_dim": 16,
            "query_pre_attn_scalar": 24,
            "attn_logit_softcapping": 5.0,
            "final_logit_softcapping": 3.0,
            "sliding_window": 10,
        },
    ),
    "gemma3": (
        "Gemma3ForCausalLM",
        {
            "head_dim": 16,
            "query_pre_attn_scalar": 20,
            "sliding_window": 9,
            "layer_types": ["sliding_attention", "full_attention"],
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 5000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 200000.0},
            },
        },
    ),
    "phi3-partial-longrope": (
        "Phi3ForCausalLM",
        {
            "max_position_embeddings": 512,
            # = engine_greedy's max_model_len: the short factors, transformers' for every test
            # sequence (shorter than 160); the tables test checks the long ones too.
            "original_max_position_embeddings": 160,
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
                "short_factor": [1.0, 1.5, 2.0, 3.0],
                "long_factor": [2.0, 3.0, 4.0, 6.0],
            },
        },
    ),
    "olmo2": (
        "Olmo2ForCausalLM",
        {"attention_bias": False, "rope_parameters": {"rope_type": "default", "rope_theta": 50000.0}},
    ),
    "granite": (
        "GraniteForCausalLM",
        {"embedding_multiplier": 3.0, "residual_multiplier": 0.4, "attention_multiplier": 0.1, "logits_scaling": 2.5},
    ),
}
PROMPTS = tiny_prompts()  # the second four share prefixes with the first (prefix-cache hits)
REGIMES = ("chunked", "prefix", "preempt")


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {
        name: make_transformers_model(tmp_path_factory.mktemp(name), arch, seed=30 + i, **overrides)
        for i, (name, (arch, overrides)) in enumerate(CASES.items())
    }


@pytest.fixture(scope="module")
def references(model_dirs: dict[str, Path]) -> dict[str, list[tuple[list[int], list[float]]]]:
    """transformers' greedy tokens and logprobs per case, computed once, on first use."""

    class Lazy(dict):  # type: ignore[type-arg]
        def __missing__(self, case: str) -> list[tuple[list[int], list[float]]]:
            self[case] = hf_greedy(model_dirs[case], PROMPTS)
            return self[case]  # type: ignore[no-any-return]

    return Lazy()


@pytest.mark.parametrize("regime", REGIMES)
@pytest.mark.parametrize("case", list(CASES))
def test_family_greedy_parity(model_dirs: dict[str, Path], references: dict[str, Any], case: str, regime: str) -> None:
    ours, core = engine_greedy(model_dirs[case], PROMPTS, regime)
    assert_parity(ours, references[case])
    stats = core.statistics()
    if regime == "prefix":
        assert stats.prefix_cache_hit_rate > 0.2
    if regime == "preempt":
        assert stats.num_preemptions > 0


def test_family_configs_parse(model_dirs: dict[str, Path]) -> None:
    cfg = ModelConfig.from_pretrained(model_dirs["gemma3"], max_model_len=160)
    assert cfg.layer_types == ("sliding_attention", "full_attention") and cfg.sliding_window == 9
    assert cfg.local_rope is not None and cfg.local_rope.theta == 5000.0 and cfg.rope.rope_type == "linear"
    phi = ModelConfig.from_pretrained(model_dirs["phi3-partial-longrope"], max_model_len=160)
    assert phi.rotary_dim == 8 and phi.rope.rope_type == "longrope" and phi.fused_checkpoint


def test_longrope_tables_match_transformers(model_dirs: dict[str, Path]) -> None:
    """Under a max_model_len within original_max_position_embeddings (160) the short factors' rows,
    beyond it the long factors' rows for every position, each as transformers' Phi3RotaryEmbedding
    computes them for a sequence of that length (rope_config's module note; the parity tests cover
    the short case whole, tests/engine/test_long_context.py a prompt longer than the original length)."""
    import torch
    import transformers

    path = model_dirs["phi3-partial-longrope"]
    hf_cfg = transformers.AutoConfig.from_pretrained(path)
    rotary = transformers.models.phi3.modeling_phi3.Phi3RotaryEmbedding(hf_cfg)
    x = torch.zeros(1, dtype=torch.float32)
    for max_model_len in (160, 200):
        cfg = ModelConfig.from_pretrained(path, max_model_len=max_model_len)
        cos, sin = cfg.rope.tables(cfg.rotary_dim or cfg.head_dim, max_model_len)
        ref_cos, ref_sin = rotary(x, torch.arange(max_model_len)[None])  # the whole sequence at once
        torch.testing.assert_close(cos, ref_cos[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(sin, ref_sin[0], rtol=1e-5, atol=1e-6)
    short, long = (ModelConfig.from_pretrained(path, max_model_len=n).rope.tables(8, n)[0] for n in (160, 200))
    assert not torch.allclose(short[1:160], long[1:160])  # the two sets of factors differ


def _config(arch: str, **fields: Any) -> dict[str, Any]:
    base = {"architectures": [arch], "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 384}  # fmt: skip
    return base | fields


REFUSED = [
    (_config("Qwen3MoeForCausalLM", shared_expert_intermediate_size=32), "shared_expert_intermediate_size"),
    (_config("Gemma3ForCausalLM", use_bidirectional_attention=True), "use_bidirectional_attention"),
    (_config("Qwen3MoeForCausalLM", mlp_only_layers="all"), "mlp_only_layers"),
    (_config("Phi3ForCausalLM", partial_rotary_factor=0.01), "partial_rotary_factor"),
    (_config("Phi3ForCausalLM", rope_scaling={"rope_type": "longrope", "short_factor": [1.0]}), "long_factor"),
    (
        _config(
            "Phi3ForCausalLM", rope_scaling={"type": "longrope", "short_factor": [1.0] * 3, "long_factor": [1.0] * 3}
        ),
        "longrope factors",
    ),
    (_config("Gemma2ForCausalLM", attn_logit_softcapping=-1), "attn_logit_softcapping"),
    (_config("GraniteForCausalLM", logits_scaling=0), "logits_scaling"),
    # No native class and nothing the Transformers backend can page (model_impl "auto").
    (
        _config("MiniMaxForCausalLM", layer_types=["linear_attention", "full_attention"]),
        "layer_types: 'linear_attention' layers cannot be paged",
    ),
]


@pytest.mark.parametrize(("config", "match"), REFUSED, ids=[m.split(":")[0].split(" ")[0] for _, m in REFUSED])
def test_unsupported_family_fields_are_refused(tmp_path: Path, config: dict[str, Any], match: str) -> None:
    import json

    from triollm.engine.execution.models import load_model

    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=match):
        cfg = ModelConfig.from_pretrained(tmp_path, max_model_len=64)
        load_model(cfg)  # what only the model's tables can check (the longrope factors' count)


@pytest.mark.parametrize(
    ("arch", "why"), [("Olmo2ForCausalLM", "q/k norm spans all heads"), ("MixtralForCausalLM", "routed experts")]
)
def test_tensor_parallel_refusals(tmp_path: Path, arch: str, why: str) -> None:
    import json

    from triollm.engine.distributed.sharding import TPShard
    from triollm.engine.execution.models import MODELS

    (tmp_path / "config.json").write_text(json.dumps(_config(arch)))
    cfg = ModelConfig.from_pretrained(tmp_path, max_model_len=64)
    with pytest.raises(ValueError, match=f"tensor_parallel_size: .*{why}"), torch_meta():
        MODELS[arch](cfg, TPShard(0, 2))


def torch_meta() -> Any:
    import torch

    return torch.device("meta")


def test_families_resolve_by_hub_id_offline(
    model_dirs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every family from a Hugging Face cache in huggingface_hub's layout, by repo id, offline;
    one of them generates the tokens its directory gives."""
    import socket

    from test_hub_resolve import add_snapshot

    from triollm import LLM, SamplingParams
    from triollm.engine.config import EngineArgs

    def refuse(self: socket.socket, address: Any) -> None:
        raise AssertionError(f"a test tried to connect to {address}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cache = tmp_path / "hub"
    for i, (case, path) in enumerate(model_dirs.items()):
        add_snapshot(cache, f"tiny/{case}", path, f"{i:040x}", ("main",))
    for case, (arch, _) in CASES.items():
        config = EngineArgs(model=f"tiny/{case}", download_dir=str(cache), max_model_len=64).create_engine_config()
        assert config.model.architecture == arch
        assert config.model.path.parent.parent.name == f"models--tiny--{case}"
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    with LLM("tiny/qwen3-moe", download_dir=str(cache), max_model_len=64, multiprocess=False) as llm:
        by_id = llm.generate([{"prompt_token_ids": PROMPTS[1]}], params, use_tqdm=False)[0].outputs[0].token_ids
    ref, _ = engine_greedy(model_dirs["qwen3-moe"], [PROMPTS[1]], "plain")
    assert list(by_id) == ref[0][0][:8]


@pytest.mark.parametrize("case", ["gemma3", "phi3-partial-longrope"])
def test_triton_path_equals_the_torch_path(
    model_dirs: dict[str, Path], case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CUDA code path under the Triton interpreter: Gemma 3's windowed and global layers with
    their two RoPEs and q/k norms, Phi-3's partial rotary (rotated outside the fused kernel)."""
    pytest.importorskip("triton", reason="triton is not installed")
    from test_triton_path import PROMPTS as TRITON_PROMPTS
    from test_triton_path import _greedy

    # One prompt long enough to fill a cached block (a prefix hit in the second round), four
    # tokens: the interpreter runs every kernel launch in Python.
    kw = {"prompts": [TRITON_PROMPTS[2]], "max_tokens": 4}
    assert _greedy(model_dirs[case], "triton", monkeypatch, **kw) == _greedy(
        model_dirs[case], "torch", monkeypatch, **kw
    )


def test_tensor_parallel_gemma3_equals_one_rank(model_dirs: dict[str, Path]) -> None:
    """Two ranks: q/k norms, windows and the local RoPE on each rank's heads."""
    from test_tensor_parallel import _generate, _wait_no_workers

    assert _generate(model_dirs["gemma3"], 2) == _generate(model_dirs["gemma3"], 1)
    _wait_no_workers()


@pytest.mark.parametrize("case", ["gemma3", "qwen3-moe"])
def test_int8_weights_on_other_families(model_dirs: dict[str, Path], references: dict[str, Any], case: str) -> None:
    """`quantization="int8"` swaps every projection of the decoder layers (experts and routers
    stay dense) and stays close to the dense model's numbers."""
    from triollm.engine.execution.layers.quantized import QuantLinear

    ours, core = engine_greedy(model_dirs[case], PROMPTS[:4], "plain", quantization="int8")
    model = core.model
    assert model is not None
    layer = model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, QuantLinear) and isinstance(layer.self_attn.o_proj, QuantLinear)
    if case == "qwen3-moe":
        assert not isinstance(layer.mlp.gate, QuantLinear)
    else:
        assert isinstance(layer.mlp.gate_up_proj, QuantLinear)
    # int8 blocks move these tiny models' logprobs by ~0.1 (as on Llama): a projection stacked
    # in the wrong order would move them by whole units and change most tokens.
    same = [(lps[0], ref[1][0]) for (tokens, lps), ref in zip(ours, references[case][:4]) if tokens[0] == ref[0][0]]
    assert len(same) >= 3 and all(abs(a - b) < 0.25 for a, b in same)
