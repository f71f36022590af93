"""The Transformers modeling backend (issue 42, item 1): architectures with no native class run
through transformers' own modeling code over the paged KV cache, and give transformers' tokens.

Each tiny checkpoint is written by the installed transformers' config class and `save_pretrained`
(fp32, hidden 64, 2 layers), its weights redrawn at tinymodel's scales so greedy picks are not
near-ties, and the family's distinguishing fields set away from their defaults where a wrong
reading would change the numbers (windows shorter than the prompts, partial rotary, biases,
parallel residuals, logit scales). Through `LLM`'s engine core with chunked prefill (a 16-token
budget), a prefix-cache hit (the third prompt shares the first's prefix, added in a second wave)
and a forced preemption (few KV blocks) in one run, 3 prompts x 16 greedy tokens must be
transformers' and the chosen tokens' logprobs within 1e-3. A native family through the backend
gives its native path's tokens; what the backend cannot page is refused at load.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from tinymodel import build_tokenizer, write_tokenizer

from triollm.engine.config import EngineArgs
from triollm.engine.core import EngineCore
from triollm.engine.loading.model_config import ModelConfig
from triollm.engine.request import EngineCoreRequest
from triollm.engine.sampling_params import SamplingParams

NEW_TOKENS = 16
_LLAMA_LIKE = {"intermediate_size": 128, "num_key_value_heads": 2, "rms_norm_eps": 1e-5}
_MOE = {"num_experts_per_tok": 2}
# architecture -> (config class, its arguments beyond hidden 64 / 2 layers / 4 heads / vocab)
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "SmolLM3ForCausalLM": ("SmolLM3Config", {**_LLAMA_LIKE, "no_rope_layer_interval": 2}),
    "MinistralForCausalLM": ("MinistralConfig", {**_LLAMA_LIKE, "sliding_window": 12, "head_dim": 16,
                                                 "layer_types": ["sliding_attention", "full_attention"]}),
    "Glm4ForCausalLM": ("Glm4Config", {**_LLAMA_LIKE, "head_dim": 16, "partial_rotary_factor": 0.5}),
    "Olmo3ForCausalLM": ("Olmo3Config", {**_LLAMA_LIKE, "sliding_window": 10,
                                         "layer_types": ["sliding_attention", "full_attention"]}),
    "Starcoder2ForCausalLM": ("Starcoder2Config", {"intermediate_size": 128, "num_key_value_heads": 2,
                                                   "sliding_window": 14, "use_bias": True}),
    "GPT2LMHeadModel": ("GPT2Config", {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 512}),
    "CohereForCausalLM": ("CohereConfig", {**_LLAMA_LIKE, "logit_scale": 0.5, "use_qk_norm": False}),
    "GPTNeoXForCausalLM": ("GPTNeoXConfig", {"intermediate_size": 128, "rotary_pct": 0.5,
                                             "use_parallel_residual": True}),
    "PhiForCausalLM": ("PhiConfig", {"intermediate_size": 128, "partial_rotary_factor": 0.5}),
    "Exaone4ForCausalLM": ("Exaone4Config", {**_LLAMA_LIKE}),
    "Cohere2ForCausalLM": ("Cohere2Config", {**_LLAMA_LIKE, "sliding_window": 10,
                                             "layer_types": ["sliding_attention", "full_attention"]}),
    "GPTJForCausalLM": ("GPTJConfig", {"n_embd": 64, "n_layer": 2, "n_head": 4, "rotary_dim": 8}),
    "OPTForCausalLM": ("OPTConfig", {"ffn_dim": 128, "word_embed_proj_dim": 64}),
    "PersimmonForCausalLM": ("PersimmonConfig", {"intermediate_size": 128}),
    # Mixtures of experts: transformers' routing, shared experts and dense first layers.
    "Qwen2MoeForCausalLM": ("Qwen2MoeConfig", {**_LLAMA_LIKE, "num_experts": 4, "moe_intermediate_size": 48,
                                               "shared_expert_intermediate_size": 64, **_MOE}),
    "OlmoeForCausalLM": ("OlmoeConfig", {**_LLAMA_LIKE, "num_experts": 4, **_MOE}),
    "GraniteMoeForCausalLM": ("GraniteMoeConfig", {**_LLAMA_LIKE, "num_local_experts": 4, "embedding_multiplier": 2.0,
                                                   "logits_scaling": 2.0, **_MOE}),
    "GraniteMoeSharedForCausalLM": ("GraniteMoeSharedConfig", {
        **_LLAMA_LIKE, "num_local_experts": 4, "shared_intermediate_size": 80, "residual_multiplier": 0.5,
        "attention_multiplier": 0.3, **_MOE}),
    "Glm4MoeForCausalLM": ("Glm4MoeConfig", {**_LLAMA_LIKE, "n_routed_experts": 4, "moe_intermediate_size": 48,
                                             "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "head_dim": 16,
                                             **_MOE}),
    "PhimoeForCausalLM": ("PhimoeConfig", {**_LLAMA_LIKE, "num_local_experts": 4, **_MOE}),
    # Multi-head latent attention: k of 16 (8 + 8 rotary) and v of 8 per head, v padded in the cache.
    "DeepseekV3ForCausalLM": ("DeepseekV3Config", {**_LLAMA_LIKE, "n_routed_experts": 4, "moe_intermediate_size": 48,
                                                   "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
                                                   "q_lora_rank": None, "kv_lora_rank": 32, "qk_rope_head_dim": 8,
                                                   "qk_nope_head_dim": 8, "v_head_dim": 8, "num_key_value_heads": 4,
                                                   **_MOE}),
    # Attention sinks on every layer, windows on alternate ones, biased experts with the clamped
    # SwiGLU (a limit of 1 that clamps some of the tiny model's activations).
    "GptOssForCausalLM": ("GptOssConfig", {**_LLAMA_LIKE, "num_local_experts": 4, "head_dim": 16, "sliding_window": 10,
                                           "layer_types": ["sliding_attention", "full_attention"], "swiglu_limit": 1.0,
                                           **_MOE}),
    # Chunks of 8 on the RoPE layer (the prompts cross four), a NoPE layer with temperature tuning
    # (floor_scale 4: the factor changes every 4 positions), an MoE layer after a dense one.
    "Llama4ForCausalLM": ("Llama4TextConfig", {**_LLAMA_LIKE, "head_dim": 16, "attention_chunk_size": 8,
                                               "no_rope_layers": [1, 0], "floor_scale": 4, "attn_scale": 0.5,
                                               "num_local_experts": 4, "intermediate_size_mlp": 128,
                                               "interleave_moe_layer_step": 2, "num_experts_per_tok": 1}),
}  # fmt: skip
# Of those, the ones with a native class too (auto runs them natively; the parity test asks for the backend).
NATIVE = {
    "DeepseekV3ForCausalLM",
    "GptOssForCausalLM", "GPTNeoXForCausalLM", "PhiForCausalLM",
    "Qwen2MoeForCausalLM", "OlmoeForCausalLM", "GraniteMoeForCausalLM", "GraniteMoeSharedForCausalLM",
    "Glm4MoeForCausalLM", "PhimoeForCausalLM", "Llama4ForCausalLM",
}  # fmt: skip


# Variants of CASES for the native tests: "Arch-variant" -> fields over Arch's.
VARIANTS: dict[str, dict[str, Any]] = {
    # DeepSeek-V3-style grouped routing: 8 experts in 4 groups, the best 2 groups, a correction
    # bias (redrawn below), a routed scaling, q/k norms per head.
    "Glm4MoeForCausalLM-grouped": {"n_routed_experts": 8, "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5,
                                   "use_qk_norm": True, "n_shared_experts": 2},
}  # fmt: skip


def make_backend_model(path: Path, arch: str, seed: int = 0) -> Path:
    """A tiny random `arch` written by transformers (module note); "Arch-variant": a VARIANTS entry."""
    import transformers

    eos = write_tokenizer(path)
    variant = VARIANTS.get(arch, {})
    arch = arch.split("-")[0]
    config_class, fields = CASES[arch]
    fields = {**fields, **variant}
    sizes = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}
    if arch == "GPT2LMHeadModel":
        sizes = {}
    cfg = getattr(transformers, config_class)(
        vocab_size=build_tokenizer().get_vocab_size(), max_position_embeddings=512, bos_token_id=None,
        eos_token_id=eos, pad_token_id=None, tie_word_embeddings=False, dtype="float32", **sizes, **fields,
    )  # fmt: skip
    cfg.architectures = [arch]
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
                big = any(k in name for k in ("embed", "lm_head", "wte", "wpe", "embed_out"))
                p.copy_(noise * (0.5 if big else 0.2))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # a grouped router's: a choice it changes
                b.copy_(0.5 * torch.randn(b.shape, generator=g))
    model.save_pretrained(path)
    return path


def prompts() -> list[list[int]]:
    rng = random.Random(3)
    first, second = ([rng.randrange(3, 380) for _ in range(n)] for n in (37, 21))
    return [first, second, first[:33] + [7, 9, 11]]  # the third hits the first's cached blocks


def hf_greedy(path: Path, ids_list: list[list[int]], **load: Any) -> list[tuple[list[int], list[float]]]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **load).eval()
    model.generation_config.eos_token_id = None
    out_all = []
    with torch.inference_mode():
        for ids in ids_list:
            out = model.generate(
                torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
                return_dict_in_generate=True, pad_token_id=0,
            )  # fmt: skip
            tokens = out.sequences[0, len(ids) :].tolist()
            out_all.append(
                (tokens, [torch.log_softmax(lg[0].float(), -1)[t].item() for lg, t in zip(out.logits, tokens)])
            )
    return out_all


def engine_greedy(path: Path, ids_list: list[list[int]], **overrides: Any) -> tuple[list[Any], EngineCore]:
    """Chunked prefill (16-token steps), the third prompt after the first two have run a few steps
    (prefix-cache hit), and 12 KV blocks of 16 tokens for 3 sequences of up to 53 (preemption).
    The prefill budget is off: measured on the clock, it cut the prompts by the machine's pace,
    and on a loaded machine the run could end without the preemption it is here to force."""
    args = EngineArgs(
        model=str(path), seed=0, max_model_len=96, max_num_batched_tokens=16, enable_prefix_caching=True,
        num_gpu_blocks_override=7, block_size=16, scheduler_prefill_budget="off", **overrides,
    )  # fmt: skip
    core = EngineCore(args.create_engine_config())
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)
    got: dict[str, tuple[list[int], list[float]]] = {str(i): ([], []) for i in range(len(ids_list))}
    for i in (0, 1):
        core.add_request(EngineCoreRequest(str(i), ids_list[i], params))
    for step in range(10_000):
        if step == 6:
            core.add_request(EngineCoreRequest("2", ids_list[2], params))
        if step > 6 and not core.has_unfinished_requests():
            break
        for out in core.step():
            got[out.request_id][0].extend(out.new_token_ids)
            assert out.new_logprobs is not None
            got[out.request_id][1].extend(row[0] for row in out.new_logprobs.logprobs)
    return [got[str(i)] for i in range(len(ids_list))], core


def assert_parity(ours: list[Any], ref: list[Any]) -> None:
    for i, ((tok, lp), (rtok, rlp)) in enumerate(zip(ours, ref)):
        assert tok == rtok, f"prompt {i}: tokens differ: {tok} vs transformers' {rtok}"
        assert max(abs(a - b) for a, b in zip(lp, rlp)) < 1e-3, f"prompt {i}: logprobs differ"


@pytest.mark.parametrize("arch", list(CASES))
def test_backend_greedy_parity(tmp_path: Path, arch: str) -> None:
    path = make_backend_model(tmp_path / arch, arch, seed=len(arch))
    auto = ModelConfig.from_pretrained(path, max_model_len=96).model_impl
    assert auto == ("triollm" if arch in NATIVE else "transformers")  # auto: the backend where no native class
    ids = prompts()
    ours, core = engine_greedy(path, ids, model_impl="transformers")
    assert_parity(ours, hf_greedy(path, ids))
    stats = core.statistics()
    assert stats.prefix_cache_hit_rate > 0 and stats.num_preemptions > 0


@pytest.mark.parametrize(
    "arch",
    [
        "Qwen2MoeForCausalLM", "OlmoeForCausalLM", "GraniteMoeForCausalLM", "GraniteMoeSharedForCausalLM",
        "Glm4MoeForCausalLM", "Glm4MoeForCausalLM-grouped",
    ],
)
def test_native_moe_families_give_transformers_and_the_backends_tokens(tmp_path: Path, arch: str) -> None:
    """The MoE families with a native class (models/moe.py): Qwen2-MoE's gated shared expert and
    dense-vs-sparse layers, OLMoE's q/k norms over whole projections, Granite's multipliers and
    stacked expert tensors, Granite MoE Shared's shared MLP; the backend gives the same tokens."""
    from triollm.engine.execution.models.moe import MoEForCausalLM

    path = make_backend_model(tmp_path / arch, arch, seed=len(arch))
    ids = prompts()
    native, core = engine_greedy(path, ids)
    assert isinstance(core.executor.model, MoEForCausalLM)
    assert_parity(native, hf_greedy(path, ids))
    stats = core.statistics()
    assert stats.prefix_cache_hit_rate > 0 and stats.num_preemptions > 0
    backend, _ = engine_greedy(path, ids, model_impl="transformers")
    assert_parity(backend, native)


def test_native_gpt_oss_gives_transformers_and_the_backends_tokens(tmp_path: Path) -> None:
    """gpt-oss's native class (models/gpt_oss.py: sinks, alternating windows, the clamped-SwiGLU
    experts with biases) against transformers, and the backend against it."""
    from triollm.engine.execution.models.gpt_oss import GptOssForCausalLM

    arch = "GptOssForCausalLM"
    path = make_backend_model(tmp_path / arch, arch, seed=len(arch))
    ids = prompts()
    native, core = engine_greedy(path, ids)
    assert isinstance(core.executor.model, GptOssForCausalLM)
    assert_parity(native, hf_greedy(path, ids))
    stats = core.statistics()
    assert stats.prefix_cache_hit_rate > 0 and stats.num_preemptions > 0
    backend, _ = engine_greedy(path, ids, model_impl="transformers")
    assert_parity(backend, native)


def _native_vs_backend(path: Path) -> None:
    ids = prompts()
    native, _ = engine_greedy(path, ids, model_impl="triollm")
    backend, _ = engine_greedy(path, ids, model_impl="transformers")
    assert_parity(backend, native)


def test_native_llama_through_the_backend_gives_its_native_tokens(tiny_model_dir: Path) -> None:
    assert ModelConfig.from_pretrained(tiny_model_dir, max_model_len=96).model_impl == "triollm"  # auto: native
    assert ModelConfig.from_pretrained(tiny_model_dir, model_impl="transformers").model_impl == "transformers"
    _native_vs_backend(tiny_model_dir)


def test_native_gemma2_through_the_backend_gives_its_native_tokens(tmp_path: Path) -> None:
    """Soft-capping (attention and final logits), a query scalar and windows on alternate layers:
    the HF module's `softcap` and `sliding_window` reach the paged kernels, the head's tail runs."""
    from tinymodel import make_transformers_model

    path = make_transformers_model(
        tmp_path / "gemma2", "Gemma2ForCausalLM", seed=5, head_dim=16, query_pre_attn_scalar=24,
        attn_logit_softcapping=5.0, final_logit_softcapping=3.0, sliding_window=10,
    )  # fmt: skip
    _native_vs_backend(path)


def test_llm_and_cli_take_model_impl(tiny_model_dir: Path) -> None:
    from triollm import LLM
    from triollm.api.cli import build_parser

    args = EngineArgs.from_cli_args(
        build_parser().parse_args(["serve", "--model", "m", "--model-impl", "transformers"])
    )
    assert args.model_impl == "transformers"
    assert EngineArgs(model="m", model_impl="vllm").model_impl == "triollm"  # vLLM's name for the native classes
    with pytest.raises(ValueError, match="model_impl: 'terratorch' is not supported; allowed: auto, triollm, transf"):
        EngineArgs(model=str(tiny_model_dir), model_impl="terratorch")
    llm = LLM(model=str(tiny_model_dir), model_impl="transformers", max_model_len=64)
    try:
        assert llm.llm_engine.async_llm.get_model_config().model_impl == "transformers"
        out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=5, temperature=0.0))
        assert len(out[0].outputs[0].token_ids) == 5
    finally:
        llm.shutdown()


def _config_dir(tmp_path: Path, config_class: str, arch: str, **fields: Any) -> Path:
    import transformers

    cfg = getattr(transformers, config_class)(**fields)
    cfg.architectures = [arch]
    tmp_path.mkdir(parents=True, exist_ok=True)
    cfg.to_json_file(tmp_path / "config.json")
    return tmp_path


SMALL = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 384}
REFUSED = [
    ("MiniMaxConfig", "MiniMaxForCausalLM", {**SMALL, "layer_types": ["linear_attention", "full_attention"]},
     r"layer_types: 'linear_attention' layers cannot be paged"),
    ("BartConfig", "BartForCausalLM", {"vocab_size": 384}, r"is_encoder_decoder: BartForCausalLM is an encoder-"),
    ("Llama4TextConfig", "Llama4ForCausalLM", {**SMALL, "num_key_value_heads": 4, "attention_chunk_size": None,
                                                "layer_types": ["chunked_attention", "full_attention"]},
     r"attention_chunk_size: None for 'chunked_attention' layers; allowed: an integer >= 1"),
    ("T5Config", "T5ForConditionalGeneration", {"vocab_size": 384}, r"architectures: 'T5ForConditionalGeneration' is "
     r"not a causal language model"),
]  # fmt: skip


@pytest.mark.parametrize(("config_class", "arch", "fields", "match"), REFUSED, ids=[r[1] for r in REFUSED])
def test_unpageable_configs_are_refused_at_load(
    tmp_path: Path, config_class: str, arch: str, fields: dict[str, Any], match: str
) -> None:
    path = _config_dir(tmp_path, config_class, arch, **fields)
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_pretrained(path, max_model_len=64)


def test_the_backend_refuses_a_hybrid_that_runs_natively(tmp_path: Path) -> None:
    """LFM2's convolutions hold a state the paged cache cannot: through the backend it is refused
    at load (natively it runs, tests/engine/test_hybrid_models.py)."""
    fields = {**SMALL, "num_key_value_heads": 2, "layer_types": ["conv", "full_attention"]}
    path = _config_dir(tmp_path, "Lfm2Config", "Lfm2ForCausalLM", **fields)
    assert ModelConfig.from_pretrained(path, max_model_len=64).recurrent is not None
    with pytest.raises(ValueError, match=r"layer_types: 'conv' layers cannot be paged"):
        ModelConfig.from_pretrained(path, max_model_len=64, model_impl="transformers")


def test_native_only_refuses_other_architectures(tmp_path: Path) -> None:
    path = make_backend_model(tmp_path / "gpt2", "GPT2LMHeadModel")
    with pytest.raises(
        ValueError, match=r"architectures: 'GPT2LMHeadModel' is not supported with model_impl 'triollm'"
    ):
        ModelConfig.from_pretrained(path, max_model_len=64, model_impl="triollm")
    with pytest.raises(ValueError, match=r"max_model_len: 600 exceeds 512"):  # GPT-2's learned positions end there
        ModelConfig.from_pretrained(path, max_model_len=600)
    with pytest.raises(ValueError, match=r"enable_lora: LoRA adapters are not supported through the Transformers"):
        EngineArgs(model=str(path), max_model_len=64, enable_lora=True).create_engine_config()
    with pytest.raises(ValueError, match=r"quantization: 'int8' is not supported through the Transformers backend"):
        EngineArgs(model=str(path), max_model_len=64, quantization="int8").create_engine_config()


def test_layers_the_backend_cannot_page_are_refused_when_built(tmp_path: Path) -> None:
    """What only the built model shows: GPT-2 with cross-attention layers; StableLM through the
    backend (its native class is what auto picks), whose attention does not go through
    transformers' attention interface."""
    from triollm.engine.execution.models import load_model

    path = make_backend_model(tmp_path / "gpt2", "GPT2LMHeadModel")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "add_cross_attention": True}))
    with pytest.raises(ValueError, match=r"has a GPT2Attention layer \(transformer.h.0.crossattention\)"):
        load_model(ModelConfig.from_pretrained(path, max_model_len=64))
    stablelm = _config_dir(
        tmp_path / "stablelm", "StableLmConfig", "StableLmForCausalLM", **SMALL, num_key_value_heads=4
    )
    with pytest.raises(
        ValueError, match=r"StableLmForCausalLM's attention does not go through transformers' attention"
    ):
        load_model(ModelConfig.from_pretrained(stablelm, max_model_len=64, model_impl="transformers"))


@pytest.mark.parametrize(
    "arch", ["MinistralForCausalLM", "DeepseekV3ForCausalLM", "GptOssForCausalLM", "Llama4ForCausalLM"]
)
def test_backend_on_the_triton_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, arch: str) -> None:
    """The CUDA code path (Triton attention kernels and the k-head-dim-last cache layout), run on
    CPU under the interpreter: windows, padded latent-attention heads, sinks and chunks give
    transformers' tokens."""
    monkeypatch.setenv("TRIOLLM_KERNELS", "triton")
    path = make_backend_model(tmp_path / arch, arch, seed=len(arch))
    ids = prompts()
    ours, core = engine_greedy(path, ids, dtype="float32", model_impl="transformers")
    assert core.executor.model is not None and core.executor.model.triton  # the Triton kernels ran
    assert_parity(ours, hf_greedy(path, ids))


def test_native_gpt_oss_on_the_triton_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The native class on the CUDA code path under the interpreter: the fused Triton rotary and
    cache write, then the Triton attention with sinks and windows."""
    from triollm.engine.execution.models.gpt_oss import GptOssForCausalLM

    monkeypatch.setenv("TRIOLLM_KERNELS", "triton")
    arch = "GptOssForCausalLM"
    path = make_backend_model(tmp_path / arch, arch, seed=len(arch))
    ids = prompts()
    ours, core = engine_greedy(path, ids, dtype="float32")
    assert isinstance(core.executor.model, GptOssForCausalLM) and core.executor.model.triton
    assert_parity(ours, hf_greedy(path, ids))


def _write_mxfp4_experts(path: Path) -> None:
    """Replace the experts of the checkpoint in `path` by random MXFP4 blocks and scales (2^-6 to
    2^-3) as gpt-oss's released checkpoints store them, and say so in config.json."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(path / "model.safetensors")
    g = torch.Generator().manual_seed(11)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, cols, rows = tensors.pop(name).shape  # transformers' [E, in, out]
        codes = torch.randint(0, 256, (experts, rows, cols // 32, 16), generator=g, dtype=torch.uint8)
        tensors[f"{name}_blocks"] = codes
        tensors[f"{name}_scales"] = torch.randint(121, 125, codes.shape[:3], generator=g, dtype=torch.uint8)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (path / "config.json").write_text(json.dumps(config))


def test_native_gpt_oss_dequantizes_mxfp4_experts(tmp_path: Path) -> None:
    """An MXFP4 checkpoint (the released gpt-oss weights' format) runs natively with its experts
    dequantized at load: transformers' tokens, transformers dequantizing the same checkpoint
    (Mxfp4Config(dequantize=True)); one of a blocks/scales pair missing is refused at load."""
    import transformers
    from safetensors.torch import load_file, save_file

    from triollm.engine.execution.models import load_model
    from triollm.engine.execution.models.gpt_oss import GptOssForCausalLM

    arch = "GptOssForCausalLM"
    path = make_backend_model(tmp_path / arch, arch, seed=len(arch))
    _write_mxfp4_experts(path)
    ids = prompts()
    ours, core = engine_greedy(path, ids)
    assert isinstance(core.executor.model, GptOssForCausalLM)
    assert_parity(ours, hf_greedy(path, ids, quantization_config=transformers.Mxfp4Config(dequantize=True)))

    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"only one of layers.1.mlp.routed.down_proj_blocks / _scales"):
        load_model(ModelConfig.from_pretrained(path, max_model_len=64))


def test_mxfp4_dequantization_is_transformers() -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from triollm.engine.execution.models.gpt_oss import dequantize_mxfp4

    g = torch.Generator().manual_seed(12)
    blocks = torch.randint(0, 256, (3, 10, 4, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(100, 140, (3, 10, 4), generator=g, dtype=torch.uint8)
    want = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2)  # [E, rows, cols]
    assert torch.equal(dequantize_mxfp4(blocks, scales), want)
