"""Hybrid decoders (issue 42, item 3): layers with a per-request recurrent state beside the KV cache.

LFM2's short-convolution layers keep each running request's last `conv_L_cache - 1` inputs in a
state slot (engine/execution/layers/recurrent.py), taken with the request's blocks and zeroed
when it starts over. Tiny checkpoints written by transformers' `Lfm2Config` and `save_pretrained`
(convolution and attention layers interleaved) must give transformers' greedy tokens and
logprobs with chunked prefill (16-token steps, so a prompt's state crosses chunk boundaries), a
forced preemption (the recompute starts from a zeroed slot) and requests joining mid-run.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from test_transformers_backend import assert_parity, engine_greedy, hf_greedy, prompts
from tinymodel import build_tokenizer, write_tokenizer

from triollm.engine.config import EngineArgs
from triollm.engine.core import EngineCore
from triollm.engine.execution.models.hybrid import (
    BambaForCausalLM,
    FalconH1ForCausalLM,
    GraniteMoeHybridForCausalLM,
    Lfm2ForCausalLM,
    Qwen3NextForCausalLM,
)
from triollm.engine.loading.model_config import ModelConfig
from triollm.engine.request import EngineCoreRequest
from triollm.engine.sampling_params import SamplingParams
from triollm.engine.scheduling.block_manager import BlockManager


def make_lfm2(path: Path, seed: int = 0, **fields: object) -> Path:
    import transformers

    eos = write_tokenizer(path)
    settings: dict[str, object] = {
        "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 192, "layer_types": ["conv", "full_attention", "conv", "full_attention"],
        "conv_L_cache": 3, **fields,
    }  # fmt: skip
    cfg = transformers.Lfm2Config(
        vocab_size=build_tokenizer().get_vocab_size(), max_position_embeddings=512, bos_token_id=None,
        eos_token_id=eos, pad_token_id=None, tie_word_embeddings=True, dtype="float32", **settings,
    )  # fmt: skip
    cfg.architectures = ["Lfm2ForCausalLM"]
    model = transformers.Lfm2ForCausalLM(cfg).to(torch.float32)
    _redraw(model, seed)
    model.save_pretrained(path)
    return path


def make_bamba(path: Path, seed: int = 0, **fields: object) -> Path:
    """A tiny Bamba: Mamba-2 mixers around one attention layer, scan chunks of 8 (the prompts
    cross several, and the engine's 16-token prefill chunks cut through them)."""
    import transformers

    eos = write_tokenizer(path)
    settings: dict[str, object] = {
        "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 128, "attn_layer_indices": [1], "mamba_n_heads": 8, "mamba_d_state": 16,
        "mamba_n_groups": 2, "mamba_chunk_size": 8, "mamba_d_conv": 4, **fields,
    }  # fmt: skip
    cfg = transformers.BambaConfig(
        vocab_size=build_tokenizer().get_vocab_size(), max_position_embeddings=512, bos_token_id=None,
        eos_token_id=eos, pad_token_id=None, dtype="float32", **settings,
    )  # fmt: skip
    model = transformers.BambaForCausalLM(cfg).to(torch.float32)
    _redraw(model, seed)
    model.save_pretrained(path)
    return path


def make_granite_hybrid(path: Path, seed: int = 0, **fields: object) -> Path:
    """A tiny Granite 4.0-H: Mamba-2 mixers and attention without rotary, routed experts plus a
    shared MLP, every Granite multiplier away from 1."""
    import transformers

    eos = write_tokenizer(path)
    settings: dict[str, object] = {
        "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 48, "shared_intermediate_size": 96, "layer_types": ["mamba", "attention", "mamba"],
        "mamba_n_heads": 8, "mamba_d_state": 16, "mamba_n_groups": 2, "mamba_chunk_size": 8,
        "num_local_experts": 4, "num_experts_per_tok": 2, "position_embedding_type": "nope",
        "embedding_multiplier": 2.0, "residual_multiplier": 0.5, "attention_multiplier": 0.2, "logits_scaling": 1.5,
        **fields,
    }  # fmt: skip
    cfg = transformers.GraniteMoeHybridConfig(
        vocab_size=build_tokenizer().get_vocab_size(), max_position_embeddings=512, bos_token_id=None,
        eos_token_id=eos, pad_token_id=None, dtype="float32", **settings,
    )  # fmt: skip
    model = transformers.GraniteMoeHybridForCausalLM(cfg).to(torch.float32)
    _redraw(model, seed)
    model.save_pretrained(path)
    return path


def make_falcon_h1(path: Path, seed: int = 0, **fields: object) -> Path:
    """A tiny Falcon-H1: attention and a Mamba-2 mixer in every layer, an explicit head_dim and
    mamba_d_ssm (neither hidden_size's split), scan chunks of 8, every muP multiplier away from 1."""
    import transformers

    eos = write_tokenizer(path)
    settings: dict[str, object] = {
        "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 8, "intermediate_size": 96, "mamba_d_ssm": 96, "mamba_n_heads": 6, "mamba_d_state": 16,
        "mamba_n_groups": 2, "mamba_chunk_size": 8, "mamba_d_conv": 4, "mamba_rms_norm": True,
        "mamba_norm_before_gate": True, "embedding_multiplier": 2.0, "lm_head_multiplier": 0.5,
        "attention_in_multiplier": 0.8, "attention_out_multiplier": 0.9, "key_multiplier": 0.5,
        "ssm_in_multiplier": 1.25, "ssm_out_multiplier": 0.7, "ssm_multipliers": [0.35, 0.25, 0.4, 0.5, 0.3],
        "mlp_multipliers": [0.9, 0.6], **fields,
    }  # fmt: skip
    settings = {k: v for k, v in settings.items() if not (k == "head_dim" and v is None)}  # None: hidden's split
    cfg = transformers.FalconH1Config(
        vocab_size=build_tokenizer().get_vocab_size(), max_position_embeddings=512, bos_token_id=None,
        eos_token_id=eos, pad_token_id=None, dtype="float32", **settings,
    )  # fmt: skip
    cfg.architectures = ["FalconH1ForCausalLM"]
    model = transformers.FalconH1ForCausalLM(cfg).to(torch.float32)
    _redraw(model, seed)
    model.save_pretrained(path)
    return path


def make_qwen3_next(path: Path, seed: int = 0, interval: int | None = None, **fields: object) -> Path:
    """A tiny Qwen3-Next: gated DeltaNet layers (2 key heads, each serving 2 value heads of another
    width) around gated attention with partial rotary, routed experts plus the gated shared expert
    and one dense layer, and a multi-token-prediction tensor (skipped). `interval`: config.json
    without `layer_types` and `partial_rotary_factor`, as the released ones (their defaults)."""
    import json

    import transformers
    from safetensors.torch import load_file, save_file

    eos = write_tokenizer(path)
    settings: dict[str, object] = {
        "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "intermediate_size": 96,
        "layer_types": ["linear_attention", "full_attention", "linear_attention", "linear_attention"],
        "linear_key_head_dim": 8, "linear_value_head_dim": 12, "linear_num_key_heads": 2,
        "linear_num_value_heads": 4, "linear_conv_kernel_dim": 4, "num_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48, "mlp_only_layers": [2], **fields,
    }  # fmt: skip
    if interval is not None:  # the layers transformers derives from it
        settings["layer_types"] = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(4)]
    cfg = transformers.Qwen3NextConfig(
        vocab_size=build_tokenizer().get_vocab_size(), max_position_embeddings=512, bos_token_id=None,
        eos_token_id=eos, pad_token_id=None, dtype="float32", **settings,
    )  # fmt: skip
    cfg.architectures = ["Qwen3NextForCausalLM"]
    model = transformers.Qwen3NextForCausalLM(cfg).to(torch.float32)
    _redraw(model, seed)
    model.save_pretrained(path)
    tensors = load_file(path / "model.safetensors")
    tensors["mtp.fc.weight"] = torch.zeros(64, 128)  # what a released checkpoint's MTP head adds
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    if interval is not None:
        raw = json.loads((path / "config.json").read_text())
        del raw["layer_types"]
        raw["rope_parameters"].pop("partial_rotary_factor")
        raw["full_attention_interval"] = interval
        (path / "config.json").write_text(json.dumps(raw))
    return path


def _redraw(model: torch.nn.Module, seed: int) -> None:
    """Weights at scales where greedy picks are not near-ties."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if p.ndim == 1 and name.endswith("weight"):  # norms' scales
                p.copy_(1 + 0.1 * noise)
            elif p.ndim == 1:  # biases, and a Mamba mixer's A_log, dt_bias, D
                p.copy_(0.3 * noise)
            else:
                p.copy_(noise * (0.5 if "embed" in name else 0.3))


CASES = {
    "lfm2": (make_lfm2, Lfm2ForCausalLM, {}),
    "lfm2-kernel4-bias": (
        make_lfm2, Lfm2ForCausalLM,
        {"conv_L_cache": 4, "conv_bias": True, "layer_types": ["full_attention", "conv", "conv", "conv"]},
    ),
    "bamba": (make_bamba, BambaForCausalLM, {}),
    "bamba-one-group-bias": (
        make_bamba, BambaForCausalLM,
        {"mamba_n_groups": 1, "mamba_proj_bias": True, "mamba_conv_bias": False, "attn_layer_indices": [0, 2]},
    ),
    "granite-4.0-h": (make_granite_hybrid, GraniteMoeHybridForCausalLM, {}),
    "granite-4.0-h-rope-dense": (
        make_granite_hybrid, GraniteMoeHybridForCausalLM,
        {"position_embedding_type": "rope", "num_local_experts": 0, "layer_types": ["attention", "mamba", "mamba"]},
    ),
    "falcon-h1": (make_falcon_h1, FalconH1ForCausalLM, {}),
    "falcon-h1-no-norm-biases-tied": (
        make_falcon_h1, FalconH1ForCausalLM,
        {"mamba_rms_norm": False, "projectors_bias": True, "mamba_proj_bias": True, "attention_bias": True,
         "mamba_conv_bias": False, "tie_word_embeddings": True, "mamba_n_groups": 1},
    ),
    "qwen3-next": (make_qwen3_next, Qwen3NextForCausalLM, {}),
    "qwen3-next-dense-one-group-biases-tied": (
        make_qwen3_next, Qwen3NextForCausalLM,
        {"num_experts": 0, "linear_num_key_heads": 4, "partial_rotary_factor": 0.5, "attention_bias": True,
         "tie_word_embeddings": True, "layer_types": ["full_attention", "linear_attention", "full_attention",
                                                      "linear_attention"]},
    ),
    "qwen3-next-interval-sparse-step": (
        make_qwen3_next, Qwen3NextForCausalLM,
        {"interval": 2, "decoder_sparse_step": 2, "norm_topk_prob": False, "mlp_only_layers": []},
    ),
    "falcon-h1-norm-after-gate-expand": (
        make_falcon_h1, FalconH1ForCausalLM,
        {"mamba_norm_before_gate": False, "mamba_d_ssm": None, "mamba_expand": 2, "mamba_n_heads": 8, "head_dim": None,
         "mlp_bias": True},
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_hybrids_give_transformers_tokens_through_chunks_and_preemption(tmp_path: Path, case: str) -> None:
    make, cls, fields = CASES[case]
    path = make(tmp_path / case, seed=7, **fields)
    cfg = ModelConfig.from_pretrained(path, max_model_len=96)
    assert cfg.model_impl == "triollm" and cfg.recurrent is not None
    attending = ("full_attention", "hybrid")  # Falcon-H1's layers attend and keep a state
    assert len(cfg.kv_layers) == sum(t in attending for t in cfg.layer_types)
    assert len(cfg.state_layers) == sum(t != "full_attention" for t in cfg.layer_types)
    ids = prompts()
    ours, core = engine_greedy(path, ids)
    assert isinstance(core.executor.model, cls)
    assert_parity(ours, hf_greedy(path, ids))
    stats = core.statistics()
    assert stats.num_preemptions > 0  # a request started over from a zeroed state slot
    assert stats.prefix_cache_hit_rate == 0  # off: a cached block holds no state
    core.check_integrity()


@pytest.mark.parametrize(
    ("make", "tokens"),
    [(make_lfm2, 8), (make_bamba, 10), (make_falcon_h1, 10), (make_qwen3_next, 10)],
    ids=["lfm2", "bamba", "falcon-h1", "qwen3-next"],
)
def test_requests_sharing_two_slots_each_match_alone(tmp_path: Path, make, tokens: int) -> None:
    """States across a decode batch, prefills beside decodes and slot reuse (two slots for three
    requests: the third takes the slot a finished one left): every request's tokens are
    transformers' for it alone."""
    path = make(tmp_path / "hybrid", seed=3)
    ids = prompts()
    args = EngineArgs(model=str(path), max_model_len=96, max_num_seqs=2, max_num_batched_tokens=16, seed=0)
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    core = EngineCore(args.create_engine_config())
    got: dict[str, list[int]] = {str(i): [] for i in range(3)}
    try:
        for i in range(3):
            core.add_request(EngineCoreRequest(str(i), ids[i], params))
        while core.has_unfinished_requests():
            for out in core.step():
                got[out.request_id] += out.new_token_ids
            core.check_integrity()
    finally:
        core.close()
    assert [got[str(i)] for i in range(3)] == [t[:tokens] for t, _ in hf_greedy(path, ids)]


def test_state_slots_are_capped_by_the_memory_budget(tmp_path: Path) -> None:
    """A Mamba-2 state is large: the slots are what half the budget holds, and admission waits
    for a free slot rather than running past them."""
    path = make_bamba(tmp_path / "bamba", mamba_d_state=64)
    cfg = ModelConfig.from_pretrained(path, max_model_len=96)
    # Two Mamba-2 layers, fp32: the convolution's x|B|C (128 + 2 groups x 2 x 64) x 3 and the SSM's 8 x 16 x 64.
    per_slot = 2 * 4 * ((128 + 2 * 2 * 64) * 3 + 8 * 16 * 64)
    args = EngineArgs(model=str(path), max_model_len=96, kv_cache_memory_bytes=5 * per_slot, max_num_seqs=8)
    core = EngineCore(args.create_engine_config())
    try:
        assert cfg.recurrent is not None
        assert core.executor.num_state_slots == 2 == core.block_manager.num_state_slots
        params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        for i, p in enumerate(prompts()):
            core.add_request(EngineCoreRequest(str(i), p, params))
        running_most = 0
        while core.has_unfinished_requests():
            core.step()
            running_most = max(running_most, core.statistics().num_running)
            core.check_integrity()
        assert running_most == 2
    finally:
        core.close()


def test_the_kv_cache_holds_only_the_attention_layers(tmp_path: Path) -> None:
    path = make_lfm2(tmp_path / "lfm2")
    args = EngineArgs(model=str(path), max_model_len=96, kv_cache_memory_bytes=1 << 20, block_size=16)
    core = EngineCore(args.create_engine_config())
    try:
        runner = core.executor.runner
        assert len(runner.kv.k) == 2  # of 4 layers, 2 attend
        assert runner.states is not None and len(runner.states.layers) == 2
        assert runner.states.layers[0].shape == (args.max_num_seqs, 64, 2)
        assert not core.block_manager.enable_prefix_caching
    finally:
        core.close()


@pytest.mark.parametrize("make", [make_lfm2, make_falcon_h1, make_qwen3_next], ids=["lfm2", "falcon-h1", "qwen3-next"])
def test_hybrids_through_llm(tmp_path: Path, make) -> None:
    from triollm import LLM

    path = make(tmp_path / "hybrid", seed=5)
    ids = prompts()
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    with LLM(str(path), max_model_len=96, multiprocess=False) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == [t[:6] for t, _ in hf_greedy(path, ids)]


def test_speculative_decoding_is_refused_for_a_hybrid_model(tmp_path: Path) -> None:
    path = make_lfm2(tmp_path / "lfm2")
    args = EngineArgs(
        model=str(path), max_model_len=96, speculative_config={"method": "ngram", "num_speculative_tokens": 2}
    )
    with pytest.raises(ValueError, match="speculative_config: .*recurrent"):
        EngineCore(args.create_engine_config())


def test_prefix_caching_is_switched_off_with_a_log_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = make_lfm2(tmp_path / "lfm2")
    args = EngineArgs(model=str(path), max_model_len=96, enable_prefix_caching=True)
    with caplog.at_level(logging.INFO, logger="triollm"):
        core = EngineCore(args.create_engine_config())
    core.close()
    assert any("prefix caching is off" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("layer_types", ["conv", "mamba", "conv", "full_attention"], "layer_types: mamba not supported"),
        ("layer_types", ["conv", "conv", "conv", "conv"], "at least one full_attention"),
        ("conv_L_cache", 1, "conv_L_cache: expected an integer >= 2"),
        ("full_attn_idxs", [9], "full_attn_idxs"),
    ],
)
def test_lfm2_configs_are_checked_at_load(tmp_path: Path, field: str, value: object, match: str) -> None:
    import json

    path = make_lfm2(tmp_path / "lfm2")
    raw = json.loads((path / "config.json").read_text())
    raw[field] = value
    if field == "full_attn_idxs":
        raw.pop("layer_types")
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_pretrained(path, max_model_len=96)


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("mamba_d_head", 12, r"mamba_d_head: 12 x mamba_n_heads 6 must equal mamba_d_ssm = 96"),
        ("mamba_n_heads", 5, r"mamba_n_heads: 5 does not divide mamba_d_ssm = 96"),
        ("mamba_n_groups", 4, r"mamba_n_groups: 4 does not divide mamba_n_heads 6"),
        ("ssm_multipliers", [1.0, 1.0], r"ssm_multipliers: expected a list of 5 finite numbers"),
        ("mlp_multipliers", [1.0, "x"], r"mlp_multipliers: expected a list of 2 finite numbers"),
        ("key_multiplier", "0.5", r"key_multiplier: expected a finite number"),
        ("lm_head_multiplier", float("inf"), r"lm_head_multiplier: expected a finite number"),
        ("hidden_act", "gelu", r"hidden_act: 'gelu' is not supported for FalconH1ForCausalLM"),
        ("mamba_rms_norm", "yes", r"mamba_rms_norm: expected true or false"),
        ("time_step_limit", [1.0, 0.5], r"time_step_limit: expected \[low, high\]"),
        ("head_dim", 7, r"head_dim: RoPE needs an even head dimension"),
        ("quantization_config", {"quant_method": "gptq"}, r"quantization_config: quantized checkpoints of Falcon"),
    ],
)
def test_falcon_h1_configs_are_checked_at_load(tmp_path: Path, field: str, value: object, match: str) -> None:
    import json

    path = make_falcon_h1(tmp_path / "falcon-h1")
    raw = json.loads((path / "config.json").read_text())
    raw[field] = value
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_pretrained(path, max_model_len=96)


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("linear_num_value_heads", 3, r"linear_num_value_heads: 3 is not a multiple of linear_num_key_heads 2"),
        ("layer_types", ["linear_attention"] * 4, r"layer_types: Qwen3NextForCausalLM needs at least one full_att"),
        ("layer_types", ["linear_attention", "mamba", "full_attention", "full_attention"], r"layer_types: expected 4"),
        ("num_experts_per_tok", 5, r"num_experts_per_tok: 5 is more than num_experts 4"),
        ("mlp_only_layers", "all", r"mlp_only_layers: expected a list of layer indices"),
        ("rope_parameters", {"rope_theta": 1e4, "partial_rotary_factor": 0.01}, r"partial_rotary_factor: 0.01 gives 0"),
        ("head_dim", None, r"head_dim: expected an integer >= 1"),
        ("linear_conv_kernel_dim", 1, r"linear_conv_kernel_dim: expected an integer >= 2"),
        ("hidden_act", "gelu", r"hidden_act: 'gelu' is not supported for Qwen3NextForCausalLM"),
        ("quantization_config", {"quant_method": "fp8"}, r"quantization_config: quantized checkpoints of Qwen3Next"),
    ],
)
def test_qwen3_next_configs_are_checked_at_load(tmp_path: Path, field: str, value: object, match: str) -> None:
    import json

    path = make_qwen3_next(tmp_path / "qwen3-next")
    raw = json.loads((path / "config.json").read_text())
    raw[field] = value
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_pretrained(path, max_model_len=96)


@pytest.mark.parametrize("chunk", [7, 64])
def test_the_chunked_delta_rule_is_transformers_recurrence(chunk: int) -> None:
    """Prefill's chunked delta rule from a state, chunks cut mid-sequence, against transformers'
    per-token `torch_recurrent_gated_delta_rule`; and decode's batched step against the same."""
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_recurrent_gated_delta_rule

    from triollm.engine.execution.layers.gated_deltanet import chunk_delta_rule, recurrent_delta_rule

    g = torch.Generator().manual_seed(chunk)
    t, heads, dk, dv = 150, 3, 8, 12
    q, k = (torch.nn.functional.normalize(torch.randn(t, heads, dk, generator=g), dim=-1) for _ in range(2))
    v = torch.randn(t, heads, dv, generator=g)
    decay = -torch.rand(t, heads, generator=g) * 0.5
    beta = torch.rand(t, heads, generator=g)
    state = torch.randn(heads, dk, dv, generator=g)
    ref, ref_state = torch_recurrent_gated_delta_rule(
        q[None], k[None], v[None], decay[None], beta[None], initial_state=state[None], output_final_state=True
    )
    out, final = chunk_delta_rule(q * dk**-0.5, k, v, decay, beta, state, chunk)
    torch.testing.assert_close(out, ref[0], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(final, ref_state[0], atol=2e-5, rtol=1e-4)
    s, step = recurrent_delta_rule(q[:1] * dk**-0.5, k[:1], v[:1], decay[:1], beta[:1], state[None])
    first, first_state = torch_recurrent_gated_delta_rule(
        q[None, :1], k[None, :1], v[None, :1], decay[None, :1], beta[None, :1], initial_state=state[None],
        output_final_state=True,
    )  # fmt: skip
    torch.testing.assert_close(step, first[0], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(s, first_state, atol=2e-5, rtol=1e-4)


def test_state_slots_follow_the_blocks() -> None:
    """A slot is taken with the first block, returned with the blocks, and never shared."""
    from types import SimpleNamespace

    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False, num_state_slots=2)

    def req() -> SimpleNamespace:
        return SimpleNamespace(state_slot=None, block_ids=[], block_hashes=[], num_released_blocks=0)

    a, b, c = req(), req(), req()
    assert bm.allocate(a, 1) and bm.allocate(b, 1)
    assert {a.state_slot, b.state_slot} == {0, 1}
    assert not bm.allocate(c, 1) and c.state_slot is None and c.block_ids == []  # no slot: nothing taken
    a.held_block_ids = a.block_ids
    slot = a.state_slot
    bm.free(a)
    assert a.state_slot is None
    assert bm.allocate(c, 1) and c.state_slot == slot
