"""GPTQ, AWQ, compressed-tensors and FP8 checkpoints (engine/loading/quant_checkpoints.py): tiny
checkpoints written in the published layouts by tests/quant_formats.py, read back

(a) exactly: each module's weight equals the format's own dequantization formula, bit for bit
    in fp32; the kernels' QuantWeight too for symmetric schemes, and within the float16 rounding
    of m = -scale * zero (half a float16 ulp of scale * zero, plus fp32's rounding) otherwise;
(b) end to end: greedy decoding through the engine against the same engine on a plain fp32
    checkpoint of the dequantized weights. The quantized kernels quantize activations to int8 per
    block of 32 (~0.5% error per layer), and the tiny random model's next-token distributions are
    flat (top-1 near -1 nat), so greedy paths may part: teacher-forced on the quantized engine's
    tokens, every chosen token is within 0.35 nat of the fp32 model's top-1, and its logprob within
    0.35 nat of the fp32 model's (a wrong nibble order, zero or act order misses by 10+). FP8
    weights are dequantized, so those engines agree to 1e-4 and greedy is identical;
(c) refusals name the field.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from quant_formats import FORMATS, Kind, quantization_config, write_dense, write_quantized
from safetensors.torch import load_file, save_file
from tinymodel import make_tiny_model

from triollm.engine.config import EngineArgs
from triollm.engine.config_codec import decode_config, encode_config
from triollm.engine.execution.layers.linear import Linear
from triollm.engine.execution.layers.quantized import QuantLinear
from triollm.engine.loading.hf_config import parse_hf_config
from triollm.engine.loading.quant_checkpoints import (
    IntLinear,
    parse_quantization_config,
    quantized_modules,
    read_linear,
)
from triollm.engine.sampling_params import SamplingParams
from triollm.engine.sync_engine import SyncEngine
from triollm.kernels import cpu_native

PROMPT = list(range(5, 25))
TOLERANCE = 0.35  # nats, (b) in the module note


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("quant-checkpoints")
    make_tiny_model(path / "src")
    return path


@pytest.fixture(scope="module")
def checkpoints(root: Path) -> dict[str, tuple[Path, Path, dict[str, torch.Tensor]]]:
    """Every format's checkpoint, its fp32 reference, and its dequantized weights by name."""
    out = {}
    for name, kind in FORMATS.items():
        dequantized = write_quantized(root / "src", root / name, kind)
        out[name] = (root / name, write_dense(root / "src", root / f"{name}-fp32", dequantized), dequantized)
    return out


def _engine(path: Path, **kwargs: Any) -> SyncEngine:
    return SyncEngine.from_engine_args(EngineArgs(model=str(path), max_model_len=256, num_threads=1, **kwargs))


# ------------------------------------------------------------------------------ (a) exact


@pytest.mark.parametrize("name", list(FORMATS))
def test_weights_are_the_formats_own_dequantization(name: str, checkpoints: dict[str, Any]) -> None:
    path, _, dequantized = checkpoints[name]
    tensors = load_file(str(path / "model.safetensors"))
    quant = parse_quantization_config(json.loads((path / "config.json").read_text())["quantization_config"])
    modules = quantized_modules(tensors, quant)
    assert len(modules) == 14  # 7 projections x 2 layers; the lm_head stays float
    kind = FORMATS[name]
    for prefix, scheme in modules.items():
        ref = dequantized[f"{prefix}.weight"]
        weight = read_linear(tensors, prefix, scheme, quant.zero_offset)
        if not isinstance(weight, IntLinear):  # FP8: dequantized at load
            assert kind.method in ("ct-fp8", "fp8-block") and torch.equal(weight, ref)
            continue
        assert torch.equal(weight.dequantize(), ref), prefix
        assert (weight.perm is not None) == (kind.desc_act and ref.shape[1] > kind.group), prefix
        qw = weight.quant_weight(prefix)
        assert qw.bits == kind.bits and qw.q.numel() == ref.numel() * kind.bits // 8
        got = qw.dequantize()
        in_kernel_order = ref if weight.perm is None else ref[:, weight.perm]
        if kind.sym:
            assert torch.equal(got, in_kernel_order), prefix
        else:  # m = -scale * zero rounded to float16 once
            sz = (weight.scale * weight.zero).abs().repeat_interleave(32, dim=1)
            bound = sz * 2.0**-11 + in_kernel_order.abs() * 2.0**-23
            assert ((got - in_kernel_order).abs() <= bound).all(), prefix


def test_groups_that_split_a_block_are_refused(checkpoints: dict[str, Any]) -> None:
    path, _, _ = checkpoints["gptq-4bit-g32-asym-act-v2"]
    tensors = load_file(str(path / "model.safetensors"))
    quant = parse_quantization_config(json.loads((path / "config.json").read_text())["quantization_config"])
    prefix = "model.layers.0.self_attn.o_proj"
    tensors[f"{prefix}.g_idx"] = (torch.arange(64) >= 16).to(torch.int32)  # groups of 16 and 48 columns
    with pytest.raises(ValueError, match=r"o_proj: group_size: groups must be whole blocks of 32"):
        read_linear(tensors, prefix, quant.groups[0].weights, quant.zero_offset)


# ------------------------------------------------------------------------------ (b) the engine


def _teacher_forced(engine: SyncEngine, ids: list[int]) -> list[dict[int, Any]]:
    (out,) = engine.generate(
        [{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    )
    return out.prompt_logprobs[len(PROMPT) :]  # type: ignore[no-any-return]


def _compare(quantized: SyncEngine, dense: SyncEngine, tolerance: float) -> tuple[list[int], list[int]]:
    """Greedy tokens of both; asserts the bounds of the module note on the quantized engine's."""
    params = SamplingParams(max_tokens=24, temperature=0.0)
    (q_out,) = quantized.generate([{"prompt_token_ids": PROMPT}], params)
    (d_out,) = dense.generate([{"prompt_token_ids": PROMPT}], params)
    tokens = list(q_out.outputs[0].token_ids)
    ids = PROMPT + tokens
    for pos, (d, q, tok) in enumerate(
        zip(_teacher_forced(dense, ids), _teacher_forced(quantized, ids), tokens, strict=True)
    ):
        top = max(lp.logprob for lp in d.values())
        assert top - d[tok].logprob <= tolerance, (pos, top, d[tok].logprob)
        assert abs(d[tok].logprob - q[tok].logprob) <= tolerance, (pos, d[tok].logprob, q[tok].logprob)
    return tokens, list(d_out.outputs[0].token_ids)


@pytest.mark.parametrize("name", list(FORMATS))
def test_generates_as_the_dequantized_fp32_model(name: str, checkpoints: dict[str, Any]) -> None:
    path, fp32, _ = checkpoints[name]
    kind = FORMATS[name]
    quantized = _engine(path, kv_cache_dtype="float32")  # the int8 activations are the only difference
    model = quantized.core.model
    assert model is not None
    expected_method = {
        "ct-pack": "compressed-tensors",
        "ct-int8": "compressed-tensors",
        "ct-fp8": "compressed-tensors",
        "fp8-block": "fp8",
    }
    assert model.cfg.quantization == expected_method.get(kind.method, kind.method)
    layer = model.layers[0]
    projections = [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj]
    assert isinstance(model.lm_head, Linear)  # listed in `ignore` / not quantized: stays float
    dense = _engine(fp32)
    if kind.method in ("ct-fp8", "fp8-block"):
        assert all(type(p) is Linear for p in projections)
        tokens, reference = _compare(quantized, dense, 1e-4)
        assert tokens == reference
        return
    assert all(isinstance(p, QuantLinear) and p.bits == kind.bits for p in projections)
    permuted = [p.perm is not None for p in projections if isinstance(p, QuantLinear)]
    assert permuted == ([kind.group < 64, kind.group < 64, kind.group < 64, True] if kind.desc_act else [False] * 4)
    if cpu_native.available():  # act order takes the layer-by-layer path
        assert (model.decode_stack is None) == kind.desc_act
    _compare(quantized, dense, TOLERANCE)


def test_dequantized_with_quantization_none_it_is_the_fp32_model(checkpoints: dict[str, Any]) -> None:
    path, fp32, _ = checkpoints["gptq-4bit-g64-asym-act"]
    quantized = _engine(path, quantization="none")
    assert quantized.core.model is not None and quantized.core.model.cfg.quantization is None
    assert not any(isinstance(m, QuantLinear) for m in quantized.core.model.modules())
    tokens, reference = _compare(quantized, _engine(fp32), 1e-5)
    assert tokens == reference


def test_int8_requantizes_an_fp8_checkpoint(checkpoints: dict[str, Any]) -> None:
    path, fp32, _ = checkpoints["ct-fp8-dynamic"]
    quantized = _engine(path, quantization="int8", kv_cache_dtype="float32")
    assert quantized.core.model is not None
    linears = [m for m in quantized.core.model.modules() if isinstance(m, QuantLinear)]
    assert len(linears) == 8 and {m.bits for m in linears} == {8}
    _compare(quantized, _engine(fp32), TOLERANCE)


def test_fused_pieces_with_different_act_orders_stay_dense(root: Path, caplog: pytest.LogCaptureFixture) -> None:
    """q, k and v (gate and up) quantized with act orders of their own cannot share one input
    permutation: those projections are dequantized (with a warning), the rest stay quantized."""
    kind = FORMATS["gptq-4bit-g32-asym-act-v2"]
    dequantized = write_quantized(root / "src", root / "own-orders", kind, shared_act_order=False)
    fp32 = write_dense(root / "src", root / "own-orders-fp32", dequantized)
    with caplog.at_level("WARNING", logger="triollm"):
        quantized = _engine(root / "own-orders", kv_cache_dtype="float32")
    assert "self_attn.qkv_proj: its pieces differ in bits or act order" in caplog.text
    model = quantized.core.model
    assert model is not None
    for layer in model.layers:
        assert type(layer.self_attn.qkv_proj) is Linear and type(layer.mlp.gate_up_proj) is Linear
        assert isinstance(layer.self_attn.o_proj, QuantLinear) and isinstance(layer.mlp.down_proj, QuantLinear)
    _compare(quantized, _engine(fp32), TOLERANCE)


def test_a_quantized_lm_head_stays_quantized(root: Path) -> None:
    kind = FORMATS["gptq-4bit-g32-sym"]
    dequantized = write_quantized(root / "src", root / "gptq-head", kind, lm_head=True)
    assert "lm_head.weight" in dequantized
    quantized = _engine(root / "gptq-head", kv_cache_dtype="float32")
    assert quantized.core.model is not None and isinstance(quantized.core.model.lm_head, QuantLinear)
    _compare(quantized, _engine(write_dense(root / "src", root / "gptq-head-fp32", dequantized)), TOLERANCE)


def _as_phi3(src: Path, dst: Path) -> Path:
    """The tiny Llama as a Phi-3 checkpoint: q|k|v and gate|up stored fused."""
    dst.mkdir()
    for f in src.iterdir():
        if f.name not in ("model.safetensors", "config.json"):
            shutil.copy(f, dst / f.name)
    w = load_file(str(src / "model.safetensors"))
    for i in range(2):
        p = f"model.layers.{i}."
        w[p + "self_attn.qkv_proj.weight"] = torch.cat([w.pop(p + f"self_attn.{x}_proj.weight") for x in "qkv"])
        w[p + "mlp.gate_up_proj.weight"] = torch.cat([w.pop(p + f"mlp.{x}_proj.weight") for x in ("gate", "up")])
    save_file(w, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, "architectures": ["Phi3ForCausalLM"], "model_type": "phi3"}))
    return dst


def test_a_fused_checkpoint_keeps_its_fused_blocks(root: Path) -> None:
    """Phi-3 ships qkv_proj and gate_up_proj fused: one quantized tensor each, kept as one QuantLinear."""
    src = _as_phi3(root / "src", root / "phi3")
    dequantized = write_quantized(src, root / "phi3-gptq", FORMATS["gptq-4bit-g32-sym"])
    assert "model.layers.0.self_attn.qkv_proj.weight" in dequantized
    quantized = _engine(root / "phi3-gptq", kv_cache_dtype="float32")
    assert quantized.core.model is not None
    layer = quantized.core.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, QuantLinear) and isinstance(layer.mlp.gate_up_proj, QuantLinear)
    _compare(quantized, _engine(write_dense(src, root / "phi3-fp32", dequantized)), TOLERANCE)


# ------------------------------------------------------------------------------ (c) config


def test_the_checkpoints_method_is_the_default_and_spelled_as_vllm_does(
    checkpoints: dict[str, Any], root: Path
) -> None:
    gptq, awq, src = checkpoints["gptq-4bit-g32-sym"][0], checkpoints["awq-4bit-g32"][0], root / "src"

    def method(path: Path, quantization: str | None = None) -> str | None:
        return EngineArgs(model=str(path), quantization=quantization).create_engine_config().model.quantization

    assert method(gptq) == method(gptq, "gptq") == method(gptq, "gptq_marlin") == "gptq"
    assert method(awq) == method(awq, "awq_marlin") == "awq"
    assert method(gptq, "none") is None
    config = EngineArgs(model=str(gptq)).create_engine_config()  # as an engine core process gets it
    assert decode_config(encode_config(config)) == config and config.model.checkpoint_quant is not None
    with pytest.raises(
        ValueError, match=r"quantization: 'awq' does not match the checkpoint's quantization_config.quant_method 'gptq'"
    ):
        method(gptq, "awq")
    with pytest.raises(
        ValueError, match=r"quantization: 'fp8' reads a checkpoint's quantization_config, and .* has none"
    ):
        method(src, "fp8")
    with pytest.raises(ValueError, match=r"quantization: 'gptq' runs on the CPU only"):
        EngineArgs(model=str(gptq), device="cuda").create_engine_config()
    with pytest.raises(
        ValueError, match=r"quantization: 'bitsandbytes' is not supported; allowed: .*gptq, gptq_marlin, awq"
    ):
        EngineArgs(model=str(gptq), quantization="bitsandbytes")


def _gptq(**fields: Any) -> dict[str, Any]:
    return {**quantization_config(Kind("gptq")), **fields}


def _ct(**weights: Any) -> dict[str, Any]:
    config = quantization_config(Kind("ct-pack"))
    group = config["config_groups"]["group_0"]  # type: ignore[index]
    return {**config, "config_groups": {"group_0": {**group, "weights": {**group["weights"], **weights}}}}


REFUSED: list[tuple[dict[str, Any], str]] = [
    (
        {"quant_method": "bitsandbytes"},
        r"quantization_config.quant_method: 'bitsandbytes' is not supported; supported: gptq, awq, fp8, "
        r"compressed-tensors",
    ),
    ({"quant_method": "exl2", "bits": 4.0}, r"quantization_config.quant_method: 'exl2'"),
    (_gptq(bits=3), r"quantization_config.bits: 3 is not supported; supported: 4, 8"),
    (_gptq(bits=2), r"quantization_config.bits: 2 is not supported"),
    (
        _gptq(group_size=16),
        r"quantization_config.group_size: 16 is not supported; supported: -1 .* or a multiple of 32",
    ),
    (_gptq(group_size=48), r"quantization_config.group_size: 48"),
    (
        _gptq(checkpoint_format="marlin"),
        r"quantization_config.checkpoint_format: 'marlin' is not supported; supported: gptq, gptq_v2",
    ),
    (_gptq(is_marlin_format=True), r"quantization_config.is_marlin_format: True"),
    (_gptq(pack_dtype="int16"), r"quantization_config.pack_dtype: 'int16' is not supported; supported: int32"),
    (
        {**_ct(), "config_groups": {"g": {"targets": ["Linear"], "format": "dense", "weights": {"num_bits": 4}}}},
        r"config_groups.g.format: 'dense' is not supported",
    ),
    (_gptq(dynamic={"-:.*down_proj": {}}), r"quantization_config.dynamic: per-module overrides"),
    (
        {**quantization_config(Kind("awq")), "version": "gemv"},
        r"quantization_config.version: 'gemv' is not supported; supported: gemm",
    ),
    ({**quantization_config(Kind("awq")), "bits": 8}, r"quantization_config.bits: 8 is not supported; supported: 4"),
    ({**quantization_config(Kind("awq")), "zero_point": False}, r"quantization_config.zero_point: False"),
    (
        _ct(num_bits=2),
        r"quantization_config.config_groups.group_0.weights.num_bits: 2 is not supported; supported: 4, 8",
    ),
    (_ct(group_size=16), r"config_groups.group_0.weights.group_size: 16"),
    (_ct(strategy="tensor_group"), r"config_groups.group_0.weights.strategy: 'tensor_group'"),
    (
        {**_ct(), "format": "marlin-24", "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 4}}}},
        r"quantization_config.format: 'marlin-24' is not supported; supported: pack-quantized",
    ),
    (
        {**_ct(), "sparsity_config": {"format": "sparse-24-bitmask"}},
        r"quantization_config.sparsity_config: 'sparse-24-bitmask'",
    ),
    (
        {**_ct(), "kv_cache_scheme": {"num_bits": 8, "type": "float"}},
        r"quantization_config.kv_cache_scheme: not supported",
    ),
    (
        {
            **quantization_config(Kind("ct-int8")),
            "config_groups": {
                "g": {
                    "targets": ["Linear"],
                    "format": "int-quantized",
                    "weights": {"num_bits": 8},
                    "input_activations": {"num_bits": 4},
                }
            },
        },
        r"config_groups.g.input_activations.num_bits: 4 is not supported; supported: 8",
    ),
    (
        {**quantization_config(Kind("fp8-block")), "weight_block_size": [128]},
        r"quantization_config.weight_block_size: \[128\]",
    ),
]


@pytest.mark.parametrize(("config", "match"), REFUSED, ids=[m.split(":")[0].replace("\\", "") for _, m in REFUSED])
def test_unsupported_variants_name_the_field(config: dict[str, Any], match: str) -> None:
    hf = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "vocab_size": 384, "quantization_config": config}  # fmt: skip
    with pytest.raises(ValueError, match=match):
        parse_hf_config(hf)


def test_a_quantized_bert_is_refused() -> None:
    with pytest.raises(ValueError, match=r"quantization_config: quantized checkpoints of BertModel are not supported"):
        parse_hf_config({"architectures": ["BertModel"], "quantization_config": quantization_config(Kind("gptq"))})


def test_quantized_tensors_no_group_targets_are_refused(checkpoints: dict[str, Any]) -> None:
    path = checkpoints["ct-w4a16-g32"][0]
    raw = quantization_config(Kind("ct-pack"))
    raw["config_groups"]["group_0"]["targets"] = ["re:.*self_attn.*"]  # type: ignore[index]
    quant = parse_quantization_config(raw)
    with pytest.raises(ValueError, match=r"quantization_config: model.layers.0.mlp.\w+ holds quantized tensors"):
        quantized_modules(load_file(str(path / "model.safetensors")), quant)
