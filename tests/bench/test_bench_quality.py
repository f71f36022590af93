"""`triollm bench quality --checkpoints`, and docs/bench/make_quant_checkpoints.py, on a tiny model
whose widths (256, 512) take groups of 128 and K-quant super-blocks of 256."""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path
from types import ModuleType
from typing import Any

import gguf
import pytest
from gguf import GGMLQuantizationType as T
from quant_formats import Kind
from tiny_gguf import write_tiny_gguf
from tinymodel import make_tiny_model

from triollm.bench.quality import add_quality_parser, checkpoint_label
from triollm.engine.config import EngineArgs

SCRIPT = Path(__file__).resolve().parents[2] / "docs" / "bench" / "make_quant_checkpoints.py"
FORMATS = ["gptq-4bit-g128-sym-act", "ct-w4a16-g128", "Q4_K_M"]


@pytest.fixture(scope="module")
def make() -> ModuleType:
    spec = importlib.util.spec_from_file_location("make_quant_checkpoints", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def made(make: ModuleType, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[Path]]:
    """(root, the dense tiny model, its checkpoints in FORMATS)."""
    root = tmp_path_factory.mktemp("quality")
    hf = make_tiny_model(root / "hf", hidden_size=256, intermediate_size=512)
    write_tiny_gguf(hf, root / "tiny.gguf")  # float32, requantized by the script
    return root, hf, make.write_checkpoints(root / "out", hf, root / "tiny.gguf", FORMATS)


def test_groups_fall_back_to_one_that_divides_every_width(make: ModuleType) -> None:
    smollm = {576, 1536}  # SmolLM2-135M's input widths: 128 divides neither 576
    assert make.group_for(Kind("awq", 4, 128, False), smollm) == 64
    assert make.group_for(Kind("ct-pack", 4, 128, True), smollm) == 64
    assert make.group_for(Kind("gptq", 4, 128, True), smollm) == 128  # g_idx: a short last group
    assert make.group_for(Kind("ct-pack", 4, 128, True), {256, 512}) == 128
    assert make.group_for(Kind("ct-int8", 8, -1, True), {100}) == -1
    assert make.group_for(Kind("awq", 4, 128, False), {48}) is None


def test_the_k_quant_mix_and_its_fallback_for_narrow_rows(
    make: ModuleType, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Q4_K_M as llama.cpp mixes it (Q6_K for a tied embedding and for attn_v / ffn_down in the
    layers it picks); rows not 256 wide (the default tiny model's 64 and 128) in the kept type."""
    names = {"token_embd.weight", *(f"blk.{i}.{t}.weight" for i in range(30) for t in ("attn_v", "ffn_down", "attn_q"))}
    types = make.kquant_types("Q4_K_M", names, 30)
    assert types["token_embd.weight"] == T.Q6_K  # no output.weight: the embedding is the head
    more = [i for i in range(30) if types[f"blk.{i}.attn_v.weight"] == T.Q6_K]
    assert more == [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29]
    assert all(types[f"blk.{i}.ffn_down.weight"] == types[f"blk.{i}.attn_v.weight"] for i in range(30))
    assert {types[f"blk.{i}.attn_q.weight"] for i in range(30)} == {T.Q4_K}

    write_tiny_gguf(tiny_model_dir, tmp_path / "narrow.gguf")
    written = make.write_gguf(tmp_path / "narrow.gguf", tmp_path / "narrow-q4_k_m.gguf", "Q4_K_M")
    matrices = {n: t for n, t in written.items() if t != T.F32}
    assert set(matrices.values()) == {T.Q4_1, T.Q8_0}  # Q4_K -> Q4_1, Q6_K -> Q8_0
    assert matrices["output.weight"] == matrices["blk.1.attn_v.weight"] == T.Q8_0


def test_the_checkpoints_load_in_their_own_schemes(made: tuple[Path, Path, list[Path]]) -> None:
    from triollm.engine.execution.layers.quantized import QuantLinear
    from triollm.engine.sampling_params import SamplingParams
    from triollm.engine.sync_engine import SyncEngine

    root, hf, paths = made
    assert [p.name for p in paths] == ["gptq-4bit-g128-sym-act", "ct-w4a16-g128", "tiny-Q4_K_M.gguf"]
    assert [checkpoint_label(p) for p in paths] == ["gptq-4bit-g128-sym-act", "ct-int4-group128", "gguf-Q4_K_M"]
    source, q4km = gguf.GGUFReader(str(root / "tiny.gguf")), gguf.GGUFReader(str(paths[2]))
    assert q4km.fields["tokenizer.ggml.tokens"].contents() == source.fields["tokenizer.ggml.tokens"].contents()
    assert q4km.fields["general.file_type"].contents() == gguf.LlamaFileType.MOSTLY_Q4_K_M
    expected = {
        "gptq": dict.fromkeys(("qkv_proj", "o_proj", "gate_up_proj", "down_proj"), 4),
        "compressed-tensors": dict.fromkeys(("qkv_proj", "o_proj", "gate_up_proj", "down_proj"), 4),
        # layer 1 is a "more bits" layer of 2: its v (so q|k|v, widened) and down are Q6_K
        "gguf": {"0.qkv_proj": 4, "1.qkv_proj": 8, "0.down_proj": 4, "1.down_proj": 8, "lm_head": 8},
    }
    for path, scheme in zip(paths, expected, strict=True):
        args = EngineArgs(
            model=str(path),
            max_model_len=128,
            num_threads=1,
            cache_dir=str(root / "cache"),
            quantization="gguf" if scheme == "gguf" else None,
        )
        engine = SyncEngine.from_engine_args(args)
        assert engine.config.model.quantization == scheme
        bits = {
            n.removeprefix("layers.").replace("self_attn.", "").replace("mlp.", ""): m.bits
            for n, m in engine.core.model.named_modules()
            if isinstance(m, QuantLinear)
        }
        for name, b in expected[scheme].items():
            found = {k: v for k, v in bits.items() if k == name or k.endswith("." + name)}
            assert found and set(found.values()) == {b}, (scheme, name, bits)
        if scheme == "gptq":  # act order: each linear reads its input permuted
            assert all(m.perm is not None for m in engine.core.model.modules() if isinstance(m, QuantLinear))
        (out,) = engine.generate(
            [{"prompt_token_ids": [40, 41, 42]}], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        )
        assert len(out.outputs[0].token_ids) == 4


def _quality(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    add_quality_parser(parser.add_subparsers(dest="bench"))
    ns = parser.parse_args(["quality", *argv])
    return int(ns.func(ns))


def test_bench_quality_measures_a_checkpoint_next_to_the_dense_model(
    made: tuple[Path, Path, list[Path]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each run in its own child process: the ratio to the dense model, load time and peak RSS
    printed and in the JSON, keyed by the checkpoint's label."""
    root, hf, paths = made
    text = tmp_path / "text.txt"
    text.write_text("The capital of France is Paris. Once upon a time there was a little robot. " * 4)
    out = tmp_path / "quality.json"
    argv = ["--model", str(hf), "--schemes", "", "--checkpoints", str(paths[0]), "--text", str(text), "--window", "64",
            "--max-tokens", "4", "--max-model-len", "128", "--num-threads", "1", "--output-json", str(out),
            "--kv-cache-dtype", "float32"]  # fmt: skip
    # float32: the dense model's own cache for both runs. The random tiny model's perplexity is
    # ~5e10 (peaky logits on text it never saw), so a few tokens set the ratio: 0.53 here, 0.48
    # with the quantized model's default bf16 cache; the bound is a sanity bound, not a quality one.
    assert _quality(argv) == 0
    printed = capsys.readouterr().out
    lines = {line.split()[0]: line for line in printed.splitlines()}
    assert lines.keys() == {"dense", "gptq-4bit-g128-sym-act"}
    assert "x dense); greedy:" in lines["gptq-4bit-g128-sym-act"]
    results: dict[str, Any] = json.loads(out.read_text())
    dense, gptq = results["dense"], results["gptq-4bit-g128-sym-act"]
    assert (dense["quantization"], gptq["quantization"], gptq["model"]) == (None, "gptq", str(paths[0]))
    assert gptq["scored_tokens"] == dense["scored_tokens"] > 32
    assert gptq["kv_cache_blocks"] == dense["kv_cache_blocks"] == 128 // 16 + 1  # one sequence: the same in both
    assert gptq["perplexity_ratio"] == pytest.approx(gptq["perplexity"] / dense["perplexity"])
    assert 0.25 < gptq["perplexity_ratio"] < 4 and 0 <= gptq["greedy_prefix_agreement"] <= 1
    for run in (dense, gptq):
        assert 64 << 20 < run["peak_rss_bytes"] < 8 << 30 and run["load_s"] > 0
        assert f"peak RSS {run['peak_rss_bytes'] / (1 << 20):.0f} MiB" in printed


def test_checkpoints_of_another_model_and_bad_schemes_are_refused_before_any_run(
    made: tuple[Path, Path, list[Path]], tiny_model_dir: Path
) -> None:
    root, hf, paths = made
    common = ["--text", __file__, "--max-model-len", "128"]
    with pytest.raises(ValueError, match=r"checkpoints: .* is not a checkpoint of the dense model \(.*hidden_size 256"):
        _quality(["--model", str(tiny_model_dir), "--schemes", "", "--checkpoints", str(paths[0]), *common])
    with pytest.raises(ValueError, match=r"checkpoints: .* has no config.json with a quantization_config"):
        _quality(["--model", str(hf), "--schemes", "", "--checkpoints", str(hf), *common])
    with pytest.raises(ValueError, match=r"schemes: 'int3' is not a quantization scheme; allowed: gguf, int8, int4"):
        _quality(["--model", str(hf), "--schemes", "int3", *common])
