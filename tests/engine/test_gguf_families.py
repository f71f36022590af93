"""Every family from GGUF files made by llama.cpp's own converter (tests/llama_cpp_convert.py).

Each tiny random checkpoint is written by transformers' own `save_pretrained`
(tinymodel.make_transformers_model), converted to an F32 GGUF by `convert_hf_to_gguf.py`, and run
with `LLM("x.gguf")`: the greedy tokens for three prompts must be transformers' on the source
directory, and the prompts' token ids the source tokenizer's. What each family's conversion
changes is in play: Q/K rows and biases permuted (llama, Mixtral, Granite and Granite MoE), q/k
norms (Qwen3, OLMo 2, OLMoE, GLM-4.5), 3-D expert tensors and routers (Mixtral, Qwen3-MoE, OLMoE,
Qwen2-MoE with its shared expert, GLM-4.5's sigmoid-scored experts with partial rotary), experts
whose gate and up the import joins again (gpt-oss interleaved, with sinks and windows; Granite
MoE, with and without a shared MLP), Phi-3's fused q|k|v and gate|up with partial rotary and
LongRoPE factors stored as tensors, Granite's multipliers, OLMo 2's post-norms. Gemma's families
(SentencePiece vocabularies) are in test_gguf_sentencepiece.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from llama_cpp_convert import convert
from tinymodel import make_transformers_model
from tokenizers import Tokenizer

from triollm import LLM, SamplingParams

MOE = {"num_experts_per_tok": 2, "num_local_experts": 8}
DEEPSEEK = {
    "num_key_value_heads": 4, "intermediate_size": 96, "moe_intermediate_size": 32, "n_routed_experts": 8,
    "num_experts_per_tok": 2, "first_k_dense_replace": 1, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8, "v_head_dim": 12,
}  # fmt: skip
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": (
        "LlamaForCausalLM",
        {"attention_bias": True, "rope_parameters": {"rope_type": "default", "rope_theta": 50000.0}},
    ),
    "mixtral": ("MixtralForCausalLM", {"intermediate_size": 48, "sliding_window": None, **MOE}),
    "qwen2": ("Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3ForCausalLM", {"head_dim": 32, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}),
    "qwen3moe": (
        "Qwen3MoeForCausalLM",
        {"moe_intermediate_size": 48, "norm_topk_prob": True, "num_experts": 8,
         "num_experts_per_tok": 2},
    ),
    # routed experts not renormalised, a shared expert behind its one-row sigmoid gate
    "qwen2moe": (
        "Qwen2MoeForCausalLM",
        {"moe_intermediate_size": 48, "shared_expert_intermediate_size": 96, "num_experts": 8,
         "num_experts_per_tok": 2, "norm_topk_prob": False},
    ),
    # sinks, windows on even layers (shorter than the prompts), biased router and experts, the
    # clamped SwiGLU, YaRN (the config's default) without truncation
    "gpt-oss": (
        "GptOssForCausalLM",
        {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 48, "head_dim": 16,
         "sliding_window": 8},
    ),
    "olmo2": ("Olmo2ForCausalLM", {"attention_bias": False}),
    # partial rotary, q/k norms, a leading dense layer, sigmoid-scored experts with a correction
    # bias, scaled, and a shared expert; one multi-token-prediction layer in the config (left out)
    "glm4moe": (
        "Glm4MoeForCausalLM",
        {"n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 48, "n_shared_experts": 1,
         "first_k_dense_replace": 1, "num_nextn_predict_layers": 1, "use_qk_norm": True, "head_dim": 32,
         "partial_rotary_factor": 0.5, "routed_scaling_factor": 2.5, "norm_topk_prob": True, "vocab_size": 392,
         "attention_bias": True},
    ),
    "olmoe": ("OlmoeForCausalLM", {"num_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 48}),
    # multi-head latent attention (kv_b split by the converter into k_b and v_b, joined again), a
    # low-rank q, a leading dense layer, sigmoid-scored grouped experts with a correction bias,
    # scaled and renormalised, a shared expert, YaRN with DeepSeek's mscale (log multiplier)
    "deepseek-v3": (
        "DeepseekV3ForCausalLM",
        {**DEEPSEEK, "q_lora_rank": 24, "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5,
         "n_shared_experts": 1, "scoring_func": "sigmoid",
         "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 0.5,
                             "mscale_all_dim": 0.5, "original_max_position_embeddings": 128}},
    ),
    # chunked attention (llama.cpp fixes 8192-token chunks) on three of four layers, the fourth
    # global without rotary and with temperature tuning, q/k L2 norms, experts on every second
    # layer (sigmoid-scaled inputs, gate|up joined back) with a shared expert, dense MLPs between,
    # Llama 4's rope scaling (llama3 with equal low and high frequency factors)
    "llama4": (
        "Llama4ForCausalLM",
        {"num_hidden_layers": 4, "intermediate_size": 48, "intermediate_size_mlp": 96, "num_local_experts": 4,
         "num_experts_per_tok": 1, "interleave_moe_layer_step": 2, "head_dim": 16, "attention_chunk_size": 8192,
         "use_qk_norm": True, "floor_scale": 8192, "attn_scale": 0.1,
         "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 1.0, "original_max_position_embeddings": 8192}},
    ),
    # V2-Lite's shape: q straight from the hidden state, softmax-scored experts (greedy top-k, not
    # renormalised), two shared experts
    "deepseek-v2": (
        "DeepseekV2ForCausalLM",
        {**DEEPSEEK, "q_lora_rank": None, "topk_method": "greedy", "n_shared_experts": 2, "scoring_func": "softmax",
         "routed_scaling_factor": 1.0},
    ),
    "granite": (
        "GraniteForCausalLM",
        {"embedding_multiplier": 3.0, "residual_multiplier": 0.4, "attention_multiplier": 0.1, "logits_scaling": 2.5},
    ),
    "granitemoe": (
        "GraniteMoeForCausalLM",
        {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 48, "embedding_multiplier": 3.0,
         "residual_multiplier": 0.4, "attention_multiplier": 0.1, "logits_scaling": 2.5},
    ),
    "granitemoeshared": (
        "GraniteMoeSharedForCausalLM",
        {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 48, "shared_intermediate_size": 64,
         "logits_scaling": 2.5},
    ),
    "phi3": (
        "Phi3ForCausalLM",
        {
            "max_position_embeddings": 512,
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
}
# Architectures without a table in gguf_arch.py: imported through transformers' GGUF reader (dense),
# then run by the Transformers backend or a native class.
THROUGH_TRANSFORMERS: dict[str, tuple[str, dict[str, Any]]] = {
    "starcoder2": ("Starcoder2ForCausalLM", {}),
    "stablelm": ("StableLmForCausalLM", {}),
    # tied: the converter writes no output.weight, and the import must say tied, keeping one copy
    "starcoder2-tied": ("Starcoder2ForCausalLM", {"tie_word_embeddings": True}),
}
# The tokenizer class transformers reads the source with (and the converter sees): Qwen's own
# (its digit split: the GGUF says "qwen2"), GPT-2's for Phi-3 (the converter's choice of a BPE
# vocabulary, as for Phi-4), else the tokenizer.json as written.
TOKENIZER_CLASS = {"qwen2": None, "qwen3": None, "qwen3moe": None, "qwen2moe": None, "phi3": "GPT2Tokenizer"}
GLM_SPECIALS = ("<|endoftext|>", "[gMASK]", "<|user|>", "<|observation|>")
GLM_SPECIALS_FOR = ("glm4moe",)  # its config's vocab_size leaves room for them
PROMPTS = [
    "The capital of France is Paris. The capital of",
    "<|im_start|>user\nWhat is 2+2? 12345<|im_end|>\n<|im_start|>assistant\n",
    "def add(a, b):\n    return",
]
NEW_TOKENS = 16
# Q8_0 files run with their blocks kept (quantization="gguf"): Phi-3's fused q|k|v and gate|up cut
# into the model's pieces, Granite's permuted Q/K rows, Qwen3-MoE's dense experts beside them,
# Qwen2-MoE's shared expert (and its one-row gate) in blocks, DeepSeek V3's latent attention's
# projections beside its per-head kv_b (dense).
Q8_CASES = ("phi3", "granite", "qwen3moe", "qwen2moe", "granitemoeshared", "deepseek-v3")


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """case -> (source HF directory, the GGUF llama.cpp's converter made of it)."""
    root = tmp_path_factory.mktemp("gguf-families")
    out: dict[str, tuple[Path, Path]] = {}
    for i, (case, (arch, overrides)) in enumerate({**CASES, **THROUGH_TRANSFORMERS}.items()):
        src = make_transformers_model(root / case, arch, seed=60 + i, **overrides)
        _draw_correction_bias(src, seed=60 + i)
        if case in GLM_SPECIALS_FOR:  # the converter's GLM vocabulary reads these four by name
            tok_file = src / "tokenizer.json"
            tok = Tokenizer.from_file(str(tok_file))
            tok.add_special_tokens(list(GLM_SPECIALS))
            tok.save(str(tok_file))
        tok_config = src / "tokenizer_config.json"
        tok_class = TOKENIZER_CLASS.get(case, "PreTrainedTokenizerFast")
        if tok_class is not None:
            tok_config.write_text(json.dumps({**json.loads(tok_config.read_text()), "tokenizer_class": tok_class}))
        out[case] = (src, root / f"{case}.gguf")
    jobs = [(src, gguf_file, "f32") for src, gguf_file in out.values()]
    for case in (*Q8_CASES, "llama4"):
        out[f"{case}-q8_0"] = (out[case][0], root / f"{case}-q8_0.gguf")
        jobs.append((*out[f"{case}-q8_0"], "q8_0"))
    convert(jobs)
    return out


def _draw_correction_bias(src: Path, seed: int) -> None:
    """The sigmoid routers' correction bias (a buffer, zero from `from_config`) drawn at random, so
    that it changes which experts are chosen (DeepSeek V3, GLM-4.5)."""
    from safetensors.torch import load_file, save_file

    weights = load_file(str(src / "model.safetensors"))
    names = [n for n in weights if n.endswith("e_score_correction_bias")]
    if not names:
        return
    g = torch.Generator().manual_seed(seed)
    for name in names:
        weights[name] = 0.3 * torch.randn(weights[name].shape, generator=g)
    save_file(weights, str(src / "model.safetensors"), metadata={"format": "pt"})


def _llm_greedy(gguf_file: Path, **kwargs: Any) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, greedy ids) per prompt, `LLM(gguf_file)`."""
    llm = LLM(model=str(gguf_file), **{"max_model_len": 128, **kwargs})
    try:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True))
    finally:
        llm.shutdown()
    return [(list(o.prompt_token_ids or []), list(o.outputs[0].token_ids)) for o in outs]


def _transformers_greedy(src: Path) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, greedy ids) per prompt, transformers on the source directory."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(src)
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    out = []
    with torch.inference_mode():
        for prompt in PROMPTS:
            ids = tok(prompt)["input_ids"]
            gen = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
            out.append((ids, gen[0, len(ids) :].tolist()))
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_gguf_family_greedy_matches_transformers(
    converted: dict[str, tuple[Path, Path]], case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src, gguf_file = converted[case]
    monkeypatch.setenv("TRIOLLM_CACHE_DIR", str(tmp_path))
    assert _llm_greedy(gguf_file) == _transformers_greedy(src)
    (imported,) = tmp_path.iterdir()
    config = json.loads((imported / "config.json").read_text())
    assert config["architectures"] == [CASES[case][0]]
    tok_config = json.loads((imported / "tokenizer_config.json").read_text())
    assert tok_config["chat_template"] == json.loads((src / "tokenizer_config.json").read_text())["chat_template"]


@pytest.mark.parametrize("case", Q8_CASES)
def test_gguf_family_q8_0_kept_quantized(
    converted: dict[str, tuple[Path, Path]], case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The blocks kept for `quantization="gguf"` are the dense import's projections exactly (rows
    un-permuted or cut, never re-rounded), and the model runs from them. (Greedy tokens are not
    compared: on these tiny models Q8_0's rounding alone moves transformers' greedy choice within
    a few tokens, kept blocks or not.)"""
    from safetensors.torch import load_file

    from triollm.engine.execution.layers.quantized import read_gguf_quantized

    src, gguf_file = converted[f"{case}-q8_0"]
    monkeypatch.setenv("TRIOLLM_CACHE_DIR", str(tmp_path))
    ours = _llm_greedy(gguf_file, quantization="gguf")
    assert [(ids, len(tokens)) for ids, tokens in ours] == [(ids, NEW_TOKENS) for ids, _ in _transformers_greedy(src)]
    (imported,) = tmp_path.iterdir()
    kept = read_gguf_quantized(imported)
    dense = load_file(str(imported / "model.safetensors"))
    pieces = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj",
              "mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj", "mlp.shared_expert.down_proj",
              "self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa", "mlp.shared_experts.gate_proj",
              "mlp.shared_experts.up_proj", "mlp.shared_experts.down_proj"]
    for layer in range(2):
        names = [f"model.layers.{layer}.{p}.weight" for p in pieces]
        if case == "phi3":  # stored fused in the GGUF and in the HF checkpoint
            whole = {p: dense[f"model.layers.{layer}.{p}.weight"] for p in ("self_attn.qkv_proj", "mlp.gate_up_proj")}
            expected = dict(zip(names[:5], [*whole["self_attn.qkv_proj"].split([64, 32, 32]),
                                        *whole["mlp.gate_up_proj"].chunk(2)], strict=True))
        else:  # the MoE models' routed experts stay dense (not kept in blocks); Qwen2-MoE's shared one is kept
            expected = {n: dense[n] for n in names if n in dense}
        assert len(expected) >= (6 if case == "qwen2moe" else 3)
        for name, tensor in expected.items():
            assert kept[name].bits == 8
            torch.testing.assert_close(kept[name].dequantize(), tensor, rtol=0, atol=1e-6, msg=name)


def test_gguf_llama4_q8_0_runs_from_its_kept_blocks(
    converted: dict[str, tuple[Path, Path]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Llama 4's kept blocks reach its layers under the model's own names (its checkpoint's
    `feed_forward` is our `mlp`), q and k rows in the order its dense rows load in (rotary pairs
    to halves): every projection runs from blocks, q|k|v computes what the dense import's does,
    and the first token and its log-prob are the dense run's (near: the kernel rounds activations
    to 8 bits per 32, which on a random model tips a later near-tie)."""
    from test_transformers_backend import engine_greedy, prompts

    from triollm.engine.execution.layers.quantized import QuantLinear

    monkeypatch.setenv("TRIOLLM_CACHE_DIR", str(tmp_path))
    _, gguf_file = converted["llama4-q8_0"]
    ids = prompts()
    dense, dense_core = engine_greedy(gguf_file, ids, quantization="none")  # not the default blocks
    kept, core = engine_greedy(gguf_file, ids, quantization="gguf")
    model = core.executor.model
    for layer, dense_layer in zip(model.layers, dense_core.executor.model.layers, strict=True):
        # q|k|v's rows as the dense layer has them (the same Q8_0 values, in the same order)
        eye = torch.eye(dense_layer.self_attn.qkv_proj.in_features)
        torch.testing.assert_close(layer.self_attn.qkv_proj(eye), dense_layer.self_attn.qkv_proj(eye),
                                   rtol=0, atol=1e-5)
        assert isinstance(layer.self_attn.qkv_proj, QuantLinear) and isinstance(layer.self_attn.o_proj, QuantLinear)
        mlp = getattr(layer.mlp, "shared_expert", layer.mlp)
        assert isinstance(mlp.gate_up_proj, QuantLinear)
        # the converter keeps a projection over fewer than whole 32-wide blocks in F32 (the
        # shared expert's down over 48): dense
        assert isinstance(mlp.down_proj, QuantLinear) == (mlp.down_proj.in_features % 32 == 0)
    for (tokens, logprobs), (dense_tokens, dense_logprobs) in zip(kept, dense, strict=True):
        assert tokens[0] == dense_tokens[0] and abs(logprobs[0] - dense_logprobs[0]) < 0.3


def _before_the_absorbed_form(src: Path, out: Path) -> None:
    """`src` (a deepseek2 file) as llama.cpp's converter wrote DeepSeek before its absorbed form
    (mid 2025; the DeepSeek-V2 files of 2024): `attn_kv_b` whole, the per-head sizes in
    `key_length` / `value_length`, as many KV heads as heads, no `*_mla` keys."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(str(src))
    meta = {f.name: f.contents() for f in reader.fields.values()}
    heads, rope = int(meta["deepseek2.attention.head_count"]), int(meta["deepseek2.rope.dimension_count"])
    key, value = int(meta["deepseek2.attention.key_length_mla"]), int(meta["deepseek2.attention.value_length_mla"])
    writer = gguf.GGUFWriter(str(out), "deepseek2")
    dropped = {"general.architecture", "general.alignment", "deepseek2.attention.key_length_mla",
               "deepseek2.attention.value_length_mla", "deepseek2.attention.key_length",
               "deepseek2.attention.value_length", "deepseek2.attention.head_count_kv"}
    for field in reader.fields.values():
        if field.name in dropped or field.name.startswith("GGUF."):
            continue
        vtype = field.types[0]
        writer.add_key_value(field.name, field.contents(), vtype,
                             sub_type=field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
    writer.add_key_length(key)
    writer.add_value_length(value)
    writer.add_head_count_kv(heads)
    arrays = {t.name: np.array(t.data).reshape([int(d) for d in reversed(t.shape)]) for t in reader.tensors}
    for name, array in arrays.items():
        if name.endswith("attn_v_b.weight"):
            continue
        if name.endswith("attn_k_b.weight"):  # [H, kv_lora, nope] and [H, v, kv_lora] -> [H * (nope + v), kv_lora]
            v_b = arrays[name.replace("attn_k_b", "attn_v_b")]
            assert array.shape[2] == key - rope and v_b.shape[1] == value
            joined = np.concatenate((array.transpose(0, 2, 1), v_b), axis=1).reshape(-1, array.shape[1])
            writer.add_tensor(name.replace("attn_k_b", "attn_kv_b"), np.ascontiguousarray(joined))
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_deepseek_from_before_the_absorbed_form(
    converted: dict[str, tuple[Path, Path]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A DeepSeek file from before llama.cpp's absorbed form (`attn_kv_b` whole, per-head sizes in
    `key_length` / `value_length`) gives transformers' greedy tokens too."""
    src, gguf_file = converted["deepseek-v2"]
    old = tmp_path / "deepseek-v2-old.gguf"
    _before_the_absorbed_form(gguf_file, old)
    monkeypatch.setenv("TRIOLLM_CACHE_DIR", str(tmp_path / "cache"))
    assert _llm_greedy(old) == _transformers_greedy(src)


@pytest.mark.parametrize("case", list(THROUGH_TRANSFORMERS))
def test_gguf_without_a_table_runs_through_transformers_reader(
    converted: dict[str, tuple[Path, Path]], case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A GGUF whose architecture has no table here (StarCoder 2, StableLM as llama.cpp's
    converter writes them) is imported by transformers' own GGUF reader and runs with
    transformers' greedy tokens on the source; dense, so the default keeps no blocks."""
    from triollm.engine.config import EngineArgs
    from triollm.engine.loading.model_config import QUANTIZED_FILE

    src, gguf_file = converted[case]
    monkeypatch.setenv("TRIOLLM_CACHE_DIR", str(tmp_path))
    assert _llm_greedy(gguf_file) == _transformers_greedy(src)
    (imported,) = tmp_path.iterdir()
    config = json.loads((imported / "config.json").read_text())
    assert config["architectures"] == [THROUGH_TRANSFORMERS[case][0]]
    tied = THROUGH_TRANSFORMERS[case][1].get("tie_word_embeddings", False)
    assert config["tie_word_embeddings"] == tied
    from safetensors import safe_open

    with safe_open(str(imported / "model.safetensors"), "pt") as f:
        assert ("lm_head.weight" in f.keys()) == (not tied)
    assert not (imported / QUANTIZED_FILE).exists()
    assert EngineArgs(model=str(gguf_file)).create_engine_config().model.quantization is None
